"""The Qwen2.5-VL pieces around the model call: the vision tower loads strictly from the checkpoint's safetensors
(a missing, unexpected or misshapen tensor is named), the family's batch hook gives image-less micro-batches the
image keys and refuses patches that do not match the grids, and the config maps to the recipe's model group."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.vlm_models import tiny_vl  # noqa: F401 - the session's model directory
from thdpack.hf.checkpoint import HFCheckpoint
from thdpack.megatron.vlm import vlm_batch_transform
from thdpack.models import model_group
from thdpack.models.qwen2_5_vl import load_vision_tower, qwen2_config


@pytest.fixture(scope="module")
def directory(tiny_vl):  # noqa: F811
    return tiny_vl


def rewritten(directory, tmp_path, edit):
    """A copy of ``directory`` whose safetensors tensors went through ``edit(dict) -> dict``."""
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "copy"
    shutil.copytree(directory, copy)
    save_file(edit(load_file(copy / "model.safetensors")), copy / "model.safetensors")
    return copy


def test_the_vision_tower_equals_the_checkpoints_tensors(directory):
    from safetensors.torch import load_file

    tensors = load_file(directory / "model.safetensors")
    visual = load_vision_tower(directory)
    for name, value in visual.state_dict().items():
        assert torch.equal(value, tensors[f"visual.{name}"]), name


def test_a_missing_vision_tensor_is_named(directory, tmp_path):
    copy = rewritten(
        directory, tmp_path, lambda t: {k: v for k, v in t.items() if k != "visual.merger.ln_q.weight"}
    )
    with pytest.raises(ValueError, match=r"missing \['visual.merger.ln_q.weight'\]"):
        load_vision_tower(copy)


def test_a_vision_tensor_of_another_shape_is_named(directory, tmp_path):
    def edit(t):
        t["visual.blocks.0.attn.proj.bias"] = torch.zeros(7)
        return t

    with pytest.raises(ValueError, match=r"'visual.blocks.0.attn.proj.bias' has shape \[7\]"):
        load_vision_tower(rewritten(directory, tmp_path, edit))


def test_the_model_group_is_the_qwen2_group_with_mrope_and_the_vl_family(directory):
    checkpoint = HFCheckpoint.open(directory)
    group = model_group(checkpoint, seq_length=256)
    assert group["family"] == "qwen2_5_vl" and group["position_embedding_type"] == "mrope"
    assert group["config"]["mrope_section"] == [2, 3, 3] and group["config"]["add_qkv_bias"]
    assert group["freeze_vision"] is True
    assert qwen2_config(checkpoint)["architectures"] == ["Qwen2ForCausalLM"]


def test_a_flat_released_config_reads_as_the_nested_one(directory):
    """Released checkpoints keep the text keys at the top level and the sections under rope_scaling."""
    nested = HFCheckpoint.open(directory)
    text = nested.config["text_config"]
    rope = text["rope_parameters"]
    flat = {k: v for k, v in nested.config.items() if k != "text_config"}
    flat.update({k: v for k, v in text.items() if k != "rope_parameters"})
    flat.update(
        rope_theta=rope["rope_theta"], rope_scaling={"type": "mrope", "mrope_section": rope["mrope_section"]}
    )
    flat_group = model_group(HFCheckpoint.from_config(flat), seq_length=256)
    assert flat_group == model_group(nested, seq_length=256)


def test_a_micro_batch_without_images_gets_empty_image_keys():
    batch = vlm_batch_transform({"tokens": torch.zeros(2, 4, dtype=torch.long)})
    assert batch["image_grid_thw"].shape == (0, 3) and batch["pixel_values"].shape[0] == 0


def test_patches_that_do_not_match_the_grids_are_refused():
    batch = {"image_grid_thw": torch.tensor([[1, 4, 4]]), "pixel_values": torch.zeros(12, 8)}
    with pytest.raises(ValueError, match="grids hold 16 patches but pixel_values has 12 rows"):
        vlm_batch_transform(batch)


def test_the_vl_family_builds_the_checkpoints_model_and_owns_its_loading(directory):
    """The registry resolves the group's family to the vision-language one: its build loads the checkpoint
    itself (the text families' loader would refuse the vision tensors)."""
    from thdpack.models import get_family, pretrained_model_group

    family = get_family(
        pretrained_model_group({"pretrained": str(directory)}, seq_length=256, tp=1)["family"]
    )
    assert family.name == "qwen2_5_vl" and family.carry_keys == ("pixel_values", "image_grid_thw")
    assert family.build.__module__ == "thdpack.models.vl"


# Qwen3-VL: the same pieces, and what is its own (Qwen3 import, DeepStack, interleaved MRoPE, refusals).
from tests.vlm_models import tiny_qwen3_vl  # noqa: E402, F401 - the session's Qwen3-VL directory


def test_the_qwen3_vl_vision_tower_with_its_deepstack_mergers_equals_the_checkpoints_tensors(tiny_qwen3_vl):  # noqa: F811
    from safetensors.torch import load_file

    from thdpack.models.qwen3_vl import load_vision_tower as load_qwen3_vision_tower

    tensors = load_file(tiny_qwen3_vl / "model.safetensors")
    visual = load_qwen3_vision_tower(tiny_qwen3_vl)
    names = visual.state_dict()
    assert any(name.startswith("deepstack_merger_list.1.") for name in names)
    for name, value in names.items():
        assert torch.equal(value, tensors[f"model.visual.{name}"]), name


def test_the_qwen3_vl_model_group_is_the_qwen3_group_with_mrope_and_its_family(tiny_qwen3_vl):  # noqa: F811
    from thdpack.models import get_family, pretrained_model_group
    from thdpack.models.qwen3_vl import deepstack_layers, qwen3_config

    config = HFCheckpoint.open(tiny_qwen3_vl)
    group = pretrained_model_group({"pretrained": str(tiny_qwen3_vl)}, seq_length=256, tp=1)
    assert group["family"] == "qwen3_vl" and group["position_embedding_type"] == "mrope"
    assert group["config"]["qk_layernorm"] and not group["config"]["add_qkv_bias"]
    assert group["config"]["kv_channels"] == 32 and group["config"]["mrope_section"] == [6, 5, 5]
    assert qwen3_config(config)["architectures"] == ["Qwen3ForCausalLM"]
    assert deepstack_layers(config) == 2
    family = get_family(group["family"])
    assert family.name == "qwen3_vl" and family.carry_keys == ("pixel_values", "image_grid_thw")


def test_an_unknown_vision_language_architecture_is_refused_naming_it(tiny_qwen3_vl, tmp_path):  # noqa: F811
    from thdpack.hf.checkpoint import HFConfigError
    from thdpack.models import pretrained_model_group

    config = json.loads((tiny_qwen3_vl / "config.json").read_text())
    config.update(architectures=["Qwen2VLForConditionalGeneration"], model_type="qwen2_vl")
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        HFConfigError,
        match=r"config.json:\d+: key 'architectures' is \['Qwen2VLForConditionalGeneration'\]: thdpack imports "
        r"exactly one of \[.*'Qwen2_5_VLForConditionalGeneration', .*'Qwen3VLForConditionalGeneration', "
        r"'Qwen3VLMoeForConditionalGeneration'[^]]*\]",
    ):
        pretrained_model_group({"pretrained": str(tmp_path)}, seq_length=256, tp=1)


