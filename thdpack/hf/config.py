"""The recipe's model group from a Hugging Face ``config.json``: plain JSON, never transformers' remote code.

    group = pretrained_model_group(recipe_model, seq_length=4096, tp=2)   # model=hf model.pretrained=DIR

Families: ``LlamaForCausalLM`` (Llama 2, Llama 3.x with ``llama3`` RoPE scaling), ``MistralForCausalLM``,
``Qwen2ForCausalLM`` (q/k/v biases), ``Qwen3ForCausalLM`` (q/k norms, ``head_dim`` free of hidden/heads) and
``Qwen3MoeForCausalLM`` (router, experts, ``norm_topk_prob``). Every key of ``config.json`` is either mapped to a
Megatron setting, checked against the one value thdpack computes, or known not to change what the model computes
from tokens (bookkeeping, generation defaults); any other key stops the start-up, naming the file, line and key.

Read with transformers 5.24.0 (CPU tests) and 5.17 (GPU host): their ``rope_parameters`` (rope_theta inside) and
the older ``rope_theta`` + ``rope_scaling`` are both understood.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "ARCHITECTURE_KEYS",
    "HF_FAMILY",
    "ARCHITECTURES",
    "HFConfigError",
    "model_group",
    "read_hf_config",
    "rope_settings",
]

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}

# Keys that do not change the logits of a token sequence: bookkeeping, special-token ids, generation defaults,
# the dtype the file was stored in (the run's precision decides the compute dtype), transformers-only switches.
# fmt: off
INERT_KEYS = frozenset({
    "_name_or_path", "transformers_version", "dtype", "torch_dtype", "use_cache", "bos_token_id",
    "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id", "id2label", "label2id",
    "problem_type", "output_attentions", "output_hidden_states", "return_dict", "tokenizer_class",
    "prefix", "task_specific_params", "finetuning_task", "torchscript", "use_bfloat16", "tf_legacy_loss",
    "tie_encoder_decoder", "chunk_size_feed_forward", "max_position_embeddings", "pretraining_tp",
    "output_router_logits", "max_length", "min_length", "do_sample", "early_stopping", "num_beams",
    "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p", "typical_p",
    "repetition_penalty", "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
    "bad_words_ids", "num_return_sequences", "output_scores", "return_dict_in_generate",
    "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
    "cross_attention_hidden_size", "is_decoder",
})
# fmt: on
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
}
# Model-group config keys that config.json fixes (the weights' shapes and the math); a recipe may not change them.
# fmt: off
ARCHITECTURE_KEYS = frozenset({
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
    "kv_channels", "normalization", "layernorm_epsilon", "gated_linear_unit", "activation_func",
    "add_bias_linear", "add_qkv_bias", "qk_layernorm", "num_moe_experts", "moe_router_topk",
    "moe_ffn_hidden_size", "moe_router_pre_softmax", "moe_router_score_function", "moe_layer_freq",
})
# fmt: on
# The model family (thdpack.megatron.families) that builds a pretrained model and loads its weights.
HF_FAMILY = "thdpack.hf.family:HF"
TOP_LEVEL_KEYS = (
    "position_embedding_type",
    "rotary_base",
    "vocab_size",
    "share_embeddings_and_output_weights",
)


class HFConfigError(ValueError):
    """A ``config.json`` thdpack cannot import exactly; the message names the file, line, key and rule."""


def read_hf_config(directory: str | Path) -> dict[str, Any]:
    """``DIR/config.json`` as a dict (with ``_path`` and ``_text`` for error messages)."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise HFConfigError(
            f"model.pretrained={directory}: no config.json there (a Hugging Face model directory)"
        )
    text = path.read_text()
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise HFConfigError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from e
    if not isinstance(config, dict):
        raise HFConfigError(f"{path}: a JSON object expected, found {type(config).__name__}")
    return {**config, "_path": str(path), "_text": text}


class _Reader:
    """Reads keys of one config.json and remembers which were used, for the unknown-key check."""

    def __init__(self, config: Mapping[str, Any]):
        self.config, self.used = config, {"_path", "_text"}
        self.path, self.text = config.get("_path", "config.json"), config.get("_text", "")

    def where(self, key: str) -> str:
        needle = f'"{key}"'
        for number, line in enumerate(self.text.splitlines(), start=1):
            if needle in line:
                return f"{self.path}:{number}"
        return self.path

    def error(self, key: str, message: str) -> HFConfigError:
        return HFConfigError(f"{self.where(key)}: key '{key}' {message}")

    def get(self, key: str, default: Any = None) -> Any:
        self.used.add(key)
        return self.config.get(key, default)

    def require(self, key: str, kind: type = int) -> Any:
        self.used.add(key)
        if self.config.get(key) is None:
            raise HFConfigError(f"{self.path}: key '{key}' is missing: thdpack needs it to build the model")
        value = self.config[key]
        if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise self.error(key, f"is {value!r}: a positive integer expected")
        if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise self.error(key, f"is {value!r}: a number expected")
        return value


