"""Which parallel layouts a checkpoint resumes on (thdpack.megatron.parallel_layout.check_resumable): any, in the
fully_reshardable format; only the same TP/PP/CP/EP in dp_reshardable; a mixture of experts keeps ep at 1 or above
1. Every refusal names the saved and the requested layout. The resumes themselves run in
tests/functional/test_resume_layout.py.
"""

import pytest

from thdpack.megatron.parallel_layout import ParallelLayout, check_resumable

DP1 = ParallelLayout(world=1, dp=1, tp=1, pp=1, cp=1, ep=1)
DP2 = ParallelLayout(world=2, dp=2, tp=1, pp=1, cp=1, ep=1)
TP2 = ParallelLayout(world=2, dp=1, tp=2, pp=1, cp=1, ep=1)
PP2 = ParallelLayout(world=2, dp=1, tp=1, pp=2, cp=1, ep=1)
EP2 = ParallelLayout(world=2, dp=2, tp=1, pp=1, cp=1, ep=2)
EP4 = ParallelLayout(world=4, dp=4, tp=1, pp=1, cp=1, ep=4)
WHERE = "ckpt/iter_0000003"


@pytest.mark.parametrize(("saved", "current"), [(DP1, DP2), (DP1, TP2), (PP2, DP1), (TP2, PP2), (EP2, EP4)])
def test_fully_reshardable_resumes_on_any_layout(saved, current):
    check_resumable(saved, current, "fully_reshardable", WHERE, has_experts=True)


def test_dp_reshardable_resumes_on_another_data_parallel_size():
    check_resumable(DP1, DP2, "dp_reshardable", WHERE)


@pytest.mark.parametrize(("saved", "current", "changed"), [(DP1, TP2, "tp"), (PP2, DP1, "pp")])
def test_dp_reshardable_refuses_another_model_cut_naming_both_layouts(saved, current, changed):
    with pytest.raises(ValueError) as refused:
        check_resumable(saved, current, "dp_reshardable", WHERE)
    message = str(refused.value)
    assert f"{WHERE} was saved on {saved}" in message
    assert f"this run is {current} ({changed} changed)" in message
    assert "checkpoint.optimizer_format=fully_reshardable" in message


@pytest.mark.parametrize(("saved", "current"), [(DP2, EP2), (EP2, DP2)])
def test_experts_keep_ep_one_or_above_one(saved, current):
    with pytest.raises(
        ValueError, match=r"was saved on .*\(ep [12]\); this run is .*expert_model_parallel_size"
    ):
        check_resumable(saved, current, "fully_reshardable", WHERE, has_experts=True)


def test_a_dense_model_ignores_the_expert_parallel_size():
    check_resumable(DP2, EP2, "fully_reshardable", WHERE, has_experts=False)


def test_a_checkpoint_without_a_layout_is_left_to_dist_checkpointing():
    check_resumable(None, TP2, "dp_reshardable", WHERE)


def test_an_unknown_optimizer_format_is_refused():
    with pytest.raises(ValueError, match="format 'fully_sharded_model_space'"):
        check_resumable(DP1, DP1, "fully_sharded_model_space", WHERE)


def test_the_layout_round_trips_through_the_checkpoint_metadata():
    assert ParallelLayout.from_dict(TP2.as_dict()) == TP2
    assert ParallelLayout.from_dict(None) is None


def test_a_layout_missing_a_size_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"lacks \['ep'\]"):
        ParallelLayout.from_dict({k: v for k, v in TP2.as_dict().items() if k != "ep"})


def test_the_layout_reads_as_the_start_up_log_writes_it():
    assert str(TP2) == "world 2 = dp 1 x tp 2 x pp 1 x cp 1 (ep 1)"
