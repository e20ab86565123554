"""Gemma 3 text (thdpack.models.gemma3) against transformers' Gemma3ForCausalLM: the tiny 4B-shaped and 1B-shaped
models of tests/hf_models.py give transformers' logits packed (tests/unit/test_hf_import.py, 1e-5) and under
TP/PP/CP (tests/functional/test_hf_parallel.py); here what is Gemma's own: both RoPEs, the features that bite in the
tiny configs, the Hub's transformers 4 config, what is refused, and the export transformers loads."""

from __future__ import annotations

import pytest
import torch

from tests.hf_models import (
    build,
    hf_logits_per_sample,
    hf_model,
    megatron_model,
    padded_batch,
    save_model,
    save_run_checkpoint,
    training_step_grads,
    write_config,
)
from thdpack.hf.checkpoint import HFCheckpoint, HFConfigError
from thdpack.models import model_group

pytestmark = [pytest.mark.cpu_only]

# google/gemma-3-1b-it's config.json (transformers 4.50), at tiny size
HUB_1B = {
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": [1, 106],
    "final_logit_softcapping": None, "head_dim": 16, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 64,
    "initializer_range": 0.02, "intermediate_size": 96, "max_position_embeddings": 32768,
    "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 4, "num_key_value_heads": 1,
    "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 2,
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0", "use_cache": True, "vocab_size": 300,
}  # fmt: skip


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return save_model("gemma3", tmp_path_factory.mktemp("gemma3") / "source")


@pytest.mark.usefixtures("one_rank_megatron")
def test_local_and_global_rope_are_transformers_sliding_and_full_frequencies(source):
    rotary = build("gemma3").model.rotary_emb
    rope = megatron_model(source).rotary_pos_emb
    assert torch.equal(rope.local_rope.inv_freq, rotary.sliding_attention_inv_freq)
    assert torch.equal(rope.global_rope.inv_freq, rotary.full_attention_inv_freq)
    assert not torch.equal(rotary.sliding_attention_inv_freq, rotary.full_attention_inv_freq)


@pytest.mark.parametrize(
    "change",
    [
        {"sliding_window": 64},  # the window no longer bites
        {"layer_types": ["full_attention", "full_attention"]},  # the first layer's RoPE becomes global
        {"query_pre_attn_scalar": 16},  # the attention scale
    ],
)
def test_what_the_tiny_config_exercises_changes_transformers_logits(change):
    batch = padded_batch(300)
    base, changed = (hf_logits_per_sample(build("gemma3", **c), batch) for c in ({}, change))
    assert not all(torch.allclose(a, b, atol=1e-3) for a, b in zip(base, changed, strict=True))


def test_the_hub_1b_config_of_transformers_4_imports_as_transformers_5_writes_it(tmp_path):
    from transformers import AutoConfig

    hub = write_config(tmp_path / "hub", HUB_1B)
    AutoConfig.from_pretrained(tmp_path / "hub").save_pretrained(tmp_path / "saved")
    group = model_group(hub, seq_length=64)
    assert group == model_group(HFCheckpoint.open(tmp_path / "saved"), seq_length=64)
    assert group["config"]["window_size"] == [511, 0]
    assert group["config"]["window_attn_skip_freq"] == [1, 0, 1, 0]  # sliding_window_pattern 2
    assert (group["rotary_base"], group["local_rotary_base"], group["rope_scaling"]) == (1e6, 1e4, None)
    assert group["config"]["softmax_scale"] == 256**-0.5


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("final_logit_softcapping", 30.0, r"is 30.0: thdpack needs null \(a tanh on the logits"),
        ("attn_logit_softcapping", 50.0, r"is 50.0: thdpack needs null \(a tanh on the attention scores"),
        ("use_bidirectional_attention", True, r"is true: thdpack's packed attention is causal"),
        ("hidden_activation", "gelu", r"is 'gelu': thdpack imports Gemma 3's gelu_pytorch_tanh"),
        ("rope_scaling", {"rope_type": "yarn", "factor": 2.0}, r"has rope_type 'yarn': this family imports"),
    ],
)
def test_what_thdpack_cannot_compute_is_refused_naming_the_key(tmp_path, key, value, match):
    with pytest.raises(HFConfigError, match=rf"config.json:\d+: key '{key}' {match}"):
        model_group(write_config(tmp_path, {**HUB_1B, key: value}), seq_length=64)


def test_sliding_windows_under_te_context_parallelism_need_a_cp_comm_type_te_has():
    from thdpack.models.gemma3 import check

    recipe = {
        "model": {
            "attention_backend": "te",
            "config": {"window_size": [3, 0], "window_attn_skip_freq": [1, 0]},
        },
        "parallel": {"context_parallel_size": 2, "tensor_model_parallel_size": 1},
    }
    with pytest.raises(
        ValueError, match=r"model.config.cp_comm_type is 'p2p': Gemma 3's sliding-window layers"
    ):
        check(recipe)
    recipe["model"]["config"]["cp_comm_type"] = "a2a"
    check(recipe)
    check(
        {
            **recipe,
            "model": {**recipe["model"], "attention_backend": "torch", "config": {"window_size": [3, 0]}},
        }
    )


@pytest.mark.usefixtures("one_rank_megatron")
def test_the_export_is_the_checkpoint_bit_for_bit_and_transformers_computes_thdpacks_logits(source, tmp_path):
    from safetensors.torch import load_file

    from thdpack.models.export import main

    gpt = megatron_model(source)
    with torch.no_grad():  # a trained model: every weight moved
        for p in gpt.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    save_run_checkpoint(gpt, source, tmp_path / "ckpt")
    main([str(tmp_path / "ckpt"), str(tmp_path / "out")])
    exported = load_file(str(tmp_path / "out" / "model-00001-of-00001.safetensors"))
    from thdpack.hf.checkpoint_hf import hf_state
    from thdpack.models.gemma3 import MAPPING

    assert exported.keys() == load_file(str(source / "model.safetensors")).keys()
    state = hf_state(gpt, MAPPING, 300)
    assert [n for n in state if not torch.equal(state[n], exported[n])] == []
    batch = padded_batch(300)
    from tests.hf_models import max_logit_difference

    assert max_logit_difference(gpt, hf_model(tmp_path / "out"), batch) <= 1e-5


@pytest.mark.usefixtures("one_rank_megatron")
def test_the_plain_gpt_rebuild_of_a_checkpoint_refuses_gemmas_own_layers(source, tmp_path):
    from thdpack.models.export import load_checkpoint_model

    iteration = save_run_checkpoint(megatron_model(source), source, tmp_path / "ckpt")
    with pytest.raises(ValueError, match=r"'gemma3' family's layers hold .*post_layernorm.* plain GPTModel"):
        load_checkpoint_model(iteration, tmp_path / "ckpt" / "hf")


@pytest.mark.usefixtures("one_rank_megatron")
def test_a_training_step_reaches_the_post_norms_and_the_scaled_embedding(source):
    grads = training_step_grads(megatron_model(source), padded_batch(300))
    for part in (
        "linear_proj.post_layernorm.weight",
        "linear_fc2.post_layernorm.weight",
        "word_embeddings.weight",
    ):
        named = [n for n in grads if n.endswith(part)]
        assert named and all(grads[n] is not None and grads[n].abs().sum() > 0 for n in named), part
