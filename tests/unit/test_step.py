"""BatchConfig (alignment from the model config, dispatcher guard) and loss_func, without process groups."""

from types import SimpleNamespace

import pytest
import torch

from thdpack import Alignment
from thdpack.megatron.batch import BatchConfig, _check_moe_dispatcher
from thdpack.megatron.step import loss_func


def model_config(**overrides):
    base = dict(
        context_parallel_size=1,
        tensor_model_parallel_size=1,
        sequence_parallel=False,
        fp8=None,
        fp8_recipe=None,
        num_moe_experts=None,
        expert_model_parallel_size=1,
        moe_token_dispatcher_type="allgather",
    )
    return SimpleNamespace(**(base | overrides))


def test_auto_mode_is_distinct_without_cp_and_fold_under_cp():
    assert BatchConfig().alignment(model_config()).mode == "distinct"
    assert BatchConfig().alignment(model_config(context_parallel_size=2)).mode == "fold"
    assert BatchConfig(mode="distinct").alignment(model_config(context_parallel_size=2)).mode == "distinct"


def test_alignment_follows_the_parallel_layout_and_precision():
    got = BatchConfig(pad_total_to=256).alignment(
        model_config(
            context_parallel_size=2, tensor_model_parallel_size=4, sequence_parallel=True, fp8="hybrid"
        )
    )
    assert got == Alignment(
        cp_size=2, tp_size=4, sequence_parallel=True, fp8=True, fp8_multiple=16, mode="fold", pad_total_to=256
    )
    assert BatchConfig().alignment(model_config(fp8="e4m3", fp8_recipe="mxfp8")).fp8_multiple == 32


def test_allgather_dispatcher_under_ep_needs_a_token_bucket():
    moe = model_config(num_moe_experts=4, expert_model_parallel_size=2)
    with pytest.raises(
        ValueError, match="set BatchConfig.pad_total_to .* or use moe_token_dispatcher_type='alltoall'"
    ):
        _check_moe_dispatcher(moe, BatchConfig())
    _check_moe_dispatcher(moe, BatchConfig(pad_total_to=1024))
    _check_moe_dispatcher(
        model_config(num_moe_experts=4, expert_model_parallel_size=2, moe_token_dispatcher_type="alltoall"),
        BatchConfig(),
    )
    _check_moe_dispatcher(moe, BatchConfig(pack_sequences_in_batch=False))


def test_loss_func_sums_counted_tokens_and_counts_them():
    losses = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0, 0.0]])
    loss_sum, num_tokens, report = loss_func(mask, losses)
    assert loss_sum.item() == 4.0 and num_tokens.item() == 2 and num_tokens.dtype == torch.int
    assert report["lm loss"].tolist() == [4.0, 2.0]


def test_loss_func_is_finite_on_a_rank_without_counted_tokens():
    # Non-finite losses on masked positions (pad) must not leak into the sum: NaN * 0 is NaN.
    losses = torch.tensor([[float("nan"), float("inf"), 5.0]], requires_grad=True)
    loss_sum, num_tokens, _ = loss_func(torch.zeros(1, 3), losses)
    assert loss_sum.item() == 0.0 and num_tokens.item() == 0
    loss_sum.backward()
    assert torch.isfinite(losses.grad).all()
