"""Llama (``LlamaForCausalLM``: Llama 2, Llama 3.x with ``llama3`` RoPE scaling) as Megatron-core's ``GPTModel``,
and the pieces every Llama-like decoder reuses (Mistral, Qwen2, Qwen3, Qwen3-MoE; their modules say what differs).

A Llama-like decoder: token embedding, per layer RMSNorm -> grouped-query attention with RoPE -> RMSNorm -> SwiGLU
MLP, a final RMSNorm and the output layer (tied to the embedding or not). ``config.json`` -> the recipe's model
group: :func:`decoder_config` (the Megatron settings), :func:`rope` (``rope_parameters`` of transformers 5, or
``rope_theta`` and ``rope_scaling`` of transformers 4), :func:`window_within_rows`, :func:`decoder_group`; tensors:
the rules of :data:`MAPPING` (Megatron-Bridge's ``llama_bridge.py`` for the names, thdpack's code).

Read with transformers 5.24.0 (CPU tests) and 5.17 (GPU host).
"""

from __future__ import annotations

import math
from typing import Any

from thdpack.hf.config_keys import ConfigReader
from thdpack.hf.mapping import GATED, HF_LAYER, LAYER, QKV, REPLICATED, ROW, VOCAB, Rule

from .decoder import decoder_family

__all__ = [
    "ATTENTION",
    "DENSE_MLP",
    "EMBEDDINGS",
    "FAMILY",
    "FIXED_VALUES",
    "MAPPING",
    "MLP_NORM",
    "decoder_config",
    "decoder_group",
    "model_group",
    "rope",
    "window_within_rows",
]

# One line per Megatron tensor: its names (local spec, Transformer Engine spec), the HF tensors, the kind of merge.
EMBEDDINGS = (
    Rule(("embedding.word_embeddings.weight",), ("model.embed_tokens.weight",), VOCAB),
    Rule(("decoder.final_layernorm.weight",), ("model.norm.weight",), REPLICATED),
    Rule(("output_layer.weight",), ("lm_head.weight",), VOCAB, when="untied"),
    # tied: the last pipeline stage's copy of the embedding (absent with one stage)
    Rule(("output_layer.weight",), ("model.embed_tokens.weight",), VOCAB, when="tied"),
)
ATTENTION = (
    Rule(
        (LAYER + "input_layernorm.weight", LAYER + "self_attention.linear_qkv.layer_norm_weight"),
        (HF_LAYER + "input_layernorm.weight",),
        REPLICATED,
    ),
    Rule(
        (LAYER + "self_attention.linear_qkv.weight",),
        tuple(HF_LAYER + f"self_attn.{p}_proj.weight" for p in "qkv"),
        QKV,
    ),
    Rule((LAYER + "self_attention.linear_proj.weight",), (HF_LAYER + "self_attn.o_proj.weight",), ROW),
)
MLP_NORM = (
    Rule(
        (LAYER + "pre_mlp_layernorm.weight", LAYER + "mlp.linear_fc1.layer_norm_weight"),
        (HF_LAYER + "post_attention_layernorm.weight",),
        REPLICATED,
    ),
)
DENSE_MLP = (
    Rule(
        (LAYER + "mlp.linear_fc1.weight",),
        (HF_LAYER + "mlp.gate_proj.weight", HF_LAYER + "mlp.up_proj.weight"),
        GATED,
    ),
    Rule((LAYER + "mlp.linear_fc2.weight",), (HF_LAYER + "mlp.down_proj.weight",), ROW),
)
MAPPING = EMBEDDINGS + ATTENTION + MLP_NORM + DENSE_MLP

