"""DeepStack's placement rule on Megatron's decoder: the features are added after decoder layers 1..k of the first
pipeline stage (which runs the vision tower), so every one of those layers must be there and on no other stage;
the addend is the features' rows at the image tokens and exactly 0 elsewhere."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from thdpack.megatron.deepstack import check_deepstack_placement, deepstack_addend


def stage(*layer_numbers):
    return SimpleNamespace(
        decoder=SimpleNamespace(layers=[SimpleNamespace(layer_number=n) for n in layer_numbers])
    )


def test_the_first_stage_holding_the_deepstack_layers_is_accepted():
    check_deepstack_placement(stage(1, 2, 3, 4), layers=3, pre_process=True)
    check_deepstack_placement(stage(5, 6, 7, 8), layers=3, pre_process=False)


def test_a_first_stage_with_fewer_layers_than_deepstack_is_refused():
    with pytest.raises(ValueError, match=r"layers 1\.\.3 .* must all be on the first pipeline stage"):
        check_deepstack_placement(stage(1, 2), layers=3, pre_process=True)


def test_a_later_stage_holding_a_deepstack_layer_is_refused():
    with pytest.raises(ValueError, match="first pipeline stage"):
        check_deepstack_placement(stage(3, 4), layers=3, pre_process=False)


def test_the_addend_is_the_feature_rows_at_image_tokens_and_zero_elsewhere():
    features = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])  # three image tokens
    vision_index = torch.tensor([[0, 1, 2, 0, 3]])  # [b=1, s=5]: text, image rows 0, 1, text, row 2
    addend = deepstack_addend(features, vision_index, torch.float32, sequence_parallel=False)
    assert addend.shape == (5, 1, 2)
    assert addend[:, 0].tolist() == [[0, 0], [1, 2], [3, 4], [0, 0], [5, 6]]
