"""L1: packed training is uncontaminated under every parallel layout (gloo on CPU, tiny fp32 models).

Each case runs tests/functional/scripts/parity.py under torchrun: the per-token loss and every parameter
gradient of thdpack's packed forward step, run through Megatron's get_forward_backward_func under the layout,
must equal a single-rank reference (each sample alone, unpadded, causal; for MoE the padded BSHD batch with the
MoE padding mask) to rtol 1e-5, atol 1e-6. The cases of one world size run in one launch (the script's ``+``),
one after another; each test looks for its own case's PARITY OK line.
"""

import pytest

from .conftest import run_torchrun
from .training import tail

pytestmark = [pytest.mark.functional, pytest.mark.cpu_only]

LAYOUTS = [
    ("tp2", 2),
    ("tp2_sp", 2),
    ("pp2", 2),  # token count differs between micro-batches; every stage's attention must see THD boundaries
    ("cp2", 2),
    ("cp2_tp2", 4),
    ("dp2", 2),
    ("ep2", 2),  # MoE, alltoall dispatcher; the router must count real tokens only
    ("ep2_allgather", 2),  # MoE, allgather dispatcher with a fixed token bucket: trailing pad in the row
    ("mrope_cp2", 2),
]
DISTINCT = [("cp2", 2), ("cp2_tp2", 4)]
OTHER = [  # (arguments, ranks) of the tests below the parametrized ones
    (["--layout", "tp2_pp2", "--own-gloo-tp-groups"], 4),
    (["--layout", "tp2", "--scenario", "segment_ids"], 2),
    (["--layout", "cp2", "--scenario", "all_masked_cp_rank"], 2),
]


def cases(nproc: int) -> list[list[str]]:
    """The script's arguments for every case of ``nproc`` ranks."""
    return [
        *(["--layout", name] for name, n in LAYOUTS if n == nproc),
        *(["--layout", name, "--mode", "distinct"] for name, n in DISTINCT if n == nproc),
        *(args for args, n in OTHER if n == nproc),
    ]


@pytest.fixture(scope="module")
def launched():
    """``nproc -> output`` of one launch of every case of that world size, run once."""
    outputs = {}

    def get(nproc: int) -> str:
        if nproc not in outputs:
            args = [arg for case in cases(nproc) for arg in ["+", *case]][1:]
            outputs[nproc] = run_torchrun("parity.py", nproc=nproc, args=args, timeout=600, check=False)
        return outputs[nproc]

    return get


def passed(output: str, case: str) -> bool:
    return f"PARITY OK {case} " in output


@pytest.mark.parametrize(("layout", "nproc"), LAYOUTS, ids=[name for name, _ in LAYOUTS])
def test_packed_step_matches_reference(launched, layout, nproc):
    out = launched(nproc)
    assert passed(out, f"{layout} mixed mode=auto"), tail(out)


@pytest.mark.parametrize(("layout", "nproc"), DISTINCT, ids=[name for name, _ in DISTINCT])
def test_distinct_boundaries_under_cp_match_reference(launched, layout, nproc):
    # BatchConfig's default under CP is fold; distinct (pad between samples, skipped by attention) is exact too.
    out = launched(nproc)
    assert passed(out, f"{layout} mixed mode=distinct"), tail(out)


def test_tp_batches_reach_pipeline_stages_over_their_own_gloo_groups(launched):
    # The path taken under NCCL: the host batch travels over a separate gloo group per TP group (created by its
    # members only), here with two pipeline stages that start their first micro-batch at different times.
    out = launched(4)
    assert passed(out, "tp2_pp2 mixed mode=auto"), tail(out)


def test_cross_sample_labels_are_masked_in_shared_rows(launched):
    # Two samples in one row with Megatron-shifted labels: the first sample's last label is the second's first
    # token; counting it would make the packed loss differ from each sample alone.
    out = launched(2)
    assert passed(out, "tp2 segment_ids mode=auto"), tail(out)


def test_cp_rank_without_counted_tokens_gives_finite_loss(launched):
    out = launched(2)
    assert passed(out, "cp2 all_masked_cp_rank mode=auto"), tail(out)
