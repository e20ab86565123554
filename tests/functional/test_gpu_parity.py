"""GPU check (not CI): the L1 parity cases with Transformer Engine attention, bf16, NCCL.

Skipped without enough CUDA GPUs or without Transformer Engine. Prints one ``GPU PARITY`` line per case with
the loss and gradient differences, and the attention backend TE selected (NVTE_DEBUG logging).
"""

import re

import pytest
import torch

from .test_parity import LAYOUTS

pytestmark = [pytest.mark.gpu, pytest.mark.functional]


@pytest.mark.parametrize(("layout", "nproc"), LAYOUTS, ids=[name for name, _ in LAYOUTS])
def test_packed_step_matches_reference_with_te(run_torchrun, layout, nproc):
    pytest.importorskip("transformer_engine.pytorch")
    if torch.cuda.device_count() < nproc:
        pytest.skip(f"{layout} needs {nproc} GPUs, this host has {torch.cuda.device_count()}")
    out = run_torchrun(
        "parity.py",
        nproc=nproc,
        args=["--layout", layout, "--device", "cuda", "--backend", "te"],
        timeout=150,
        env={"NVTE_DEBUG": "1", "NVTE_DEBUG_LEVEL": "2", "NCCL_NVLS_ENABLE": "0"},
        tail_lines=40,
    )
    backends = sorted(set(re.findall(r"Selected backend = (\w+)", out)))
    summary = [line for line in out.splitlines() if "GPU PARITY" in line]
    print(f"{summary[0] if summary else ''} te_backends={backends}")
    assert f"PARITY OK {layout}" in out
