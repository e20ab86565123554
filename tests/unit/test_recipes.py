"""Every model recipe composes into a Megatron TransformerConfig that megatron-core accepts (on CPU: the GPU
presets are checked for their configuration, not built), and the default recipe passes the start-up checks."""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_dir

from thdpack.megatron.config import padded_vocab_size, transformer_config
from thdpack.megatron.runtime import Runtime
from thdpack.training.checks import check_recipe
from thdpack.training.flops import FlopsModel
from thdpack.training.loop import recipes_dir
from thdpack.training.recipe import resolve_recipe

MODELS = sorted(p.stem for p in (recipes_dir() / "model").glob("*.yaml"))
# model=hf takes its architecture from model.pretrained's config.json
PRESETS = [m for m in MODELS if m != "hf"]


def _compose(*overrides):
    with initialize_config_dir(str(recipes_dir()), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def test_the_recipes_hold_every_model_the_readme_names():
    assert MODELS == [
        "hf",
        "llama3_1b",
        "llama3_8b",
        "qwen2_5_vl_7b",
        "qwen3_30b_a3b",
        "tiny_gpt",
        "tiny_moe",
        "tiny_mrope",
    ]


@pytest.mark.parametrize("model", PRESETS)
def test_model_recipe_builds_a_transformer_config(model):
    cfg = _compose(f"model={model}")
    config = transformer_config(cfg.model, cfg.parallel, Runtime("cpu", "fp32", "torch"))
    assert config.calculate_per_token_loss
    assert cfg.model.name == model
    vocab = padded_vocab_size(cfg.model, 259, 1)
    flops = FlopsModel.of(config, vocab)
    assert flops.training_flops([128]) > 0
    if cfg.model.position_embedding_type == "mrope":
        head_dim = config.kv_channels or config.hidden_size // config.num_attention_heads
        assert sum(cfg.model.config.mrope_section) == head_dim // 2


def test_hf_recipe_resolves_to_the_transformer_config_of_its_config_json(tmp_path):
    import json

    qwen3 = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 301,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 24,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
    }
    (tmp_path / "config.json").write_text(json.dumps(qwen3))
    overrides = (
        "model=hf",
        f"model.pretrained={tmp_path}",
        "parallel=tp2",
        "model.config.hidden_dropout=0.1",
    )
    cfg = resolve_recipe(_compose(*overrides), device="cpu")
    config = transformer_config(cfg.model, cfg.parallel, Runtime("cpu", "fp32", "torch"))
    assert (config.num_layers, config.kv_channels, config.qk_layernorm) == (2, 24, True)
    assert config.hidden_dropout == 0.1  # a recipe key config.json does not fix
    assert padded_vocab_size(cfg.model, 259, 2) == 302  # the checkpoint's 301 ids, padded for TP2
    assert cfg.model.family == "qwen3"  # the family of config.json's architectures
    check_recipe(cfg, world_size=2, device="cpu")


def vl_directory(tmp_path):
    """A directory with a tiny Qwen2.5-VL config.json (no weights: the recipe reads config.json only)."""
    import json

    from tests.vlm_models import build_tokenizer, tiny_config

    (tmp_path / "config.json").write_text(json.dumps(tiny_config(build_tokenizer(tmp_path))))
    return tmp_path


def test_hf_recipe_with_a_qwen2_5_vl_directory_resolves_to_the_vl_family_with_mrope(tmp_path):
    overrides = ("model=hf", f"model.pretrained={vl_directory(tmp_path)}", "dataset=embedded_vlm")
    cfg = resolve_recipe(_compose(*overrides), device="cpu")
    assert cfg.model.family == "qwen2_5_vl" and cfg.model.freeze_vision
    assert cfg.model.position_embedding_type == "mrope" and cfg.dataset.mrope  # the collator emits MRoPE ids
    config = transformer_config(cfg.model, cfg.parallel, Runtime("cpu", "fp32", "torch"))
    assert list(config.mrope_section) == [2, 3, 3] and config.add_qkv_bias
    assert check_recipe(cfg, world_size=1, device="cpu") == []


def test_the_recipe_may_train_the_vision_tower(tmp_path):
    overrides = ("model=hf", f"model.pretrained={vl_directory(tmp_path)}", "model.freeze_vision=false")
    assert resolve_recipe(_compose(*overrides), device="cpu").model.freeze_vision is False


def test_llama3_1b_flops_model_counts_its_gemm_parameters():
    cfg = _compose("model=llama3_1b")
    config = transformer_config(cfg.model, cfg.parallel, Runtime("cpu", "fp32", "torch"))
    flops = FlopsModel.of(config, 128256)
    # head dim 2048 / 32 = 64; 16 layers x (QKV 2048 x 64 x (32 + 2 x 8), output 32 x 64 x 2048, SwiGLU
    # 3 x 2048 x 8192) + the output layer 2048 x 128256: 1.24e9, Llama 3.2 1B's parameters without the embedding
    expected = 16 * (2048 * 64 * 48 + 32 * 64 * 2048 + 3 * 2048 * 8192) + 2048 * 128256
    assert flops.gemm_params == expected
    assert flops.attn_coeff == 2 * 16 * 32 * 64


def test_default_recipe_passes_the_start_up_checks_on_one_cpu_process():
    assert check_recipe(resolve_recipe(_compose(), "cpu"), world_size=1, device="cpu") == []


def test_unknown_transformer_config_key_is_named():
    cfg = _compose("+model.config.no_such_key=1")
    with pytest.raises(ValueError, match="no_such_key"):
        transformer_config(cfg.model, cfg.parallel, Runtime("cpu", "fp32", "torch"))


def test_runtime_defaults_follow_the_device():
    from thdpack.megatron.runtime import resolve_runtime

    cfg = _compose()
    runtime = resolve_runtime(cfg.trainer.precision, cfg.model.attention_backend)
    expected = ("cuda", "bf16", "te") if torch.cuda.is_available() else ("cpu", "fp32", "torch")
    assert (runtime.device, runtime.precision, runtime.backend) == expected


@pytest.mark.parametrize(
    ("overrides", "device", "fused"),
    [
        ((), "cpu", False),  # the torch backend has no TE modules
        (("model=llama3_1b",), "cpu", False),
        (("model=llama3_1b",), "cuda", True),
        (("model=tiny_moe",), "cuda", False),  # experts: megatron-core's TEFusedMLP is a dense MLP
        # Gemma 3's tanh GELU: no TE operation in megatron-core's TEFusedMLP
        (("model=llama3_1b", "model.config.activation_func=gelu_tanh"), "cuda", False),
        (("model=llama3_1b", "model.te_op_fuser=false"), "cuda", False),
        # delayed scaling keeps a history that the fused operations' checkpoints lack; current scaling keeps none
        (("model=llama3_1b", "trainer.precision=fp8", "trainer.fp8_recipe=delayed"), "cuda", False),
        (("model=llama3_1b", "trainer.precision=fp8", "trainer.fp8_recipe=tensorwise"), "cuda", True),
        (("model.te_op_fuser=true",), "cpu", True),  # kept as given; check_recipe refuses it with the reason
    ],
)
def test_te_op_fuser_auto_is_on_with_transformer_engine_a_dense_mlp_and_no_fp8_history(
    overrides, device, fused
):
    assert resolve_recipe(_compose(*overrides), device=device).model.te_op_fuser is fused