def test_more_deepstack_layers_than_decoder_layers_are_refused(tiny_qwen3_vl):  # noqa: F811
    from thdpack.hf.checkpoint import HFConfigError

    config = dict(HFCheckpoint.open(tiny_qwen3_vl).config)
    config["vision_config"] = {**config["vision_config"], "deepstack_visual_indexes": [0, 1, 2, 2]}
    with pytest.raises(
        HFConfigError, match=r"deepstack_visual_indexes \[0, 1, 2, 2\].*at most num_hidden_layers"
    ):
        model_group(HFCheckpoint.from_config(config), seq_length=256)


def test_a_qwen3_vl_chat_with_a_video_is_refused_naming_the_sample_and_the_rule(tiny_qwen3_vl):  # noqa: F811
    from thdpack.hf.processor import VLProcessor

    messages = [
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]},
        {"role": "assistant", "content": "A circle moves."},
    ]
    with pytest.raises(ValueError, match=r"chat.jsonl:4: the sample holds video tokens .* images only"):
        VLProcessor(tiny_qwen3_vl).encode_chat(messages, [], "chat.jsonl:4")


def deepstack_stage(recompute: str | None):
    """A first-stage language model stand-in holding decoder layers 1..3, and its config."""
    from types import SimpleNamespace

    config = SimpleNamespace(recompute_granularity=recompute, sequence_parallel=False)
    embedding = SimpleNamespace(word_embeddings=SimpleNamespace())
    layers = [SimpleNamespace(layer_number=n) for n in (1, 2, 3)]
    gpt = SimpleNamespace(
        model_type=None, pre_process=True, post_process=True, embedding=embedding,
        decoder=SimpleNamespace(layers=layers),
    )  # fmt: skip
    return config, gpt


def test_trained_vision_with_full_recomputation_is_refused_for_deepstack():
    from thdpack.megatron.vlm import VisionLanguageModel

    config, gpt = deepstack_stage("full")
    with pytest.raises(ValueError, match="freeze_vision=false with full activation recomputation"):
        VisionLanguageModel(config, gpt, torch.nn.Linear(2, 2), freeze_vision=False, deepstack_layers=2)


def test_a_first_stage_without_every_deepstack_layer_is_refused():
    from thdpack.megatron.vlm import VisionLanguageModel

    config, gpt = deepstack_stage(None)
    with pytest.raises(ValueError, match=r"layers 1\.\.4 .* first pipeline stage"):
        VisionLanguageModel(config, gpt, torch.nn.Linear(2, 2), deepstack_layers=4)
