"""The batch seam: a hook transforms the reader's host batch before packing, entries that are not token-aligned
reach the model family's forward in ``ModelInputs.extra``, and the step calls the family and the loss it is
given (one process: the parallel state of a single rank)."""

from types import SimpleNamespace

import pytest
import torch

from thdpack.megatron.batch import BatchConfig, get_batch
from thdpack.megatron.loss import TokenLoss
from thdpack.megatron.step import make_forward_step


@pytest.fixture
def single_rank(monkeypatch):
    from megatron.core import parallel_state as ps

    for name, value in [
        ("get_tensor_model_parallel_rank", 0),
        ("get_tensor_model_parallel_world_size", 1),
        ("get_context_parallel_world_size", 1),
        ("get_context_parallel_rank", 0),
        ("is_pipeline_first_stage", True),
        ("is_pipeline_last_stage", True),
    ]:
        monkeypatch.setattr(ps, name, lambda *a, _v=value, **k: _v)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    return SimpleNamespace(sequence_parallel=False, fp8=None, num_moe_experts=None)


def loader_batch():
    return {
        "tokens": torch.tensor([[11, 12, 13, 0], [21, 22, 0, 0]]),
        "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]),
        "pixel_values": torch.arange(12, dtype=torch.float32).view(6, 2),  # [P, C]: not token-aligned
        "image_grid_thw": torch.tensor([[1, 2, 3]]),  # [I, 3]
    }


def add_one_to_tokens(batch):
    # A host-side transform, as a VLM computes MRoPE ids from the image grids before packing.
    assert all(t.is_cpu for t in batch.values())
    return {**batch, "tokens": batch["tokens"] + 1}


@pytest.mark.parametrize("pack", [True, False])
def test_the_hook_transforms_the_batch_and_carried_entries_reach_the_inputs(single_rank, pack):
    config = BatchConfig(
        pack_sequences_in_batch=pack,
        transform=add_one_to_tokens,
        carry_keys=("pixel_values", "image_grid_thw"),
    )
    inputs = get_batch(iter([loader_batch()]), single_rank, config)
    expected = [[12, 13, 14, 22, 23]] if pack else [[12, 13, 14, 1], [22, 23, 1, 1]]
    assert inputs.tokens.tolist() == expected
    assert set(inputs.extra) == {"pixel_values", "image_grid_thw"}
    assert torch.equal(inputs.extra["pixel_values"], loader_batch()["pixel_values"])
    assert inputs.extra["image_grid_thw"].tolist() == [[1, 2, 3]]


def test_a_carry_key_missing_from_the_batch_is_named(single_rank):
    config = BatchConfig(carry_keys=("pixel_values", "video_grid_thw"))
    with pytest.raises(
        ValueError, match=r"batch lacks the key\(s\) \['video_grid_thw'\] of BatchConfig.carry_keys"
    ):
        get_batch(iter([loader_batch()]), single_rank, config)


def test_an_uncarried_image_tensor_is_refused_by_the_packer_not_dropped(single_rank):
    with pytest.raises(ValueError, match="batch key 'image_grid_thw' is \\[1, 3\\]"):
        get_batch(iter([loader_batch()]), single_rank, BatchConfig(carry_keys=("pixel_values",)))


def test_the_step_calls_the_family_forward_and_its_loss(single_rank):
    seen = {}

    def vision_forward(model, inputs):
        # What a VLM family does with the carried images; here the per-token "loss" is the token id.
        seen["pixel_sum"] = float(inputs.extra["pixel_values"].sum())
        return inputs.tokens.float()

    model = SimpleNamespace(config=single_rank)
    step = make_forward_step(
        BatchConfig(carry_keys=("pixel_values", "image_grid_thw")),
        forward=vision_forward,
        loss=TokenLoss(key="toy loss"),
    )
    output, loss_func = step(iter([loader_batch()]), model)
    assert seen["pixel_sum"] == float(sum(range(12)))
    loss_sum, num_tokens, report = loss_func(output)
    # Targets: 12, 13 (row 0) and 22 (row 1); each sample's last token has none.
    assert (loss_sum.item(), num_tokens.item()) == (11 + 12 + 21, 3)
    assert list(report) == ["toy loss"]
