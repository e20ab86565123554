"""The fused Triton packing kernel (thdpack.fused) gives exactly what pack_bshd's host path gives.

The check runs in its own process (``scripts/fused_check.py``): on a machine without CUDA with
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


def test_fused_kernel_equals_the_host_path():
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    script = Path(__file__).parent / "scripts" / "fused_check.py"
    proc = subprocess.run(
        [sys.executable, str(script), "60"], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0 and "FUSED OK 60/60" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
