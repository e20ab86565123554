"""The alignment a model config implies, the MoE dispatcher rule and the per-token loss, without process groups."""

from types import SimpleNamespace

import pytest
import torch

from thdpack import Alignment
from thdpack.megatron.batch import ModelInputs, alignment_for, allgather_dispatch_rule
from thdpack.megatron.loss import LM_LOSS, TokenLoss


def model_config(**overrides):
    base = dict(sequence_parallel=False, fp8=None, fp8_recipe=None)
    return SimpleNamespace(**(base | overrides))


def inputs_with(loss_mask):
    return ModelInputs(tokens=None, position_ids=None, labels=None, loss_mask=loss_mask)


def test_auto_mode_is_distinct_without_cp_and_fold_under_cp():
    assert alignment_for(model_config(), cp_size=1, tp_size=1).mode == "distinct"
    assert alignment_for(model_config(), cp_size=2, tp_size=1).mode == "fold"
    assert alignment_for(model_config(), cp_size=2, tp_size=1, mode="distinct").mode == "distinct"


def test_alignment_follows_the_parallel_layout_and_precision():
    got = alignment_for(
        model_config(sequence_parallel=True, fp8="hybrid"), cp_size=2, tp_size=4, pad_total_to=256
    )
    assert got == Alignment(
        cp_size=2, tp_size=4, sequence_parallel=True, fp8=True, fp8_multiple=16, mode="fold", pad_total_to=256
    )
    assert alignment_for(model_config(fp8="e4m3", fp8_recipe="mxfp8"), 1, 1).fp8_multiple == 32


def test_allgather_dispatcher_under_ep_needs_a_token_bucket():
    assert "packed rows differ in length" in allgather_dispatch_rule(True, 4, 2, "allgather", None)
    assert allgather_dispatch_rule(True, 4, 2, "allgather", 1024) is None
    assert allgather_dispatch_rule(True, 4, 2, "alltoall", None) is None
    assert allgather_dispatch_rule(True, 4, 1, "allgather", None) is None
    assert allgather_dispatch_rule(False, 4, 2, "allgather", None) is None
    assert allgather_dispatch_rule(True, None, 2, "allgather", None) is None


def test_token_loss_sums_counted_tokens_and_counts_them():
    losses = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0, 0.0]])
    loss_sum, num_tokens, report = LM_LOSS(inputs_with(mask), losses)
    assert loss_sum.item() == 4.0 and num_tokens.item() == 2 and num_tokens.dtype == torch.int
    assert report["lm loss"].tolist() == [4.0, 2.0]


def test_token_loss_is_finite_on_a_rank_without_counted_tokens():
    # Non-finite losses on masked positions (pad) must not leak into the sum: NaN * 0 is NaN.
    losses = torch.tensor([[float("nan"), float("inf"), 5.0]], requires_grad=True)
    loss_sum, num_tokens, _ = LM_LOSS(inputs_with(torch.zeros(1, 3)), losses)
    assert loss_sum.item() == 0.0 and num_tokens.item() == 0
    loss_sum.backward()
    assert torch.isfinite(losses.grad).all()


def test_a_custom_loss_reports_under_its_own_key():
    class Doubled(TokenLoss):
        def token_losses(self, inputs, output_tensor):
            return 2 * output_tensor

    loss_sum, num_tokens, report = Doubled(key="doubled")(
        inputs_with(torch.ones(1, 2)), torch.tensor([[1.0, 3.0]])
    )
    assert loss_sum.item() == 8.0 and num_tokens.item() == 2
    assert list(report) == ["doubled"] and report["doubled"].tolist() == [8.0, 2.0]


def test_first_nonfinite_names_the_micro_batch_from_one():
    finite, bad = torch.tensor([1.0, 2.0]), torch.tensor([float("nan"), 2.0])
    assert LM_LOSS.first_nonfinite([{"lm loss": finite}, {"lm loss": bad}, {"lm loss": bad}]).item() == 2
    assert LM_LOSS.first_nonfinite([{"lm loss": finite}]).item() == 0


@pytest.mark.parametrize("name", ["nope", "thdpack.models.family:COMMON_MODEL_KEYS"])
def test_an_unknown_or_wrong_family_is_named(name):
    from thdpack.models import get_family

    with pytest.raises(ValueError, match="model.family"):
        get_family(name)


def test_a_family_named_by_module_and_attribute_is_found():
    from thdpack.models import get_family, gpt

    assert get_family("gpt") is gpt.FAMILY
    assert get_family("thdpack.models.gpt:FAMILY") is gpt.FAMILY


def test_a_family_naming_architectures_must_read_and_write_their_checkpoints():
    from thdpack.models import ModelFamily, gpt

    with pytest.raises(ValueError, match="family 'half': a Hugging Face architecture's family has"):
        ModelFamily(
            name="half", build=gpt.build, forward=gpt.FAMILY.forward, architectures=("HalfForCausalLM",)
        )
