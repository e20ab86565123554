"""The fused Triton kernels (thdpack.fused) give exactly what the host paths give: the packing kernel what
pack_bshd's host path gives, the row-statistics kernel what a plain statement of each statistic gives (and
find_segments through it what find_segments on the host gives, errors included).

Each check runs in its own process (``scripts/fused_check.py``, ``scripts/row_stats_check.py``): on a machine without CUDA with
``TRITON_INTERPRET=1``, which Triton must see before it is first imported, so the kernel's logic is tested
in CI; on a GPU, compiled. ``tests/unit/test_pack_gpu.py`` also runs ``pack_bshd`` through the kernel.
Skipped when Triton is not installed (it is in the ``dev`` extra on Linux).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Triton is in the dev extra on Linux x86-64 (CI); elsewhere it may not install, and this test says so.
pytest.importorskip("triton", reason="Triton is not installed (the dev extra has it on Linux x86-64)")


def run_check(script: str, n: int) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    path = Path(__file__).parent / "scripts" / script
    return subprocess.run(
        [sys.executable, str(path), str(n)], capture_output=True, text=True, env=env, timeout=600
    )


def test_fused_kernel_equals_the_host_path():
    proc = run_check("fused_check.py", 60)
    assert proc.returncode == 0 and "FUSED OK 60/60" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_row_stats_kernel_equals_its_statement_and_find_segments_the_host_path():
    # 100 masks: ten forms (0/1 right and left padded, holes, segment ids, negative, fractional, NaN, inf,
    # empty and full rows) in each of the ten dtypes the kernel takes, widths around its 1024-column block.
    proc = run_check("row_stats_check.py", 100)
    assert proc.returncode == 0 and "ROW STATS OK 100/100" in proc.stdout, (
        proc.stdout[-3000:] + proc.stderr[-3000:]
    )
