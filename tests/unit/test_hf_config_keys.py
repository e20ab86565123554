"""Hugging Face configs are accepted as transformers and the Hub write them: every supported family's config saved
by transformers' ``save_pretrained`` imports unchanged, the Hub's extra keys that cannot change what the model
computes (thdpack.hf.config_keys.HARMLESS_KEYS) pass, and a key that could change it stops the import, naming the
way through (``model.accept_unknown_config_keys``) and its risk. No model is built: configs only."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest

from tests.hf_models import _COMMON, FAMILIES, VOCAB
from thdpack.hf.checkpoint import HFCheckpoint, HFConfigError
from thdpack.models import known_architectures, model_group, pretrained_model_group

# The VL configs of tests/vlm_models.py, for a tokenizer stand-in (the ids the config names).
TOKENS = SimpleNamespace(
    vocab_size=VOCAB,
    added_ids={
        "<|endoftext|>": 290, "<|im_end|>": 291, "<|image_pad|>": 292, "<|video_pad|>": 293,
        "<|vision_start|>": 294, "<|vision_end|>": 295,
    },
)  # fmt: skip
VL = {
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "tiny_config"),
    "qwen3_vl": ("Qwen3VLConfig", "qwen3_vl_config"),
    "qwen3_vl_moe": ("Qwen3VLMoeConfig", "qwen3_vl_moe_config"),
}
# SmolLM2-135M-Instruct's config.json on the Hub (written by transformers 4.42.3 from nanotron's), at tiny size.
SMOLLM2 = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 1,
    "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.041666666666666664,
    "intermediate_size": 96, "is_llama_config": True, "max_position_embeddings": 8192, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
    "pad_token_id": 2, "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_interleaved": False,
    "rope_scaling": None, "rope_theta": 100000, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers.js_config": {"kv_cache_dtype": {"q4f16": "float16", "fp16": "float16"}},
    "transformers_version": "4.42.3", "unk_token_id": 0, "use_cache": True, "vocab_size": VOCAB,
}  # fmt: skip
HUB_EXTRAS = ("unk_token_id", "is_llama_config", "rope_interleaved", "transformers.js_config", "torch_dtype")


def saved_by_transformers(directory, name: str):
    """The config of ``name`` (tests/hf_models.py's families, or a VL family) as transformers' ``save_pretrained``
    writes it, with the ``architectures`` a model's ``save_pretrained`` adds."""
    import transformers

    from tests import vlm_models

    if name in VL:
        config_class, make = VL[name]
        keywords = getattr(vlm_models, make)(TOKENS)
    else:
        config_class, model_class, kwargs = FAMILIES[name]
        keywords = {**_COMMON, "vocab_size": VOCAB, **kwargs, "architectures": [model_class]}
    config = getattr(transformers, config_class)(**keywords)
    config.save_pretrained(directory)
    return HFCheckpoint.open(directory)


def written(directory, config: dict) -> HFCheckpoint:
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return HFCheckpoint.open(directory)


@pytest.mark.parametrize("name", [*FAMILIES, *VL])
def test_every_familys_config_saved_by_transformers_imports_unchanged(name, tmp_path):
    checkpoint = saved_by_transformers(tmp_path, name)
    group = model_group(checkpoint, seq_length=64)
    renamed = {"llama2": "llama", "llama3": "llama", "llama3_own_scaling": "llama", "gemma3_1b": "gemma3"}
    assert group["family"] == renamed.get(name, name.removesuffix("_unnormed"))


def test_the_saved_configs_cover_every_architecture_thdpack_imports(tmp_path):
    covered = {saved_by_transformers(tmp_path / name, name).architecture for name in [*FAMILIES, *VL]}
    assert covered == set(known_architectures())


def test_a_hub_config_with_its_harmless_extra_keys_imports_as_without_them(tmp_path):
    bare = {k: v for k, v in SMOLLM2.items() if k not in HUB_EXTRAS}
    expected = model_group(written(tmp_path, bare), seq_length=64)
    (tmp_path / "hub").mkdir()
    assert model_group(written(tmp_path / "hub", SMOLLM2), seq_length=64) == expected


def test_the_hub_config_as_transformers_rewrites_it_imports_too(tmp_path):
    """What transformers writes back from the Hub's file (transformers 5's rope_parameters and dtype, every
    extra key kept): the file of issue 37, refused at 'unk_token_id' before."""
    from transformers import AutoConfig

    (tmp_path / "hub").mkdir()
    written(tmp_path / "hub", SMOLLM2)
    AutoConfig.from_pretrained(tmp_path / "hub").save_pretrained(tmp_path / "saved")
    saved = HFCheckpoint.open(tmp_path / "saved")
    assert set(HUB_EXTRAS) - {"torch_dtype"} <= set(saved.config)
    assert model_group(saved, seq_length=64)["rotary_base"] == 100000.0


def test_rope_interleaved_true_is_refused_naming_the_rule(tmp_path):
    checkpoint = written(tmp_path, {**SMOLLM2, "rope_interleaved": True})
    with pytest.raises(
        HFConfigError, match=r"key 'rope_interleaved' is True: thdpack needs False .*rotate_half"
    ):
        model_group(checkpoint, seq_length=64)


def test_a_key_that_may_change_the_computation_is_refused_naming_the_way_through_and_its_risk(tmp_path):
    checkpoint = written(tmp_path, {**SMOLLM2, "attn_logit_softcapping": 50.0})
    with pytest.raises(
        HFConfigError,
        match=r"config.json:\d+: key 'attn_logit_softcapping' is not known .* it may change what the model "
        r"computes.* model.accept_unknown_config_keys=\[attn_logit_softcapping\] lets it through: the model is "
        r"then built without it, and may compute something else",
    ):
        model_group(checkpoint, seq_length=64)


def test_the_recipe_may_accept_an_unknown_key_and_the_log_says_it_is_unread(tmp_path, caplog):
    written(tmp_path, {**SMOLLM2, "attn_logit_softcapping": 50.0})
    recipe = {"pretrained": str(tmp_path), "accept_unknown_config_keys": ["attn_logit_softcapping"]}
    with caplog.at_level(logging.WARNING, logger="thdpack"):
        group = pretrained_model_group(recipe, seq_length=64, tp=1)
    assert group["family"] == "llama" and group["accept_unknown_config_keys"] == ["attn_logit_softcapping"]
    assert "['attn_logit_softcapping'] accepted unread (model.accept_unknown_config_keys)" in caplog.text


def test_the_accepted_keys_must_be_a_list(tmp_path):
    written(tmp_path, SMOLLM2)
    with pytest.raises(HFConfigError, match=r"model.accept_unknown_config_keys is 'rope_scaling': a list"):
        pretrained_model_group(
            {"pretrained": str(tmp_path), "accept_unknown_config_keys": "rope_scaling"}, seq_length=64, tp=1
        )


def test_the_recipe_key_on_the_command_line_passes_the_start_up_checks(tmp_path):
    from hydra import compose, initialize_config_dir

    from thdpack.training.checks import check_recipe
    from thdpack.training.loop import recipes_dir
    from thdpack.training.recipe import resolve_recipe

    written(tmp_path, {**SMOLLM2, "attn_logit_softcapping": 50.0})
    overrides = [
        "model=hf",
        f"model.pretrained={tmp_path}",
        "model.accept_unknown_config_keys=[attn_logit_softcapping]",
    ]
    with initialize_config_dir(str(recipes_dir()), version_base="1.3"):
        cfg = resolve_recipe(compose("train", overrides=overrides), device="cpu")
    assert cfg.model.family == "llama" and check_recipe(cfg, world_size=1, device="cpu") == []
