"""L1: packed training is uncontaminated under every parallel layout (gloo on CPU, tiny fp32 models).

Each case runs tests/functional/scripts/parity.py under torchrun: the per-token loss and every parameter
gradient of thdpack's packed forward step, run through Megatron's get_forward_backward_func under the layout,
must equal a single-rank reference (each sample alone, unpadded, causal; for MoE the padded BSHD batch with the
MoE padding mask) to rtol 1e-5, atol 1e-6.
"""

import pytest

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


@pytest.mark.parametrize(("layout", "nproc"), LAYOUTS, ids=[name for name, _ in LAYOUTS])
def test_packed_step_matches_reference(run_torchrun, layout, nproc):
    out = run_torchrun("parity.py", nproc=nproc, args=["--layout", layout], timeout=240)
    assert f"PARITY OK {layout} mixed" in out


@pytest.mark.parametrize("layout", ["cp2", "cp2_tp2"])
def test_distinct_boundaries_under_cp_match_reference(run_torchrun, layout):
    # BatchConfig's default under CP is fold; distinct (pad between samples, skipped by attention) is exact too.
    out = run_torchrun(
        "parity.py",
        nproc=4 if layout == "cp2_tp2" else 2,
        args=["--layout", layout, "--mode", "distinct"],
        timeout=240,
    )
    assert f"PARITY OK {layout} mixed" in out


def test_tp_batches_reach_pipeline_stages_over_their_own_gloo_groups(run_torchrun):
    # The path taken under NCCL: the host batch travels over a separate gloo group per TP group (created by its
    # members only), here with two pipeline stages that start their first micro-batch at different times.
    out = run_torchrun(
        "parity.py", nproc=4, args=["--layout", "tp2_pp2", "--own-gloo-tp-groups"], timeout=240
    )
    assert "PARITY OK tp2_pp2 mixed" in out


def test_cross_sample_labels_are_masked_in_shared_rows(run_torchrun):
    # Two samples in one row with Megatron-shifted labels: the first sample's last label is the second's first
    # token; counting it would make the packed loss differ from each sample alone.
    out = run_torchrun(
        "parity.py", nproc=2, args=["--layout", "tp2", "--scenario", "segment_ids"], timeout=240
    )
    assert "PARITY OK tp2 segment_ids" in out


def test_cp_rank_without_counted_tokens_gives_finite_loss(run_torchrun):
    out = run_torchrun(
        "parity.py", nproc=2, args=["--layout", "cp2", "--scenario", "all_masked_cp_rank"], timeout=240
    )
    assert "PARITY OK cp2 all_masked_cp_rank" in out
