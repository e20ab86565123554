"""Image chat data problems found before step 1, whatever dataset.overlong and dataset.validate say: a row whose
image tokens run past seq_length (truncating it would crop an image; error refuses it), an image whose file is not
an image (its header is read by the parse pass), and an image changed after a cached start (the cached index is not
reused). The tiny Qwen2.5-VL's processor: a 224 x 224 image is 64 image tokens, 56 x 56 is 4."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tests.vlm_models import tiny_vl  # noqa: F401 - the session's model directory
from thdpack.data.loader import TrainData
from thdpack.data.vlm import VisionJsonlDataset


@pytest.fixture(scope="module")
def processor(tiny_vl):  # noqa: F811
    from thdpack.hf.processor import VLProcessor

    return VLProcessor(tiny_vl)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("THDPACK_CACHE", str(tmp_path / "cache"))


def rows(tmp_path, sides):
    """A JSONL file of one image row per side (a square picture of that many pixels)."""
    from PIL import Image

    lines = []
    for i, side in enumerate(sides):
        Image.new("RGB", (side, side), (200, 30, 30)).save(tmp_path / f"{i}.png")
        content = [{"type": "image", "path": f"{i}.png"}, {"type": "text", "text": "What is it?"}]
        lines.append(
            {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "Red."}]}
        )
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def data(dataset, overlong: str) -> TrainData:
    return TrainData(
        dataset, seq_length=32, global_batch_size=2, micro_batch_size=1, dp_rank=0, dp_size=1, seed=0,
        overlong=overlong, pad_id=0,
    )  # fmt: skip


def test_the_parse_pass_reads_each_images_size_for_its_image_tokens(tmp_path, processor):
    dataset = VisionJsonlDataset(rows(tmp_path, [56, 224]), processor, validate="parse")
    assert not dataset.index.tokenized and dataset.min_lengths.tolist() == [4, 64]


def test_the_tokenizing_pass_knows_where_the_last_image_token_ends(tmp_path, processor):
    dataset = VisionJsonlDataset(rows(tmp_path, [56, 224]), processor, validate="tokenize")
    ends = [int(np.flatnonzero(dataset[i].mm_token_type_ids)[-1]) + 1 for i in range(2)]
    assert dataset.min_lengths.tolist() == ends and ends[1] > 64


@pytest.mark.parametrize("validate", ["parse", "tokenize"])
def test_truncating_through_an_image_is_refused_before_step_1(tmp_path, processor, validate):
    path = rows(tmp_path, [56, 224])
    with pytest.raises(
        ValueError, match=r"1 of 2 samples hold image tokens past seq_length \(32\): dataset\.ov"
    ):
        data(VisionJsonlDataset(path, processor, validate=validate), "truncate").check_overlong()


def test_overlong_error_refuses_an_oversized_image_before_step_1_without_tokenizing(tmp_path, processor):
    path = rows(tmp_path, [56, 224])
    with pytest.raises(ValueError, match=rf"dataset\.overlong=error refuses them\..* the first: {path}:2 "):
        data(VisionJsonlDataset(path, processor, validate="parse"), "error").check_overlong()


def test_overlong_drop_counts_the_oversized_images_it_will_drop(tmp_path, processor):
    line = data(
        VisionJsonlDataset(rows(tmp_path, [56, 224]), processor, validate="parse"), "drop"
    ).check_overlong()
    assert line.startswith("1 samples hold more image tokens than seq_length (32) and will be dropped; ")


def test_a_file_that_is_not_an_image_is_found_by_the_parse_pass(tmp_path, processor):
    path = rows(tmp_path, [56, 56])
    (tmp_path / "1.png").write_bytes(b"not an image")
    with pytest.raises(
        ValueError, match=rf"{path}:2: messages\[0\]\.content\[0\]: image .* cannot be read as an"
    ):
        VisionJsonlDataset(path, processor, validate="parse")


def test_an_image_changed_after_a_cached_start_is_checked_again(tmp_path, processor):
    path = rows(tmp_path, [56, 56])
    assert not VisionJsonlDataset(path, processor, validate="parse").index.cached
    assert VisionJsonlDataset(path, processor, validate="parse").index.cached
    (tmp_path / "1.png").write_bytes(b"corrupt now")
    os.utime(tmp_path / "1.png", ns=(1, 1))
    with pytest.raises(ValueError, match=r"data\.jsonl:2: .* cannot be read as an image"):
        VisionJsonlDataset(path, processor, validate="parse")


def test_the_image_processor_loads_where_the_top_level_name_is_a_torchvision_stand_in(tiny_vl, monkeypatch):  # noqa: F811
    # transformers 5.17 exports AutoImageProcessor as a placeholder that raises without torchvision
    import transformers

    from thdpack.hf.processor import load_image_processor

    class StandIn:
        @classmethod
        def from_pretrained(cls, *args, **kwargs):
            raise ImportError("AutoImageProcessor requires the Torchvision library")

    monkeypatch.setattr(transformers, "AutoImageProcessor", StandIn)
    assert type(load_image_processor(tiny_vl)).__name__.startswith("Qwen2VLImageProcessor")