# Keys that must hold one value (the one thdpack computes); anything else changes the math.
FIXED_VALUES = {
    "hidden_act": ("silu", "thdpack imports SiLU-gated MLPs (Megatron gated_linear_unit with silu)"),
    "attention_bias": (
        False,
        "a bias on o_proj has no Megatron counterpart without biases on every linear layer",
    ),
    "mlp_bias": (False, "Megatron's MLP biases come with biases on every linear layer (add_bias_linear)"),
    "is_encoder_decoder": (False, "decoder-only models only"),
    "add_cross_attention": (False, "decoder-only models only"),
    "pruned_heads": ({}, "pruned attention heads have no Megatron counterpart"),
    "partial_rotary_factor": (1.0, "RoPE on the whole head only"),
    "decoder_sparse_step": (
        1,
        "every layer is a mixture of experts in thdpack's Qwen3-MoE (Megatron moe_layer_freq=1)",
    ),
    "mlp_only_layers": (
        [],
        "every layer is a mixture of experts in thdpack's Qwen3-MoE (Megatron moe_layer_freq=1)",
    ),
    "quantization_config": (None, "quantized checkpoints are not imported"),
    # nanotron's Llama configs (SmolLM2 on the Hub) say false; transformers' Llama never reads the key and rotates
    # the two halves of each head (rotate_half), as thdpack does
    "rope_interleaved": (
        False,
        "transformers' Llama rotates the two halves of each head (rotate_half) whatever this key says; true "
        "would mean the checkpoint was trained rotating interleaved pairs, which neither computes",
    ),
}


def decoder_config(
    r: ConfigReader, model_type: str, fixed: dict[str, tuple[Any, str]] = FIXED_VALUES
) -> dict[str, Any]:
    """The Megatron ``TransformerConfig`` settings of a Llama-like decoder (``model_type``: what
    ``config.json`` must say), its ``fixed`` values checked (:data:`FIXED_VALUES`, or a family's own)."""
    found = r.get("model_type")
    if found != model_type:
        architecture = (r.config.get("architectures") or ["?"])[0]
        raise r.error("model_type", f"is {found!r}: {architecture} has model_type '{model_type}'")
    heads = r.require("num_attention_heads")
    hidden = r.require("hidden_size")
    groups = r.get("num_key_value_heads") or heads
    if heads % groups:
        raise r.error("num_key_value_heads", f"is {groups}: it must divide num_attention_heads ({heads})")
    head_dim = r.get("head_dim") or hidden // heads
    if not r.config.get("head_dim") and hidden % heads:
        raise r.error(
            "hidden_size", f"is {hidden}: without head_dim it must be a multiple of num_attention_heads"
        )
    config = {
        "num_layers": r.require("num_hidden_layers"),
        "hidden_size": hidden,
        "ffn_hidden_size": r.require("intermediate_size"),
        "num_attention_heads": heads,
        "num_query_groups": groups,
        "kv_channels": head_dim,
        "normalization": "RMSNorm",
        "layernorm_epsilon": float(r.require("rms_norm_eps", float)),
        "gated_linear_unit": True,
        "activation_func": "silu",
        "add_bias_linear": False,
        "add_qkv_bias": False,
        "qk_layernorm": False,
        "hidden_dropout": 0.0,
        "attention_dropout": float(r.get("attention_dropout") or 0.0),
        "init_method_std": float(r.get("initializer_range") or 0.02),
    }
    for key, (value, rule) in fixed.items():
        given = r.get(key)
        if given is not None and given != value and not _same(given, value):
            raise r.error(key, f"is {given!r}: thdpack needs {value!r} ({rule})")
    return config


def _same(a: Any, b: Any) -> bool:
    if isinstance(b, float) and isinstance(a, (int, float)) and not isinstance(a, bool):
        return math.isclose(a, b)
    return a == b


