"""gpt-oss (``GptOssForCausalLM``, ``model_type`` ``gpt_oss``) as Megatron-core's ``GPTModel``, per transformers
5.24's ``modeling_gpt_oss.py``:

* attention with biases on q, k, v and o (Megatron ``add_bias_linear``), a learned sink logit per head in every
  softmax (``self_attn.sinks``: Megatron's and TE's ``softmax_type="learnable"``, ``core_attention.softmax_offset``),
  sliding-window layers (``sliding_window`` 128: ``window_size=(127, 0)``) alternating with full attention
  (``layer_types``);
* YaRN RoPE (:mod:`thdpack.hf.rope`: transformers' frequencies; its ``attention_factor``, which multiplies cos and
  sin and so both q and k, is folded into the softmax scale as its square: ``head_dim ** -0.5 * factor ** 2``);
* a mixture of experts in every layer: router ``mlp.router`` with a bias, top-k of its logits then a softmax over
  those k (Megatron ``moe_router_pre_softmax=false``); experts with biases computing
  ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, ``g = clamp(gate, max=limit)`` (Megatron's
  ``quick_gelu`` with ``glu_linear_offset`` 1 and ``activation_func_clamp_value`` limit; alpha must be 1.702);
* checkpoint experts fused per layer, ``mlp.experts.gate_up_proj`` ``[E, H, 2I]`` with gate and up interleaved
  (columns 0, 2, 4... gate, 1, 3, 5... up), ``down_proj`` ``[E, I, H]`` and their biases, or MXFP4
  (``*_blocks``, ``*_scales``, the released checkpoints: dequantised exactly on import, :mod:`thdpack.hf.mxfp4`).
  :mod:`thdpack.hf.gpt_oss_experts` shows each expert as ``mlp.experts.{e}.{gate,up,down}_proj.{weight,bias}``
  (``nn.Linear`` tensors), so the mapping splits them as Qwen3-MoE's; the export writes them back fused,
  unquantised, in the checkpoint's dtype (config.json without ``quantization_config``).

Read with transformers 5.24.0.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from thdpack.hf.config_keys import ConfigReader
from thdpack.hf.gpt_oss_experts import experts_reader, fuse_experts
from thdpack.hf.mapping import COLUMN, GATED, HF_EXPERT, HF_LAYER, LAYER, REPLICATED, ROW, Rule
from thdpack.hf.rope import inverse_frequencies, rope_parameters

from . import llama, qwen2
from .decoder import Extras, decoder_family

__all__ = ["FAMILY", "MAPPING", "gpt_oss_layers", "layer_types", "model_group"]

_EXPERT = LAYER + "mlp.experts."
MAPPING = (
    llama.EMBEDDINGS
    + llama.ATTENTION
    + qwen2.QKV_BIAS
    + llama.MLP_NORM
    + (
        Rule((LAYER + "self_attention.linear_proj.bias",), (HF_LAYER + "self_attn.o_proj.bias",), REPLICATED),
        Rule(
            (LAYER + "self_attention.core_attention.softmax_offset",), (HF_LAYER + "self_attn.sinks",), COLUMN
        ),
        Rule((LAYER + "mlp.router.weight",), (HF_LAYER + "mlp.router.weight",), REPLICATED),
        Rule((LAYER + "mlp.router.bias",), (HF_LAYER + "mlp.router.bias",), REPLICATED),
        Rule(
            (_EXPERT + "local_experts.{expert}.linear_fc1.weight", _EXPERT + "linear_fc1.weight{expert}"),
            (HF_EXPERT + "gate_proj.weight", HF_EXPERT + "up_proj.weight"),
            GATED,
        ),
        Rule(
            (_EXPERT + "local_experts.{expert}.linear_fc1.bias", _EXPERT + "linear_fc1.bias{expert}"),
            (HF_EXPERT + "gate_proj.bias", HF_EXPERT + "up_proj.bias"),
            GATED,
        ),
        Rule(
            (_EXPERT + "local_experts.{expert}.linear_fc2.weight", _EXPERT + "linear_fc2.weight{expert}"),
            (HF_EXPERT + "down_proj.weight",),
            ROW,
        ),
        Rule(
            (_EXPERT + "local_experts.{expert}.linear_fc2.bias", _EXPERT + "linear_fc2.bias{expert}"),
            (HF_EXPERT + "down_proj.bias",),
            REPLICATED,
        ),
    )
)

# Llama's fixed values, but for what gpt-oss has (attention biases), reads otherwise (MXFP4 experts) or ignores
# (hidden_act: transformers' GptOssExperts always gate with the clamped sigmoid below).
FIXED_VALUES = {
    **{
        k: v
        for k, v in llama.FIXED_VALUES.items()
        if k not in ("attention_bias", "quantization_config", "hidden_act")
    },
    "attention_bias": (True, "gpt-oss's q, k, v and o projections have biases (Megatron add_bias_linear)"),
    "swiglu_alpha": (1.702, "Megatron's quick_gelu gates with sigmoid(1.702 x)"),
}


# GptOssConfig's RoPE where config.json names none.
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


def _yarn(r: ConfigReader) -> dict[str, Any]:
    """The RoPE parameters (``rope_parameters``, or transformers 4's ``rope_theta`` and ``rope_scaling``, or
    ``GptOssConfig``'s defaults)."""
    params = r.get("rope_parameters")
    key = "rope_parameters"
    if params is None:
        key, params = "rope_scaling", dict(r.get("rope_scaling") or DEFAULT_ROPE)
        params.setdefault("rope_theta", r.get("rope_theta", 150000.0))
    elif r.get("rope_theta") is not None and isinstance(params, Mapping):
        params = {"rope_theta": r.config["rope_theta"], **params}
    return rope_parameters(r, key, params, ("default", "yarn"))


def _moe(r: ConfigReader) -> dict[str, Any]:
    experts = r.require("num_local_experts")
    r.used.add("num_experts")  # transformers' attribute_map name of num_local_experts
    topk = r.require("num_experts_per_tok")
    legacy = r.get(
        "experts_per_token"
    )  # the released config.json says it twice; transformers reads the other
    if legacy is not None and legacy != topk:
        raise r.error("experts_per_token", f"is {legacy!r} but num_experts_per_tok is {topk}: which is it?")
    if topk > experts:
        raise r.error("num_experts_per_tok", f"is {topk}: more than the {experts} experts")
    limit = r.get("swiglu_limit", 7.0)
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit > 0:
        raise r.error("swiglu_limit", f"is {limit!r}: a positive number expected")
    return {
        "num_moe_experts": experts,
        "moe_router_topk": topk,
        "moe_ffn_hidden_size": r.require("intermediate_size"),
        "moe_router_pre_softmax": False,  # transformers: top-k of the logits, then a softmax over those k
        "moe_router_score_function": "softmax",
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": float(r.get("router_aux_loss_coef") or 0.0),
        "moe_router_dtype": "fp32",
        "moe_token_dispatcher_type": "alltoall",  # packed rows differ in length from rank to rank
        "activation_func": "quick_gelu",
        "glu_linear_offset": 1.0,
        "activation_func_clamp_value": float(limit),
    }


def model_group(r: ConfigReader, *, seq_length: int, tp: int) -> dict[str, Any]:
    """gpt-oss's model group (:class:`~thdpack.models.family.ModelFamily`). Where ``config.json`` lacks a key,
    ``GptOssConfig``'s default holds (YaRN, swiglu_limit 7, attention biases); one whose default differs from
    Llama's rule (``head_dim``, ``num_key_value_heads``) must be given."""
    for key in ("head_dim", "num_key_value_heads"):
        r.require(key)
    config = llama.decoder_config(r, "gpt_oss", FIXED_VALUES)
    r.get("hidden_act")  # never read by transformers' gpt-oss (FIXED_VALUES)
    # the released config.json's context before YaRN, from OpenAI's own code: transformers never reads it (YaRN
    # reads rope_scaling's original_max_position_embeddings)
    r.get("initial_context_length")
    quantization = r.get("quantization_config")
    if quantization is not None and (
        not isinstance(quantization, Mapping) or quantization.get("quant_method") != "mxfp4"
    ):
        raise r.error(
            "quantization_config",
            f"is {quantization!r}: thdpack imports gpt-oss unquantised or with MXFP4 experts (quant_method mxfp4)",
        )
    types = layer_types(r, config["num_layers"])
    params = _yarn(r)
    _, attention_factor = inverse_frequencies(params, config["kv_channels"])
    config.update(
        add_bias_linear=True,
        add_qkv_bias=True,
        softmax_type="learnable",
        softmax_scale=config["kv_channels"] ** -0.5 * attention_factor**2,
        bias_dropout_fusion=False,  # TE's grouped experts refuse it with biases
        **_moe(r),
    )
    llama.sliding_windows(r, types, config, default=128)
    scaling = params if params["rope_type"] != "default" else None
    return llama.decoder_group(r, "gpt_oss", config, tp, rotary=(float(params["rope_theta"]), scaling))


def layer_types(r: ConfigReader, num_layers: int) -> list[str]:
    """``layer_types`` (transformers' default: sliding, full, sliding...)."""
    types = r.get("layer_types")
    if types is None:
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    kinds = {"sliding_attention", "full_attention"}
    if not isinstance(types, list) or len(types) != num_layers or set(types) - kinds:
        raise r.error("layer_types", f"is {types!r}: one of {sorted(kinds)} per layer ({num_layers} layers)")
    return list(types)


def setup(chunk, model: Mapping) -> None:
    """YaRN's inverse frequencies (its attention factor is in the softmax scale)."""
    from thdpack.hf.load import use_inverse_frequencies

    params = dict(model.get("rope_scaling") or {"rope_type": "default"}) | {
        "rope_theta": model["rotary_base"]
    }
    inv_freq, _ = inverse_frequencies(params, chunk.config.kv_channels)
    use_inverse_frequencies(chunk, inv_freq)


def gpt_oss_layers(spec, backend: str):
    """Megatron's layer spec; on the torch backend the experts' output projection that lets megatron-core add
    their biases during training (:mod:`thdpack.megatron.expert_bias`)."""
    if backend == "te":
        return spec
    from thdpack.megatron.expert_bias import use_expert_row_parallel_linear

    return use_expert_row_parallel_linear(spec)


def check(recipe: Mapping) -> None:
    """No tensor parallelism (megatron-core 0.16.1 takes expert biases with expert tensor parallelism 1 only,
    ``TransformerConfig.__post_init__``; thdpack splits experts over the tensor-parallel group); sinks and windows
    under context parallelism on Transformer Engine (its rules, :mod:`thdpack.megatron.attention.te_rules`)."""
    from thdpack.megatron.attention.te_rules import check_te_context_parallel

    tp = int(recipe["parallel"]["tensor_model_parallel_size"])
    if tp > 1:
        raise ValueError(
            f"parallel.tensor_model_parallel_size is {tp}: gpt-oss's experts have biases, which megatron-core "
            "0.16.1 computes only without expert tensor parallelism, and thdpack splits the experts over the "
            "tensor-parallel group; spread gpt-oss with parallel.expert_model_parallel_size (and pipeline or context "
            "parallelism) and tensor_model_parallel_size=1"
        )
    check_te_context_parallel(recipe, "gpt-oss's attention sinks and sliding windows")


FAMILY = decoder_family(
    "gpt_oss",
    ("GptOssForCausalLM",),
    model_group,
    MAPPING,
    Extras(layers=gpt_oss_layers, setup=setup, tensors=experts_reader, written=fuse_experts, check=check),
)
