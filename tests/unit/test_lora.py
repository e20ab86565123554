"""LoRA's rules besides the parity with PEFT (tests/unit/test_lora_parity.py): what an adapter directory may hold,
which modules can be adapted, what is frozen and where it lives (no gradient buffer, no optimizer state, the base in
bf16), the output forms of Transformer Engine's fused norm + linear, resuming only onto the same adapters and base,
and the memory a LoRA run is estimated to need."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from tests.hf_models import padded_batch, save_model
from tests.lora_parity import RANK, model_group, peft_reference, write_peft_adapter
from thdpack.hf.adapter import lora_layers, read_adapter, read_config, target_names
from thdpack.megatron.lora import LoRASettings, _with_adapter
from thdpack.models.lora import check_resume, resolve_peft

pytestmark = [pytest.mark.cpu_only]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A tiny Qwen3 directory and a PEFT adapter of it (q, v, down)."""
    root = tmp_path_factory.mktemp("lora_rules")
    source = save_model("qwen3", root / "source")
    return source, write_peft_adapter(source, root / "peft", ["q_proj", "v_proj", "down_proj"])


def _adapter_config(tmp_path, **changes):
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "bias": "none"}
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, **changes}))
    return tmp_path


# ------------------------------------------------------------------------------------------ adapter_config.json


def test_dora_is_refused_naming_the_key_and_the_file(tmp_path):
    with pytest.raises(
        ValueError, match=r"adapter_config.json: use_dora is True: DoRA .* is not implemented"
    ):
        read_config(_adapter_config(tmp_path, use_dora=True))


def test_an_unknown_option_with_a_value_is_refused_and_a_null_one_passes(tmp_path):
    with pytest.raises(ValueError, match=r"new_trick is 'on': thdpack does not know what this PEFT option"):
        read_config(_adapter_config(tmp_path, new_trick="on"))
    assert read_config(_adapter_config(tmp_path, new_trick=None))["r"] == 4


def test_an_initialisation_that_changed_the_base_weights_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"init_lora_weights is 'pissa_niter_4': .* changed the base model"):
        read_config(_adapter_config(tmp_path, init_lora_weights="pissa_niter_4"))