def decoder_group(
    r: ConfigReader,
    name: str,
    config: dict[str, Any],
    tp: int,
    rotary: tuple[float, dict | None] | None = None,
) -> dict[str, Any]:
    """The recipe's model group of a Llama-like decoder with Megatron settings ``config``: RoPE (``rotary``, a
    family's own ``(theta, scaling)``, or :func:`rope`), the vocabulary (the checkpoint's, rounded up to a multiple
    of ``tp`` where ``tp`` does not divide it: the padded rows are never predicted, :mod:`thdpack.hf.load`), tied
    embeddings."""
    theta, scaling = rotary if rotary is not None else rope(r)
    tied = r.get("tie_word_embeddings", False)
    if not isinstance(tied, bool):
        raise r.error("tie_word_embeddings", f"is {tied!r}: true or false expected")
    vocab = r.require("vocab_size")
    return {
        "name": f"hf_{name}",
        "position_embedding_type": "rope",
        "rotary_base": theta,
        "rope_scaling": scaling,
        "vocab_size": -(-vocab // tp) * tp,
        "share_embeddings_and_output_weights": tied,
        "config": config,
    }


def rope(r: ConfigReader) -> tuple[float, dict | None]:
    """``(rope_theta, llama3 scaling or None)`` from ``rope_parameters`` (transformers 5) or ``rope_theta`` and
    ``rope_scaling`` (transformers 4); another scaling is refused (it would change every position's rotation)."""
    params = r.get("rope_parameters")
    key = "rope_parameters"
    if params is not None:
        # transformers 4's keys, where a file holds both forms: they must say the same
        legacy = dict(r.get("rope_scaling") or {})
        if r.get("rope_theta") is not None:
            legacy["rope_theta"] = r.config["rope_theta"]
        if isinstance(params, dict) and any(params.get(k, v) != v for k, v in legacy.items() if k != "type"):
            raise r.error(
                "rope_theta", f"and rope_scaling say {legacy!r} but rope_parameters says {params!r}"
            )
    else:
        key = "rope_scaling"
        params = dict(r.get("rope_scaling") or {})
        if r.get("rope_theta") is not None:
            params["rope_theta"] = r.require("rope_theta", float)
    if not isinstance(params, dict):
        raise r.error(key, f"is {params!r}: a JSON object expected")
    theta = params.get("rope_theta", 10000.0)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise r.error(key, f"has rope_theta {theta!r}: a positive number expected")
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    known = {"rope_theta", "rope_type", "type"}
    if rope_type == "default":
        extra = sorted(set(params) - known)
        if extra:
            raise r.error(
                key, f"has {extra} with rope_type 'default': thdpack does not know what they change"
            )
        return float(theta), None
    if rope_type != "llama3":
        raise r.error(
            key,
            f"has rope_type '{rope_type}': thdpack imports plain RoPE and Llama 3's 'llama3' scaling only "
            "(Megatron RotaryEmbedding); another scaling would change every position's rotation",
        )
    fields = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [f for f in fields if params.get(f) is None]
    if missing:
        raise r.error(key, f"has rope_type 'llama3' without {missing}")
    extra = sorted(set(params) - known - set(fields) - {"attention_factor"})
    if extra or params.get("attention_factor") not in (None, 1.0):
        raise r.error(
            key, f"has {extra or ['attention_factor']} with rope_type 'llama3': not part of Llama 3 scaling"
        )
    scaling = {f: float(params[f]) for f in fields}
    if not scaling["high_freq_factor"] > scaling["low_freq_factor"] > 0 or scaling["factor"] <= 0:
        raise r.error(
            key, f"has llama3 factors {scaling}: factor > 0 and high_freq_factor > low_freq_factor > 0"
        )
    return float(theta), scaling


def sliding_windows(r: ConfigReader, types: list[str], config: dict, default: int) -> None:
    """Per-layer sliding windows (``layer_types``: ``sliding_attention`` or ``full_attention``) into ``config``:
    megatron-core's ``window_size`` and ``window_attn_skip_freq``. transformers lets a query at ``q`` see keys
    ``k > q - w``: Megatron/TE's ``(left, right)`` is ``(w - 1, 0)``. ``default``: the architecture's window when
    the config names none."""
    window = r.get("sliding_window", default)
    if "sliding_attention" not in types:
        return
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise r.error("sliding_window", f"is {window!r}: the sliding layers need a positive window")
    config["window_size"] = [window - 1, 0]
    config["window_attn_skip_freq"] = [int(kind == "sliding_attention") for kind in types]


def window_within_rows(r: ConfigReader, seq_length: int) -> None:
    """A ``sliding_window`` that never bites (rows no longer than the window) is plain causal attention; one that
    would bite is refused: thdpack's THD attention is full causal attention per sample."""
    window = r.get("sliding_window")
    if window is None:
        return
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise r.error("sliding_window", f"is {window!r}: a positive integer or null expected")
    if window < seq_length:
        raise r.error(
            "sliding_window",
            f"is {window} but dataset.seq_length is {seq_length}: thdpack attends over whole samples, so a sample "
            f"longer than {window} tokens would see further back than the model was trained to; set "
            f"dataset.seq_length <= {window}",
        )


def model_group(r: ConfigReader, *, seq_length: int, tp: int) -> dict[str, Any]:
    """Llama's model group (:class:`~thdpack.models.family.ModelGroup`)."""
    config = decoder_config(r, "llama")
    group = decoder_group(r, "llama", config, tp)
    window_within_rows(r, seq_length)
    return group


FAMILY = decoder_family("llama", ("LlamaForCausalLM",), model_group, MAPPING)
