"""gpt-oss (thdpack.models.gpt_oss) against transformers' GptOssForCausalLM: the tiny model of tests/hf_models.py
gives transformers' logits packed (tests/unit/test_hf_import.py, 1e-5) and under PP/CP/EP
(tests/functional/test_hf_parallel.py); here what is gpt-oss's own: YaRN, the features that bite in the tiny
config, MXFP4 experts (a checkpoint quantised in transformers' layout) dequantised as transformers does, the
export written back fused and unquantised, the Hub's config, and what is refused."""

from __future__ import annotations

import json

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

EXPERTS, HIDDEN, WIDTH = 4, 64, 32  # the tiny model's experts, hidden size and expert width
# openai/gpt-oss-20b's config.json (transformers 4.55), at tiny size
HUB = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 2, "head_dim": 16, "hidden_act": "silu", "hidden_size": HIDDEN, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": WIDTH, "layer_types": ["sliding_attention", "full_attention"],
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 4,
    "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_key_value_heads": 2, "num_local_experts": EXPERTS,
    "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": {
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                   "lm_head"],
        "quant_method": "mxfp4",
    },
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 300,
}  # fmt: skip


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return save_model("gpt_oss", tmp_path_factory.mktemp("gpt_oss") / "source")


def quantize_experts(source, target):
    """``source`` with every layer's expert weights replaced by random MXFP4 codes in transformers' layout
    (``*_blocks`` uint8 ``[EXPERTS, out, in / 32, 16]``, ``*_scales`` uint8 ``[EXPERTS, out, in / 32]``: powers of two
    2**-7 to 2**-5, weights up to 0.19 as the others) and ``quantization_config`` mxfp4, as the released checkpoints
    are stored."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    tensors = load_file(str(target / "model.safetensors"))
    g = torch.Generator().manual_seed(7)
    for layer in range(2):
        prefix = f"model.layers.{layer}.mlp.experts."
        for part, (rows, cols) in {"gate_up_proj": (2 * WIDTH, HIDDEN), "down_proj": (HIDDEN, WIDTH)}.items():
            del tensors[prefix + part]
            shape = (EXPERTS, rows, cols // 32)
            tensors[prefix + part + "_blocks"] = torch.randint(
                0, 256, (*shape, 16), dtype=torch.uint8, generator=g
            )
            tensors[prefix + part + "_scales"] = torch.randint(
                120, 123, shape, dtype=torch.uint8, generator=g
            )
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = HUB["quantization_config"]
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target


@pytest.fixture(scope="module")
def mxfp4(source, tmp_path_factory):
    return quantize_experts(source, tmp_path_factory.mktemp("gpt_oss_mxfp4") / "source")


def test_mxfp4_dequantises_as_transformers_bit_for_bit():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from thdpack.hf.mxfp4 import dequantize_mxfp4

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 2, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 150, (3, 8, 2), dtype=torch.uint8, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        ours = dequantize_mxfp4(blocks, scales, dtype).transpose(1, 2)
        assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales, dtype=dtype))


@pytest.mark.usefixtures("one_rank_megatron")
def test_yarn_frequencies_are_transformers_and_its_attention_factor_is_in_the_softmax_scale(source):
    rotary = build("gpt_oss").model.rotary_emb
    model = megatron_model(source)
    assert torch.equal(model.rotary_pos_emb.inv_freq, rotary.inv_freq)
    assert rotary.attention_scaling > 1
    assert model.config.softmax_scale == pytest.approx(16**-0.5 * rotary.attention_scaling**2, rel=1e-15)


@pytest.mark.parametrize(
    "change",
    [
        {"sliding_window": 64},  # the window no longer bites
        {"swiglu_limit": 100.0},  # the clamp no longer bites
        {"rope_scaling": None},  # no YaRN
    ],
)
def test_what_the_tiny_config_exercises_changes_transformers_logits(change):
    batch = padded_batch(300)
    base, changed = (hf_logits_per_sample(build("gpt_oss", **c), batch) for c in ({}, change))
    assert not all(torch.allclose(a, b, atol=1e-3) for a, b in zip(base, changed, strict=True))


def test_the_sinks_change_transformers_logits():
    batch = padded_batch(300)
    model = build("gpt_oss")
    base = hf_logits_per_sample(model, batch)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-1e4)  # no weight left for the sink
    changed = hf_logits_per_sample(model, batch)
    assert not all(torch.allclose(a, b, atol=1e-3) for a, b in zip(base, changed, strict=True))


@pytest.mark.usefixtures("one_rank_megatron")
def test_mxfp4_experts_load_as_transformers_dequantises_them_and_give_its_logits(mxfp4):
    from tests.hf_models import max_logit_difference
    from thdpack.hf.checkpoint_hf import hf_state
    from thdpack.hf.gpt_oss_experts import fuse_experts
    from thdpack.models.gpt_oss import MAPPING

    hf = hf_model(mxfp4)  # transformers dequantises MXFP4 on a CPU
    model = megatron_model(mxfp4)
    ours = fuse_experts(hf_state(model, MAPPING, 300))
    theirs = hf.state_dict()
    experts = [n for n in ours if ".mlp.experts." in n]
    assert len(experts) == 8 and [n for n in experts if not torch.equal(ours[n], theirs[n])] == []
    assert max_logit_difference(model, hf, padded_batch(300)) <= 1e-5


@pytest.mark.usefixtures("one_rank_megatron")
def test_import_then_export_gives_back_every_fused_tensor_bitwise(source):
    from safetensors.torch import load_file

    from thdpack.hf.checkpoint_hf import hf_state
    from thdpack.hf.gpt_oss_experts import fuse_experts
    from thdpack.models.gpt_oss import MAPPING

    original = load_file(str(source / "model.safetensors"))
    exported = fuse_experts(hf_state(megatron_model(source), MAPPING, 300))
    assert sorted(exported) == sorted(original)
    assert [n for n in original if not torch.equal(exported[n], original[n])] == []


@pytest.mark.usefixtures("one_rank_megatron")
def test_an_mxfp4_checkpoint_exports_unquantised_in_bf16_and_transformers_loads_it(mxfp4, tmp_path):
    from safetensors.torch import load_file

    from thdpack.models.export import main

    gpt = megatron_model(mxfp4).to(torch.bfloat16)  # a bf16 run's weights
    save_run_checkpoint(gpt, mxfp4, tmp_path / "ckpt", precision="bf16")
    main([str(tmp_path / "ckpt"), str(tmp_path / "out")])
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    exported = load_file(str(tmp_path / "out" / "model-00001-of-00001.safetensors"))
    assert {t.dtype for t in exported.values()} == {torch.bfloat16}
    dequantised = hf_model(mxfp4).state_dict()
    assert sorted(exported) == sorted(dequantised)
    # MXFP4 values are exact in bf16: the export is transformers' dequantised weights, bit for bit
    assert [n for n in exported if not torch.equal(exported[n], dequantised[n].to(torch.bfloat16))] == []
    reloaded = hf_model(tmp_path / "out")
    assert type(reloaded).__name__ == "GptOssForCausalLM"
    assert torch.equal(
        reloaded.model.layers[1].mlp.experts.down_proj,
        dequantised["model.layers.1.mlp.experts.down_proj"].bfloat16().float(),
    )


def test_the_hubs_mxfp4_config_imports(tmp_path):
    group = model_group(write_config(tmp_path, HUB), seq_length=64)
    config = group["config"]
    assert (config["num_moe_experts"], config["moe_router_topk"], config["moe_ffn_hidden_size"]) == (
        EXPERTS,
        2,
        WIDTH,
    )
    assert config["window_size"] == [127, 0] and config["window_attn_skip_freq"] == [1, 0]
    assert config["softmax_type"] == "learnable" and config["add_bias_linear"] is True
    assert (
        config["activation_func"],
        config["glu_linear_offset"],
        config["activation_func_clamp_value"],
    ) == (
        "quick_gelu",
        1.0,
        7.0,
    )
    assert group["rope_scaling"]["rope_type"] == "yarn" and group["rotary_base"] == 150000.0


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("swiglu_alpha", 1.5, r"is 1.5: thdpack needs 1.702"),
        ("attention_bias", False, r"is False: thdpack needs True"),
        (
            "quantization_config",
            {"quant_method": "fp8"},
            r"is .*: thdpack imports gpt-oss unquantised or with MXFP4",
        ),
        ("experts_per_token", 3, r"is 3 but num_experts_per_tok is 2"),
        (
            "rope_scaling",
            {"rope_type": "llama3", "factor": 8.0},
            r"has rope_type 'llama3': this family imports",
        ),
    ],
)
def test_what_thdpack_cannot_compute_is_refused_naming_the_key(tmp_path, key, value, match):
    with pytest.raises(HFConfigError, match=rf"config.json:\d+: key '{key}' {match}"):
        model_group(write_config(tmp_path, {**HUB, key: value}), seq_length=64)


def test_fused_experts_of_another_shape_stop_the_import_naming_the_tensor(source, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from thdpack.hf.gpt_oss_experts import experts_reader

    shutil.copytree(source, tmp_path / "bad")
    tensors = load_file(str(tmp_path / "bad" / "model.safetensors"))
    tensors["model.layers.1.mlp.experts.down_proj"] = tensors["model.layers.1.mlp.experts.down_proj"][
        :, :16
    ].clone()
    save_file(tensors, str(tmp_path / "bad" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=r"'model.layers.1.mlp.experts.down_proj' is \[4, 16, 64\] but config.json"
    ):
        experts_reader(HFCheckpoint.open(tmp_path / "bad").tensors())


def recipe(backend="torch", tp=1, cp=1, **config):
    return {
        "model": {"attention_backend": backend, "config": {"softmax_type": "learnable", **config}},
        "parallel": {"tensor_model_parallel_size": tp, "context_parallel_size": cp},
    }


def test_tensor_parallelism_is_refused_for_the_expert_biases():
    from thdpack.models.gpt_oss import check

    with pytest.raises(
        ValueError, match=r"parallel.tensor_model_parallel_size is 2: gpt-oss's experts have biases"
    ):
        check(recipe(tp=2))


def test_sinks_under_te_context_parallelism_need_cp_comm_type_a2a():
    from thdpack.models.gpt_oss import check

    with pytest.raises(ValueError, match=r"cp_comm_type is 'all_gather': .* need cp_comm_type in \['a2a'\]"):
        check(recipe("te", cp=2, cp_comm_type="all_gather"))
    check(recipe("te", cp=2, cp_comm_type="a2a"))
    check(recipe("torch", cp=2))  # thdpack's torch attention computes sinks under any CP


@pytest.mark.usefixtures("one_rank_megatron")
def test_a_training_step_reaches_the_sinks_and_every_bias(source):
    grads = training_step_grads(megatron_model(source), padded_batch(300))
    for part in (
        "core_attention.softmax_offset",
        "router.bias",
        "linear_fc1.bias",
        "linear_fc2.bias",
        "qkv.bias",
    ):
        named = [n for n in grads if n.endswith(part)]
        assert named and all(grads[n] is not None and grads[n].abs().sum() > 0 for n in named), part
