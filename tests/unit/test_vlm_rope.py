"""Qwen2.5-VL and Qwen3-VL MRoPE ids of samples with still images: thdpack's per-sample rule equals each family's
transformers ``get_rope_index`` on the same sample, and mismatched image-token counts and videos are refused
naming the sample."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

from tests.vlm_models import tiny_qwen3_vl, tiny_vl  # noqa: F401 - the session's model directories
from thdpack.hf.vl_checkpoint import VLFacts, rope_index

FACTS = VLFacts(
    image_token_id=5,
    video_token_id=6,
    vision_start_token_id=3,
    vision_end_token_id=4,
    spatial_merge_size=2,
    patch_size=14,
    temporal_patch_size=2,
    hidden_size=64,
    mrope_section=(2, 3, 3),
)
T, IMG, VS, VE = 9, 5, 3, 4  # a text token, the image token, vision start / end


def sample(*parts):
    """Tokens and grids of a sample: an int is that many text tokens, a tuple an image grid (t, h, w)."""
    tokens, grids = [], []
    for part in parts:
        if isinstance(part, int):
            tokens += [T] * part
        else:
            grids.append(part)
            tokens += [VS] + [IMG] * (part[0] * part[1] * part[2] // 4) + [VE]
    return np.array(tokens), np.array(grids, dtype=np.int64).reshape(-1, 3)


@pytest.fixture(scope="module", params=["tiny_vl", "tiny_qwen3_vl"], ids=["qwen2_5_vl", "qwen3_vl"])
def hf_model(request):
    from tests.vlm_parity import hf_class

    directory = request.getfixturevalue(request.param)
    return hf_class(directory).from_pretrained(str(directory)).model


def transformers_rope_index(model, tokens: np.ndarray, grids: np.ndarray) -> np.ndarray:
    """``get_rope_index`` of one sample, whichever of its signatures this transformers has."""
    ids = torch.from_numpy(tokens)[None]
    kwargs = {"image_grid_thw": torch.from_numpy(grids) if len(grids) else None}
    if "mm_token_type_ids" in inspect.signature(model.get_rope_index).parameters:
        kwargs["mm_token_type_ids"] = (ids == IMG).int()
    positions, _ = model.get_rope_index(ids, **kwargs)
    return positions[:, 0].numpy()


def test_text_continues_after_an_image_from_its_largest_id_plus_one():
    tokens, grids = sample(2, (1, 2, 4), 1)  # text, vision_start, a 1x2 merged grid, vision_end, text
    ids = rope_index(tokens, grids, FACTS)
    expected = np.array(
        [
            [0, 1, 2, 3, 3, 5, 6],  # temporal: the image's two tokens share t = 3
            [0, 1, 2, 3, 3, 5, 6],  # height: one merged row
            [0, 1, 2, 3, 4, 5, 6],  # width: two merged columns; vision_end takes the largest id (4) + 1
        ]
    )
    assert ids.tolist() == expected.tolist()


@pytest.mark.parametrize(
    "parts",
    [
        (5,),
        ((1, 4, 4), 3),
        (4, (1, 4, 6), 2),
        (3, (1, 6, 4), 1, (1, 8, 8), 2),
        (2, (1, 4, 4), (1, 2, 2), 2),  # two images back to back (separated only by vision end / start)
        (1, (1, 10, 14)),
    ],
)
def test_rope_index_equals_transformers_get_rope_index(hf_model, parts):
    tokens, grids = sample(*parts)
    assert (
        rope_index(tokens, grids, FACTS).tolist() == transformers_rope_index(hf_model, tokens, grids).tolist()
    )


def test_image_token_count_that_does_not_match_the_grid_is_refused():
    tokens, grids = sample(2, (1, 4, 4), 1)
    grids[0, 2] = 6  # the grid says 6 image tokens, the row holds 4
    with pytest.raises(
        ValueError, match=r"data.jsonl:7: image 0 has 4 image tokens but its grid .* gives .* 6"
    ):
        rope_index(tokens, grids, FACTS, where="data.jsonl:7")


def test_more_images_than_runs_of_image_tokens_is_refused():
    tokens, _ = sample(2, (1, 4, 4), 1)
    grids = np.array([[1, 4, 4], [1, 2, 2]])
    with pytest.raises(ValueError, match=r"x:1: 1 run\(s\) of image tokens but 2 image\(s\)"):
        rope_index(tokens, grids, FACTS, where="x:1")


def test_video_tokens_are_refused():
    with pytest.raises(ValueError, match=r"x:3: .*video_token_id 6.*videos are not supported, images only"):
        rope_index(np.array([T, 6, 6, T]), np.zeros((0, 3)), FACTS, where="x:3")