def model_group(hf: Mapping[str, Any], *, seq_length: int, tp: int = 1) -> dict[str, Any]:
    """The recipe's model group (Megatron ``TransformerConfig`` keys under ``config``) that computes what
    transformers computes with ``hf`` (a ``config.json`` from :func:`read_hf_config`), for rows of up to
    ``seq_length`` tokens under tensor parallelism ``tp``.

    The vocabulary is the checkpoint's, rounded up to a multiple of ``tp`` where ``tp`` does not divide it;
    the padded rows are never predicted (:mod:`thdpack.hf.load`).
    """
    r = _Reader(hf)
    architectures = r.get("architectures")
    if (
        not isinstance(architectures, list)
        or len(architectures) != 1
        or architectures[0] not in ARCHITECTURES
    ):
        raise r.error(
            "architectures",
            f"is {architectures!r}: thdpack imports exactly one of {sorted(ARCHITECTURES)}",
        )
    family = ARCHITECTURES[architectures[0]]
    model_type = r.get("model_type")
    if model_type != family:
        raise r.error("model_type", f"is {model_type!r}: {architectures[0]} has model_type '{family}'")

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
    vocab = r.require("vocab_size")
    config: dict[str, Any] = {
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
        "add_qkv_bias": family == "qwen2",  # Qwen2Attention: q/k/v with bias, o_proj without
        "qk_layernorm": family in ("qwen3", "qwen3_moe"),
        "hidden_dropout": 0.0,
        "attention_dropout": float(r.get("attention_dropout") or 0.0),
        "init_method_std": float(r.get("initializer_range") or 0.02),
    }
    for key, (value, rule) in FIXED_VALUES.items():
        if key in hf and hf[key] is not None and r.get(key) != value and not _same(hf[key], value):
            raise r.error(key, f"is {hf[key]!r}: thdpack needs {value!r} ({rule})")
        r.used.add(key)
    theta, scaling = _rope(r)
    _check_sliding_window(r, family, config["num_layers"], seq_length)
    if family == "qwen3_moe":
        config.update(_moe(r))
    tied = r.get("tie_word_embeddings", False)
    if not isinstance(tied, bool):
        raise r.error("tie_word_embeddings", f"is {tied!r}: true or false expected")

    unknown = sorted(set(hf) - r.used - INERT_KEYS)
    if unknown:
        raise r.error(
            unknown[0],
            f"is not known to thdpack's {architectures[0]} import ({len(unknown)} such keys: {unknown}): it may "
            "change what the model computes, so thdpack stops rather than ignore it",
        )
    return {
        "name": f"hf_{family}",
        "position_embedding_type": "rope",
        "rotary_base": theta,
        "rope_scaling": scaling,
        "vocab_size": -(-vocab // tp) * tp,
        "share_embeddings_and_output_weights": tied,
        "config": config,
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(b, float) and isinstance(a, (int, float)) and not isinstance(a, bool):
        return math.isclose(a, b)
    return a == b


def rope_settings(hf: Mapping[str, Any]) -> tuple[float, dict | None]:
    """``(rope_theta, Llama 3 scaling or None)`` of a ``config.json`` (see :func:`model_group`)."""
    return _rope(_Reader(hf))


def _rope(r: _Reader) -> tuple[float, dict | None]:
    """``(rope_theta, llama3 scaling or None)`` from ``rope_parameters`` (transformers 5) or ``rope_theta`` and
    ``rope_scaling`` (transformers 4)."""
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


def _check_sliding_window(r: _Reader, family: str, num_layers: int, seq_length: int) -> None:
    """A sliding window that never bites (rows no longer than the window) is plain causal attention; one that
    would bite is refused: thdpack's THD attention is full causal attention per sample."""
    window = r.get("sliding_window")
    if family in ("qwen2", "qwen3", "qwen3_moe"):
        types = r.get("layer_types")
        use, first = r.get("use_sliding_window", False), r.get("max_window_layers", num_layers)
        if types is None:
            sliding = bool(use) and any(i >= first for i in range(num_layers))
        else:
            bad = sorted(set(types) - {"full_attention", "sliding_attention"})
            if bad or len(types) != num_layers:
                raise r.error(
                    "layer_types", f"is {types!r}: one of full_attention/sliding_attention per layer"
                )
            sliding = "sliding_attention" in types
        if not sliding:
            return
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


def _moe(r: _Reader) -> dict[str, Any]:
    experts_key = "num_experts" if r.config.get("num_experts") is not None else "num_local_experts"
    experts = r.require(experts_key)
    r.used.update({"num_experts", "num_local_experts"})
    topk = r.require("num_experts_per_tok")
    if topk > experts:
        raise r.error("num_experts_per_tok", f"is {topk}: more than the {experts} experts")
    norm = r.get("norm_topk_prob", False)
    if not isinstance(norm, bool):
        raise r.error("norm_topk_prob", f"is {norm!r}: true or false expected")
    return {
        "num_moe_experts": experts,
        "moe_router_topk": topk,
        "moe_ffn_hidden_size": r.require("moe_intermediate_size"),
        # transformers: softmax over all experts, top-k, renormalised when norm_topk_prob. Megatron: pre-softmax
        # = softmax, then top-k (not renormalised); else top-k of the logits, then softmax over those k, which
        # is the renormalised top-k of the full softmax.
        "moe_router_pre_softmax": not norm,
        "moe_router_score_function": "softmax",
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": float(r.get("router_aux_loss_coef") or 0.0),
        "moe_router_dtype": "fp32",  # transformers' router softmax runs in fp32
        "moe_token_dispatcher_type": "alltoall",  # packed rows differ in length from rank to rank
    }
