"""Image chat data: the checkpoint's processor pieces give assistant-only targets and one image token per merged
patch block; bad rows (missing or unreadable image, image-token count off, a URL, no assistant turn) stop the
dataset's build naming the file, line and rule, every bad line at once; an image cut by seq_length is refused, not
cropped; the start-up pass knows lengths with the image tokens; collate numbers image tokens and stacks images in row order; embedded_vlm
is deterministic and says what it drew."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.vlm_models import tiny_vl  # noqa: F401 - the session's model directory
from thdpack.data.collate import collate
from thdpack.data.embedded_vlm import COLOURS, EmbeddedVLDataset, draw_picture
from thdpack.data.loader import TrainData
from thdpack.data.vlm import VisionJsonlDataset


@pytest.fixture(scope="module")
def processor(tiny_vl):  # noqa: F811
    from thdpack.hf.processor import VLProcessor

    return VLProcessor(tiny_vl)


def picture(width: int, height: int, colour=(220, 40, 40)):
    from PIL import Image

    return Image.new("RGB", (width, height), colour)


def write_rows(tmp_path, rows, images=()):
    for name, image in images:
        image.save(tmp_path / name)
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def image_row(path="a.png", question="What is it?", answer="A red square."):
    return {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image", "path": path}, {"type": "text", "text": question}],
            },
            {"role": "assistant", "content": answer},
        ]
    }


def test_targets_are_the_assistant_turns_and_their_end_of_turn_only(processor):
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]},
        {"role": "assistant", "content": "A red square."},
        {"role": "user", "content": "How many sides does a square have?"},
        {"role": "assistant", "content": "A square has four sides."},
    ]
    encoded = processor.encode_chat(messages, [picture(56, 56)], "x:1")
    spans = np.flatnonzero(np.diff(np.concatenate([[0], encoded.target_mask.astype(int), [0]])))
    texts = [processor.decode(encoded.tokens[a:b]) for a, b in spans.reshape(-1, 2)]
    assert texts == ["A red square.<|im_end|>", "A square has four sides.<|im_end|>"]


def test_an_image_becomes_one_token_per_merged_block_and_none_is_a_target(processor):
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]},
        {"role": "assistant", "content": "A red square."},
    ]
    encoded = processor.encode_chat(messages, [picture(84, 56)], "x:1")  # width 84, height 56
    assert encoded.image_grid_thw.tolist() == [[1, 4, 6]]  # 4 x 6 patches of 14: 2 x 3 blocks of 2x2
    image = encoded.tokens == processor.facts.image_token_id
    assert image.sum() == 6 and (encoded.mm_token_type_ids == image).all()
    assert encoded.pixel_values.shape == (24, 3 * 2 * 14 * 14)
    assert not (encoded.target_mask & image).any()


def dataset(path, processor, **kwargs):
    return VisionJsonlDataset(path, processor, cache_dir=kwargs.pop("cache_dir", False), **kwargs)


@pytest.mark.parametrize("validate", ["parse", "tokenize"])
def test_a_missing_image_stops_the_build_naming_the_file_line_and_path(processor, tmp_path, validate):
    path = write_rows(tmp_path, [image_row(), image_row("missing.png")], [("a.png", picture(56, 56))])
    with pytest.raises(
        ValueError, match=rf"{path}:2: messages\[0\].content\[0\]: image '.*missing.png' does not exist"
    ):
        dataset(path, processor, validate=validate)


def test_every_bad_row_is_reported_at_the_build_with_its_line(processor, tmp_path):
    rows = [image_row("missing.png"), image_row(), image_row(path="https://example.com/cat.png")]
    path = write_rows(tmp_path, rows, [("a.png", picture(56, 56))])
    with pytest.raises(ValueError, match=r"2 bad line\(s\) of 3") as error:
        dataset(path, processor, validate="parse")
    assert f"{path}:1: " in str(error.value) and f"{path}:3: " in str(error.value)
    assert f"{path}:2: " not in str(error.value)


def test_an_unreadable_image_stops_the_tokenizing_build_naming_it(processor, tmp_path):
    (tmp_path / "broken.png").write_bytes(b"not a png")
    with pytest.raises(
        ValueError, match=r"data.jsonl:1: messages\[0\].content\[0\]: image '.*broken.png' cannot be read"
    ):
        dataset(write_rows(tmp_path, [image_row("broken.png")]), processor, validate="tokenize")


def test_an_image_whose_pixels_are_cut_short_past_a_parsing_build_is_refused_when_read(processor, tmp_path):
    # the parse pass reads each image's header (tests/unit/test_vlm_startup.py); pixels only a full read decodes
    picture(56, 56).save(tmp_path / "cut.png")
    (tmp_path / "cut.png").write_bytes((tmp_path / "cut.png").read_bytes()[:60])
    data = dataset(write_rows(tmp_path, [image_row("cut.png")]), processor, validate="parse")
    with pytest.raises(ValueError, match=r"data.jsonl:1: messages\[0\].content\[0\]: image '.*cut.png'"):
        data[0]


def test_an_image_token_count_that_does_not_match_the_images_is_refused(processor, tmp_path):
    row = image_row(question="What is <|image_pad|> here?")  # the image token typed into the text
    path = write_rows(tmp_path, [row], [("a.png", picture(56, 56))])
    with pytest.raises(
        ValueError, match=r"data.jsonl:1: the chat template rendered 2 image placeholder\(s\) .* for 1"
    ):
        dataset(path, processor, validate="tokenize")


def test_a_url_image_is_refused(processor, tmp_path):
    row = image_row(path="https://example.com/cat.png")
    with pytest.raises(ValueError, match=r"data.jsonl:1: .* names a URL .* local files only"):
        dataset(write_rows(tmp_path, [row]), processor, validate="parse")


def test_a_row_without_an_assistant_turn_is_refused_by_the_parsing_build(processor, tmp_path):
    row = {"messages": [{"role": "user", "content": [{"type": "image", "path": "a.png"}]}]}
    path = write_rows(tmp_path, [row], [("a.png", picture(56, 56))])
    with pytest.raises(ValueError, match=r"data.jsonl:1: no assistant message"):
        dataset(path, processor, validate="parse")


def test_the_tokenizing_build_knows_every_length_image_tokens_included(processor, tmp_path):
    rows = [
        image_row(),
        image_row("b.png"),
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]},
    ]
    path = write_rows(tmp_path, rows, [("a.png", picture(56, 56)), ("b.png", picture(112, 84))])
    data = dataset(path, processor)  # auto: a small file is tokenized
    assert data.index.tokenized
    assert data.lengths.tolist() == [len(data[i]) for i in range(3)]
    assert data[1].mm_token_type_ids.sum() == 12  # 112 x 84 pixels: 8 x 6 patches, 4 x 3 image tokens


def test_a_text_rows_index_of_the_same_file_is_not_reused(processor, tmp_path):
    from thdpack.data.jsonl import JsonlDataset

    text = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    path = write_rows(tmp_path, [text])
    JsonlDataset(path, processor, validate="tokenize", cache_dir=tmp_path / "cache")
    data = dataset(path, processor, validate="tokenize", cache_dir=tmp_path / "cache")
    assert not data.index.cached and data.lengths.tolist() == [len(data[0])]


def test_a_sample_whose_image_seq_length_would_cut_is_refused_not_cropped(processor, tmp_path):
    data = dataset(write_rows(tmp_path, [image_row()], [("a.png", picture(112, 112))]), processor)
    sample = data[0]
    last_image_token = int(np.flatnonzero(sample.mm_token_type_ids)[-1])
    loader = TrainData(
        data, seq_length=last_image_token, global_batch_size=1, micro_batch_size=1, dp_rank=0, dp_size=1,
        seed=0, pad_id=0, overlong="truncate",
    )  # fmt: skip
    with pytest.raises(
        ValueError,
        match=rf"data.jsonl:1: .* image tokens at or after position {last_image_token}: .* crop an image",
    ):
        loader.next_step()


def test_collate_numbers_image_tokens_in_row_major_order_and_stacks_images_in_row_order(processor):
    chat = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]},
        {"role": "assistant", "content": "A red square."},
    ]
    text = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    from thdpack.data.vlm import encoded_sample

    samples = [
        encoded_sample(processor.encode_chat(chat, [picture(56, 84)], "a"), "a"),  # 6 image tokens
        encoded_sample(processor.encode_chat(text, [], "b"), "b"),
        encoded_sample(processor.encode_chat(chat, [picture(56, 56)], "c"), "c"),  # 4 image tokens
    ]
    batch = collate(samples, 128, pad_id=0, pad_to="longest")
    index = batch["vision_index"]
    assert index[0][index[0] > 0].tolist() == [1, 2, 3, 4, 5, 6]
    assert (index[1] == 0).all()
    assert index[2][index[2] > 0].tolist() == [7, 8, 9, 10]
    assert batch["image_grid_thw"].tolist() == [[1, 6, 4], [1, 4, 4]]
    assert batch["pixel_values"].shape[0] == 24 + 16
    # MRoPE ids are each sample's own; the pad after a sample counts on from its largest id + 1.
    length = len(samples[2].tokens)
    ids = batch["mrope_position_ids"][:, 2]
    assert ids[:, :length].tolist() == samples[2].mrope_position_ids.tolist()
    if ids.shape[1] > length:
        assert ids[0, length].item() == samples[2].mrope_position_ids.max() + 1


def test_embedded_vlm_is_a_function_of_seed_and_index(processor):
    a, b = (
        EmbeddedVLDataset(processor, num_samples=8, seed=3),
        EmbeddedVLDataset(processor, num_samples=8, seed=3),
    )
    for i in range(8):
        x, y = a[i], b[i]
        assert (x.tokens == y.tokens).all() and np.array_equal(
            x.media["pixel_values"], y.media["pixel_values"]
        )
    assert any(
        len(a[i].tokens) != len(EmbeddedVLDataset(processor, num_samples=8, seed=4)[i].tokens)
        for i in range(8)
    )


def test_embedded_vlm_descriptions_name_the_colours_drawn_where_they_say():
    cells = {
        "at the top left": (0, 0), "at the top": (0, 1), "at the top right": (0, 2), "on the left": (1, 0),
        "in the center": (1, 1), "on the right": (1, 2), "at the bottom left": (2, 0), "at the bottom": (2, 1),
        "at the bottom right": (2, 2),
    }  # fmt: skip
    for seed in range(20):
        image, description, shapes = draw_picture(np.random.default_rng(seed), 56, 224)
        width, height = image.size
        for colour, shape, cell in shapes:
            assert f"{colour} {shape} {cell}" in description
            row, col = cells[cell]
            centre = (int((col + 0.5) * width / 3), int((row + 0.6) * height / 3))  # inside every shape
            assert image.getpixel(centre) == COLOURS[colour], (seed, colour, shape, cell)


def test_an_image_dataset_takes_the_vl_checkpoints_processor_as_its_tokenizer(tiny_vl):  # noqa: F811
    from thdpack.hf.processor import VLProcessor, dataset_processor

    model = {"pretrained": str(tiny_vl)}
    assert isinstance(dataset_processor("embedded_vlm", "auto", model), VLProcessor)
    assert dataset_processor("embedded_sft", "auto", model) is None  # text data: the checkpoint's tokenizer


def test_an_image_dataset_without_a_vl_checkpoint_is_refused_naming_the_key(tiny_vl, tmp_path):  # noqa: F811
    from thdpack.hf.processor import dataset_processor

    with pytest.raises(ValueError, match=r"dataset.name=embedded_vlm needs .* set model=hf model.pretrained"):
        dataset_processor("embedded_vlm", "auto", {})
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    with pytest.raises(ValueError, match=rf"model.pretrained={tmp_path} is not one"):
        dataset_processor("jsonl_vlm", "auto", {"pretrained": str(tmp_path)})
    with pytest.raises(ValueError, match=r"dataset.tokenizer is 'byte': .* leave dataset.tokenizer=auto"):
        dataset_processor("embedded_vlm", "byte", {"pretrained": str(tiny_vl)})
