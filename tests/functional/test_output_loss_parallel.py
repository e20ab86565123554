"""The chunked output loss under tensor parallelism (two ranks, gloo on CPU) equals megatron-core's output layer
and vocab-parallel cross entropy: losses and every gradient, with and without sequence parallelism, tied and untied
embeddings. What each case checks is in scripts/output_loss_parallel.py."""

import pytest

pytestmark = [pytest.mark.functional, pytest.mark.cpu_only]


def test_chunked_output_loss_equals_megatrons_under_tensor_parallelism(run_torchrun):
    out = run_torchrun("output_loss_parallel.py", nproc=2, timeout=180)
    for case in ("tp2 untied", "tp2 tied", "tp2sp untied", "tp2sp tied"):
        assert out.count(f"[{case}] rank") == 2, out
