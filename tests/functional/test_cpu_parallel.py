"""Megatron-core on CPU over gloo (thdpack.megatron.cpu): two ranks under each parallel layout give
the single-rank loss. What each case checks is in scripts/cpu_parallel_smoke.py; one launch runs every layout,
one after another, and each test looks for its own layout's lines."""

import pytest

from .conftest import run_torchrun

pytestmark = [pytest.mark.functional, pytest.mark.cpu_only]

LAYOUTS = [
    "tp2",  # tensor parallel
    "tp2sp",  # tensor + sequence parallel (SP all-gather / reduce-scatter on gloo, torch norm under SP)
    "pp2",  # pipeline parallel, 2 micro-batches of different lengths, variable_seq_lengths=True
    "ep2",  # MoE, expert parallel, allgather dispatcher
    "ep2_alltoall",  # MoE, expert parallel, alltoall dispatcher (the one that allows variable lengths)
]


@pytest.fixture(scope="module")
def output():
    return run_torchrun(
        "cpu_parallel_smoke.py", nproc=2, args=["--layout", *LAYOUTS], timeout=300, check=False
    )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_parallel_loss_matches_single_rank(output, layout):
    tail = "\n".join(output.splitlines()[-60:])
    assert f"[{layout}] rank" in output, tail
    assert f"[{layout}] rank 0: checks passed" in output and f"[{layout}] rank 1: checks passed" in output, (
        tail
    )