def test_an_adapter_on_the_vision_tower_is_refused(tmp_path):
    from safetensors.torch import save_file

    _adapter_config(tmp_path)
    key = "base_model.model.model.visual.blocks.0.attn.qkv.lora_A.weight"
    save_file({key: torch.zeros(4, 8)}, str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(
        ValueError, match="adapts the vision tower: thdpack's LoRA adapts the language model only"
    ):
        read_adapter(tmp_path, vision_language=True)


def test_rslora_scales_the_branch_by_alpha_over_the_square_root_of_the_rank():
    assert LoRASettings(rank=16, alpha=32, rslora=True).scale == 32 / math.sqrt(16)
    assert LoRASettings(rank=16, alpha=32).scale == 2.0


# ------------------------------------------------------------------------------------------ targets


def test_all_linear_is_every_attention_and_mlp_module_of_a_dense_family():
    from thdpack.models import get_family

    assert target_names(lora_layers(get_family("llama").mapping), "all-linear") == tuple(ALL)


def test_a_moe_family_adapts_attention_only_and_names_what_it_can_when_asked_for_more():
    from thdpack.models import get_family

    layers = lora_layers(get_family("qwen3_moe").mapping)
    assert target_names(layers, "all-linear") == ("q_proj", "k_proj", "v_proj", "o_proj")
    with pytest.raises(
        ValueError, match=r"peft.target_modules names \['gate_proj'\]: LoRA adapts \['q_proj'"
    ):
        target_names(layers, ["q_proj", "gate_proj"])


def test_peft_lora_needs_a_pretrained_model():
    with pytest.raises(
        ValueError, match="peft=lora adapts a pretrained model: set model=hf model.pretrained=DIR"
    ):
        resolve_peft({"name": "lora"}, {"family": "gpt"})


def test_from_adapter_fills_the_null_keys_and_refuses_a_contradicting_one(qwen3):
    source, adapter = qwen3
    group = model_group(source, tp=1)
    peft = resolve_peft({"name": "lora", "from_adapter": str(adapter)}, group)
    assert (peft["rank"], peft["alpha"], peft["target_modules"]) == (
        RANK,
        8.0,
        ["q_proj", "v_proj", "down_proj"],
    )
    with pytest.raises(
        ValueError, match=r"peft.rank=16 but .*adapter_config.json says r=4: the adapter fixes it"
    ):
        resolve_peft({"name": "lora", "from_adapter": str(adapter), "rank": 16}, group)


# ------------------------------------------------------------------------------------------ frozen base


@pytest.mark.usefixtures("one_rank_megatron")
def test_the_base_is_frozen_in_bf16_without_gradient_buffer_or_optimizer_state(qwen3):
    from megatron.core.transformer.module import Float16Module

    from thdpack.megatron.config import transformer_config
    from thdpack.megatron.distributed import wrap_model
    from thdpack.megatron.optimizer import build_optimizer
    from thdpack.megatron.runtime import Runtime
    from thdpack.models import get_family
    from thdpack.models.lora import apply_peft

    source, adapter = qwen3
    group = model_group(source, tp=1)
    parallel = dict.fromkeys(
        ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"), 1
    ) | {"expert_model_parallel_size": 1}
    runtime = Runtime("cpu", "bf16", "torch")
    config = transformer_config(group, parallel, runtime)
    peft = resolve_peft({"name": "lora", "from_adapter": str(adapter)}, group)
    module = apply_peft(
        get_family(group["family"]).build(group, config, group["vocab_size"], 64, runtime),
        peft,
        group,
        config,
    )
    model = wrap_model(module, config, runtime)
    trainer = dict(
        lr=1e-3, min_lr=1e-4, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95, clip_grad=1.0,
        train_iters=2, lr_warmup_iters=0, lr_decay_style="constant",
    )  # fmt: skip
    optimizer, _ = build_optimizer(trainer, model, config)
    assert isinstance(model.module, Float16Module)
    named = dict(model.module.module.named_parameters())
    adapters = {n: p for n, p in named.items() if ".lora_" in n}
    base = {n: p for n, p in named.items() if ".lora_" not in n}
    assert adapters and all(p.requires_grad for p in adapters.values())
    assert not any(p.requires_grad for p in base.values())
    assert {p.dtype for p in base.values()} == {torch.bfloat16}
    assert not any(hasattr(p, "main_grad") for p in base.values())
    buffered = sum(b.numel for b in model.buffers)
    assert buffered == sum(p.numel() for p in adapters.values())
    in_optimizer = [p for group in optimizer.param_groups for p in group["params"]]
    assert sum(p.numel() for p in in_optimizer) == buffered  # the fp32 main copies of the adapters only
    assert {p.dtype for p in in_optimizer} == {torch.float32}


@pytest.mark.usefixtures("one_rank_megatron")
def test_rslora_adapters_compute_what_peft_computes(tmp_path):
    from tests.hf_models import megatron_model
    from thdpack.megatron.step import forward_step
    from thdpack.models.lora import apply_peft

    source = save_model("llama2", tmp_path / "source")
    adapter = write_peft_adapter(source, tmp_path / "peft", ALL, rslora=True)
    batch = padded_batch(300, seed=1)
    reference = peft_reference(source, adapter, batch)
    group = model_group(source, tp=1)
    model = megatron_model(source)
    peft = resolve_peft({"name": "lora", "from_adapter": str(adapter)}, group)
    assert peft["use_rslora"] is True
    apply_peft(model, peft, group, model.config)
    output, loss_func = forward_step(iter([batch]), model)
    loss_sum, count, _ = loss_func(output)
    assert float(loss_sum.detach() / count) == pytest.approx(reference.loss, rel=1e-5)


@pytest.mark.usefixtures("one_rank_megatron")
def test_the_fused_output_loss_trains_the_adapters_as_peft_and_leaves_the_frozen_output_layer_alone(qwen3):
    from tests.hf_models import megatron_model
    from tests.lora_parity import relative
    from thdpack.hf.adapter import peft_key
    from thdpack.megatron.lora import adapter_modules
    from thdpack.megatron.output_loss import use_output_loss
    from thdpack.megatron.step import forward_step
    from thdpack.models.lora import apply_peft

    source, adapter = qwen3
    batch = padded_batch(300, seed=1)
    reference = peft_reference(source, adapter, batch)
    group = model_group(source, tp=1)
    model = megatron_model(source).train()
    use_output_loss(model, "chunked", chunk_tokens=7)  # never builds the whole [tokens, vocab] logits
    apply_peft(
        model, resolve_peft({"name": "lora", "from_adapter": str(adapter)}, group), group, model.config
    )
    output, loss_func = forward_step(iter([batch]), model)
    loss_sum, count, _ = loss_func(output)
    (loss_sum / count).backward()
    assert float(loss_sum.detach() / count) == pytest.approx(reference.loss, rel=1e-5)
    for _, branch in adapter_modules(model):
        for part, key in zip(branch.parts, branch.keys, strict=True):
            if part is not None:
                assert relative(branch.lora_A[part].grad, reference.grads[peft_key(key, "A")]) < 1e-5
                assert relative(branch.lora_B[part].grad, reference.grads[peft_key(key, "B")]) < 1e-5
    assert model.output_layer.weight.grad is None


@pytest.mark.usefixtures("one_rank_megatron")
def test_full_activation_recomputation_still_trains_the_first_layers_adapters(qwen3):
    from tests.lora_parity import relative
    from thdpack.hf.adapter import peft_key
    from thdpack.megatron.config import transformer_config
    from thdpack.megatron.lora import adapter_modules
    from thdpack.megatron.runtime import Runtime
    from thdpack.megatron.step import forward_step
    from thdpack.models import get_family, pretrained_model_group
    from thdpack.models.lora import apply_peft

    source, adapter = qwen3
    batch = padded_batch(300, seed=1)
    reference = peft_reference(source, adapter, batch)
    recompute = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    recipe = {"pretrained": str(source), "attention_backend": "torch", "config": recompute}
    group = pretrained_model_group(recipe, seq_length=64, tp=1)
    parallel = dict.fromkeys(
        ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"), 1
    ) | {"expert_model_parallel_size": 1}
    runtime = Runtime("cpu", "fp32", "torch")
    config = transformer_config(group, parallel, runtime)
    model = get_family(group["family"]).build(group, config, group["vocab_size"], 64, runtime)
    apply_peft(model, resolve_peft({"name": "lora", "from_adapter": str(adapter)}, group), group, config)
    output, loss_func = forward_step(iter([batch]), model)
    loss_sum, count, _ = loss_func(output)
    (loss_sum / count).backward()
    first = [b for name, b in adapter_modules(model) if name.startswith("decoder.layers.0.")]
    assert first
    for branch in first:
        for part, key in zip(branch.parts, branch.keys, strict=True):
            if part is not None:
                assert relative(branch.lora_A[part].grad, reference.grads[peft_key(key, "A")]) < 1e-5


# ------------------------------------------------------------------------------------------ TE's output forms


class _Branch(nn.Module):
    def forward(self, x):
        return 10 * x


@pytest.mark.parametrize(
    "form",
    [
        lambda out, ln: (out, None),  # megatron-core's linear layers: (output, bias)
        lambda out, ln: ((out, ln), None),  # TE's norm + linear with return_layernorm_output
        lambda out, ln: (out, None, ln),  # the same with its bias returned
    ],
)
def test_the_branch_takes_the_fused_norms_output_in_every_output_form(form):
    x, ln, out = torch.ones(2, 3), torch.full((2, 3), 2.0), torch.full((2, 3), 5.0)
    result, bias = _with_adapter(_Branch())(None, (x,), form(out, ln))
    normed = form(out, ln) != (out, None)
    assert bias is None and torch.equal(result, out + 10 * (ln if normed else x))


# ------------------------------------------------------------------------------------------ resume, memory


def test_resuming_needs_the_same_adapters_and_the_same_base():
    record = {"rank": 4, "alpha": 8.0, "use_rslora": False, "target_modules": ["q_proj"], "pretrained": "a"}
    record["base_fingerprint"] = "f"
    check_resume({"peft": record}, record, "ckpt")
    with pytest.raises(ValueError, match=r"ckpt holds adapters with rank=4; this run has peft.rank=8"):
        check_resume({"peft": record}, {**record, "rank": 8}, "ckpt")
    with pytest.raises(
        ValueError, match=r"trained on the base model a, but model.pretrained=b is not that model"
    ):
        check_resume({"peft": record}, {**record, "pretrained": "b", "base_fingerprint": "g"}, "ckpt")
    with pytest.raises(ValueError, match="ckpt was saved by a full fine-tune; this run is with peft=lora"):
        check_resume({"iteration": 2}, record, "ckpt")


def test_the_memory_check_lets_a_lora_fine_tune_of_llama3_8b_onto_one_80_gb_gpu_and_refuses_the_full_one():
    from hydra import compose, initialize_config_dir

    from thdpack.training.config_error import ConfigError
    from thdpack.training.memory import GIB, check_memory, estimate_memory
    from thdpack.training.recipe_keys import recipes_dir

    with initialize_config_dir(config_dir=str(recipes_dir()), version_base="1.3"):
        cfg = compose("train", overrides=["model=llama3_8b", "dataset.micro_batch_tokens=16384"])
    lora = {**cfg, "peft": {"name": "lora", "rank": 16, "target_modules": ALL}}
    check_memory(lora, world_size=1, device="cuda", backend="te", available=80 * GIB)
    with pytest.raises(ConfigError, match="model=llama3_8b needs about"):
        check_memory(cfg, world_size=1, device="cuda", backend="te", available=80 * GIB)
    full = estimate_memory(cfg, world_size=1, device="cuda", backend="te")
    adapted = estimate_memory(lora, world_size=1, device="cuda", backend="te")
    assert adapted.weights == pytest.approx(full.weights, rel=0.01)  # the base in bf16, plus the adapters
    assert adapted.gradients + adapted.optimizer < 0.01 * (full.gradients + full.optimizer)


def _resolved(*overrides):
    from hydra import compose, initialize_config_dir

    from thdpack.training.recipe import resolve_recipe
    from thdpack.training.recipe_keys import recipes_dir

    with initialize_config_dir(config_dir=str(recipes_dir()), version_base="1.3"):
        return resolve_recipe(compose("train", overrides=list(overrides)), device="cuda")


def test_the_recipe_resolves_peft_lora_with_its_defaults_and_leaves_the_fused_mlp_off(qwen3):
    cfg = _resolved("model=hf", f"model.pretrained={qwen3[0]}", "peft=lora")
    assert (cfg.peft.rank, cfg.peft.alpha, list(cfg.peft.target_modules)) == (16, 32.0, ALL)
    assert cfg.model.te_op_fuser is False  # auto: the adapters hang on the MLP's linear layers
    assert _resolved("model=hf", f"model.pretrained={qwen3[0]}").peft.name == "none"


def test_a_bad_peft_value_stops_the_recipe_naming_the_key(qwen3):
    from thdpack.training.config_error import ConfigError

    with pytest.raises(ConfigError, match=r"peft.rank is 0: a positive integer expected"):
        _resolved("model=hf", f"model.pretrained={qwen3[0]}", "peft=lora", "peft.rank=0")
    with pytest.raises(ConfigError, match=r"peft.target_modules names \['qkv_proj'\]"):
        _resolved("model=hf", f"model.pretrained={qwen3[0]}", "peft=lora", "peft.target_modules=[qkv_proj]")
