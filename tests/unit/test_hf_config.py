"""thdpack.models' model groups: a Hugging Face config.json becomes the recipe's model group, or stops naming the
file, line, key and rule. Plain dicts as transformers 5 writes them (no model is built here)."""

from __future__ import annotations

import json

import pytest

from thdpack.hf.checkpoint import HFCheckpoint, HFConfigError
from thdpack.models import model_group, pretrained_model_group

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 301,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
    "max_position_embeddings": 2048,
    "transformers_version": "5.24.0",
}
QWEN3_MOE = {
    **{k: v for k, v in LLAMA.items() if k not in ("mlp_bias",)},
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "head_dim": 24,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "router_aux_loss_coef": 0.001,
    "use_sliding_window": False,
    "sliding_window": None,
    "layer_types": ["full_attention", "full_attention"],
}


def group(hf, seq_length=64, tp=1):
    checkpoint = hf if isinstance(hf, HFCheckpoint) else HFCheckpoint.from_config(hf)
    return model_group(checkpoint, seq_length=seq_length, tp=tp)


def written(tmp_path, hf) -> HFCheckpoint:
    (tmp_path / "config.json").write_text(json.dumps(hf, indent=2))
    return HFCheckpoint.open(tmp_path)


def test_llama_maps_to_megatron_keys():
    g = group(LLAMA)
    assert g["config"] == {
        "num_layers": 2,
        "hidden_size": 64,
        "ffn_hidden_size": 96,
        "num_attention_heads": 4,
        "num_query_groups": 2,
        "kv_channels": 16,
        "normalization": "RMSNorm",
        "layernorm_epsilon": 1e-5,
        "gated_linear_unit": True,
        "activation_func": "silu",
        "add_bias_linear": False,
        "add_qkv_bias": False,
        "qk_layernorm": False,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "init_method_std": 0.02,
    }
    assert (g["rotary_base"], g["rope_scaling"], g["share_embeddings_and_output_weights"]) == (
        500000.0,
        None,
        False,
    )


def test_vocabulary_is_the_checkpoints_unless_tensor_parallelism_must_pad_it():
    assert group(LLAMA, tp=1)["vocab_size"] == 301
    assert group(LLAMA, tp=2)["vocab_size"] == 302
    assert group({**LLAMA, "vocab_size": 300}, tp=2)["vocab_size"] == 300


def test_transformers_4_rope_keys_read_as_transformers_5s():
    scaling = {
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    v5 = {**LLAMA, "rope_parameters": {"rope_theta": 500000.0, "rope_type": "llama3", **scaling}}
    v4 = {k: v for k, v in v5.items() if k != "rope_parameters"}
    v4 |= {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **scaling}}
    assert group(v4) == group(v5)
    assert group(v5)["rope_scaling"] == scaling


def test_qwen2_has_qkv_biases_and_qwen3_q_k_norms_and_its_own_head_dim():
    qwen2 = {**LLAMA, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
    del qwen2["attention_bias"], qwen2["mlp_bias"]
    qwen3 = {**LLAMA, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 24}
    del qwen3["mlp_bias"]
    assert group(qwen2)["config"]["add_qkv_bias"] and not group(qwen2)["config"]["qk_layernorm"]
    assert group(qwen3)["config"]["qk_layernorm"] and group(qwen3)["config"]["kv_channels"] == 24


@pytest.mark.parametrize("norm_topk_prob, pre_softmax", [(True, False), (False, True)])
def test_qwen3_moe_router_renormalises_top_k_exactly_when_transformers_does(norm_topk_prob, pre_softmax):
    config = group({**QWEN3_MOE, "norm_topk_prob": norm_topk_prob})["config"]
    assert config["moe_router_pre_softmax"] is pre_softmax
    assert (config["num_moe_experts"], config["moe_router_topk"], config["moe_ffn_hidden_size"]) == (4, 2, 32)


def test_an_unsupported_architecture_stops_naming_it(tmp_path):
    hf = written(tmp_path, {**LLAMA, "architectures": ["GemmaForCausalLM"], "model_type": "gemma"})
    with pytest.raises(HFConfigError, match=r"config.json:2: key 'architectures' is \['GemmaForCausalLM'\]"):
        group(hf)


def test_an_unknown_key_stops_naming_file_line_and_key(tmp_path):
    hf = written(tmp_path, {"logit_softcapping": 30.0, **LLAMA})  # line 1 is "{"
    with pytest.raises(HFConfigError, match=r"config.json:2: key 'logit_softcapping' is not known"):
        group(hf)


@pytest.mark.parametrize(
    "key, value, rule",
    [
        ("hidden_act", "gelu", "SiLU-gated"),
        ("attention_bias", True, "o_proj"),
        ("rope_parameters", {"rope_theta": 1e4, "rope_type": "yarn", "factor": 4.0}, "rope_type 'yarn'"),
    ],
)
def test_a_key_that_changes_the_math_stops_naming_the_rule(key, value, rule):
    with pytest.raises(HFConfigError, match=f"key '{key}'.*{rule}"):
        group({**LLAMA, key: value})


@pytest.mark.parametrize("key, value", [("decoder_sparse_step", 2), ("mlp_only_layers", [0])])
def test_qwen3_moe_with_dense_layers_is_refused(key, value):
    with pytest.raises(HFConfigError, match=f"key '{key}'.*every layer is a mixture of experts"):
        group({**QWEN3_MOE, key: value})


def test_a_sliding_window_shorter_than_the_rows_is_refused_naming_both_keys():
    mistral = {
        **LLAMA,
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "sliding_window": 32,
    }
    del mistral["attention_bias"], mistral["mlp_bias"]
    assert group(mistral, seq_length=32)["config"]["num_layers"] == 2  # rows within the window: plain causal
    with pytest.raises(HFConfigError, match="key 'sliding_window' is 32 but dataset.seq_length is 64"):
        group(mistral, seq_length=64)


def test_a_qwen_sliding_window_counts_only_where_its_layers_use_it():
    unused = {**QWEN3_MOE, "sliding_window": 16, "use_sliding_window": False}
    used = {**unused, "layer_types": ["full_attention", "sliding_attention"]}
    assert group(unused, seq_length=64)
    with pytest.raises(HFConfigError, match="key 'sliding_window' is 16"):
        group(used, seq_length=64)


def test_recipe_keys_outside_config_json_override_and_architecture_keys_may_not(tmp_path):
    written(tmp_path, LLAMA)
    recipe = {"pretrained": str(tmp_path), "attention_backend": "torch", "config": {"hidden_dropout": 0.1}}
    g = pretrained_model_group(recipe, seq_length=64, tp=1)
    assert (g["config"]["hidden_dropout"], g["attention_backend"], g["pretrained"]) == (
        0.1,
        "torch",
        str(tmp_path),
    )
    recipe["config"] = {"num_layers": 4}
    with pytest.raises(HFConfigError, match=r"model.config.num_layers=4 contradicts .*config.json \(2\)"):
        pretrained_model_group(recipe, seq_length=64, tp=1)


def test_a_directory_without_config_json_is_named(tmp_path):
    with pytest.raises(HFConfigError, match="no config.json there"):
        HFCheckpoint.open(tmp_path)
