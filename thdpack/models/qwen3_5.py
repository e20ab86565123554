"""Qwen3.5 (``Qwen3_5ForCausalLM``, the text model): a hybrid decoder whose layers are gated DeltaNet linear
attention or gated full attention (``layer_types``), as Megatron-core's ``GPTModel`` with thdpack's packed DeltaNet
layer (:mod:`thdpack.megatron.hybrid_model`).

What differs from Qwen3 (transformers 5.24's ``modeling_qwen3_5.py``):

- ``linear_attention`` layers: gated DeltaNet (:mod:`thdpack.megatron.gated_delta_net`): its recurrent state
  restarts at every sample of a packed row and its short convolution never reaches the previous sample;
- ``full_attention`` layers: ``q_proj`` also gives a per-head output gate (``attn * sigmoid(gate)`` before
  ``o_proj``: Megatron's ``attention_output_gate``), RMSNorm on each head's queries and keys, RoPE on the first
  ``partial_rotary_factor`` of each head (Megatron's ``rotary_percent``);
- every RMSNorm but the DeltaNet's output norm multiplies by ``1 + weight`` (Megatron's
  ``layernorm_zero_centered_gamma``);
- ``rope_parameters`` may carry MRoPE's ``mrope_section`` / ``mrope_interleaved``: with text only, the three
  position rows transformers builds are equal, which makes it plain RoPE.

Checkpoints of the multimodal ``Qwen3_5ForConditionalGeneration`` (the Hub's Qwen3.5 releases) are not imported:
transformers' ``Qwen3_5ForCausalLM.from_pretrained(DIR).save_pretrained(TEXT_DIR)`` writes their language model as
this architecture (README). Not supported: context parallelism (the recurrence runs over whole samples: refused at
start-up).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from thdpack.hf.config_keys import ConfigReader
from thdpack.hf.delta_net_kinds import CONV, GATED_QKV, IN_PROJ, VALUE_HEADS
from thdpack.hf.mapping import HF_LAYER, LAYER, REPLICATED, ROW, Rule
from thdpack.megatron.step import gpt_forward

from . import llama, qwen3
from .decoder import MODEL_KEYS as DECODER_KEYS
from .family import ModelFamily, ModelGroup

__all__ = [
    "FAMILY",
    "FULL_ATTENTION",
    "LINEAR_ATTENTION",
    "MAPPING",
    "hybrid_config",
    "hybrid_family",
    "hybrid_group",
    "model_group",
]

log = logging.getLogger("thdpack")

_LINEAR = HF_LAYER + "linear_attn."
LINEAR_ATTENTION = (
    Rule(
        (LAYER + "self_attention.in_proj.weight",),
        tuple(_LINEAR + f"in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")),
        IN_PROJ,
        layer_type="linear_attention",
    ),
    Rule(
        (LAYER + "self_attention.conv1d.weight",),
        (_LINEAR + "conv1d.weight",),
        CONV,
        layer_type="linear_attention",
    ),
    Rule((LAYER + "self_attention.A_log",), (_LINEAR + "A_log",), VALUE_HEADS, layer_type="linear_attention"),
    Rule(
        (LAYER + "self_attention.dt_bias",),
        (_LINEAR + "dt_bias",),
        VALUE_HEADS,
        layer_type="linear_attention",
    ),
    Rule(
        (LAYER + "self_attention.out_norm.weight",),
        (_LINEAR + "norm.weight",),
        REPLICATED,
        layer_type="linear_attention",
    ),
    Rule(
        (LAYER + "self_attention.out_proj.weight",),
        (_LINEAR + "out_proj.weight",),
        ROW,
        layer_type="linear_attention",
    ),
)
FULL_ATTENTION = (
    Rule(
        (LAYER + "self_attention.linear_qkv.weight",),
        tuple(HF_LAYER + f"self_attn.{p}_proj.weight" for p in "qkv"),
        GATED_QKV,
        layer_type="full_attention",
    ),
    Rule(
        (LAYER + "self_attention.linear_proj.weight",),
        (HF_LAYER + "self_attn.o_proj.weight",),
        ROW,
        layer_type="full_attention",
    ),
    *(Rule(r.megatron, r.hf, r.kind, layer_type="full_attention") for r in qwen3.QK_NORMS),
)
INPUT_NORM = llama.ATTENTION[:1]  # every layer's, whichever its mixer
MAPPING = llama.EMBEDDINGS + INPUT_NORM + LINEAR_ATTENTION + FULL_ATTENTION + llama.MLP_NORM + llama.DENSE_MLP

LAYER_TYPES = ("linear_attention", "full_attention")
# keys of transformers' Qwen3.5 text configs that the forward pass never reads
_UNREAD = {
    "mtp_num_hidden_layers": "the multi-token-prediction head of the released checkpoints, which "
    "Qwen3_5ForCausalLM neither builds nor loads",
    "mtp_use_dedicated_embeddings": "a setting of that multi-token-prediction head",
}


def hybrid_config(r: ConfigReader, model_type: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(Megatron TransformerConfig settings, model-group settings)`` of a Qwen3.5 text ``config.json``
    (``model_type``: what it must say): the layers, both attentions, RoPE."""
    found = r.get("model_type")
    if found != model_type:
        architecture = (r.config.get("architectures") or ["?"])[0]
        raise r.error("model_type", f"is {found!r}: {architecture} has model_type '{model_type}'")
    for key, (value, rule) in {
        "hidden_act": ("silu", "the MLPs' SiLU gate and the DeltaNet's convolution activation"),
        "attention_bias": (
            False,
            "q/k/v/o biases have no Megatron counterpart without biases on every layer",
        ),
        # the released configs say true; transformers never reads it and gates every full-attention layer
        "attn_output_gate": (True, "transformers' Qwen3.5 gates the output of every full-attention layer"),
        "is_encoder_decoder": (False, "decoder-only models only"),
        "quantization_config": (None, "quantized checkpoints are not imported"),
    }.items():
        given = r.get(key)
        if given is not None and given != value:
            raise r.error(key, f"is {given!r}: thdpack needs {value!r} ({rule})")
    for key in _UNREAD:
        r.get(key)
    layers = r.require("num_hidden_layers")
    heads = r.require("num_attention_heads")
    groups = r.get("num_key_value_heads") or heads
    if heads % groups:
        raise r.error("num_key_value_heads", f"is {groups}: it must divide num_attention_heads ({heads})")
    hidden = r.require("hidden_size")
    head_dim = r.get("head_dim") or hidden // heads
    types = _layer_types(r, layers)
    key_heads, value_heads = r.require("linear_num_key_heads"), r.require("linear_num_value_heads")
    if value_heads % key_heads:
        raise r.error(
            "linear_num_value_heads",
            f"is {value_heads}: it must be a multiple of linear_num_key_heads ({key_heads})",
        )
    theta, partial = _rope(r, head_dim)
    config = {
        "num_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_query_groups": groups,
        "kv_channels": head_dim,
        "normalization": "RMSNorm",
        "layernorm_epsilon": float(r.require("rms_norm_eps", float)),
        "layernorm_zero_centered_gamma": True,
        "gated_linear_unit": True,
        "activation_func": "silu",
        "add_bias_linear": False,
        "add_qkv_bias": False,
        "qk_layernorm": True,
        "attention_output_gate": True,
        "hidden_dropout": 0.0,
        "attention_dropout": float(r.get("attention_dropout") or 0.0),
        "init_method_std": float(r.get("initializer_range") or 0.02),
        "experimental_attention_variant": "gated_delta_net",
        "linear_attention_freq": [int(t == "linear_attention") for t in types],
        "linear_conv_kernel_dim": r.require("linear_conv_kernel_dim"),
        "linear_key_head_dim": r.require("linear_key_head_dim"),
        "linear_value_head_dim": r.require("linear_value_head_dim"),
        "linear_num_key_heads": key_heads,
        "linear_num_value_heads": value_heads,
    }
    tied = r.get("tie_word_embeddings", False)
    if not isinstance(tied, bool):
        raise r.error("tie_word_embeddings", f"is {tied!r}: true or false expected")
    group = {
        "position_embedding_type": "rope",
        "rotary_base": theta,
        "rotary_percent": partial,
        "rope_scaling": None,
        "share_embeddings_and_output_weights": tied,
    }
    return config, group


def _layer_types(r: ConfigReader, layers: int) -> list[str]:
    """``layer_types``, or transformers' default from ``full_attention_interval`` (every 4th layer full)."""
    interval = r.get("full_attention_interval")
    types = r.get("layer_types")
    if types is None:
        interval = interval or 4
        return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or set(types) - set(LAYER_TYPES):
        raise r.error(
            "layer_types", f"is {types!r}: one of {list(LAYER_TYPES)} for each of the {layers} layers"
        )
    return types


def _rope(r: ConfigReader, head_dim: int) -> tuple[float, float]:
    """``(rope_theta, partial_rotary_factor)`` from ``rope_parameters`` (or transformers 4's top-level keys).

    transformers' rule: a value in ``rope_parameters`` wins; the top-level ``partial_rotary_factor`` (which some
    transformers 5 releases also write) fills it in where it is missing, and Qwen3.5's default is 0.25."""
    params = r.get("rope_parameters")
    top = r.get("partial_rotary_factor")
    key = "rope_parameters"
    if params is None:
        key = "rope_theta"
        params = {"rope_theta": r.get("rope_theta", 10000.0)}
    if not isinstance(params, dict):
        raise r.error(key, f"is {params!r}: a JSON object expected")
    partial, partial_key = params.get("partial_rotary_factor"), key
    if partial is None:
        partial, partial_key = (0.25, key) if top is None else (top, "partial_rotary_factor")
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type != "default":
        raise r.error(
            key,
            f"has rope_type '{rope_type}': thdpack imports Qwen3.5 with plain RoPE only (another scaling would change "
            "every position's rotation)",
        )
    extra = sorted(set(params) - {"rope_theta", "rope_type", "type", "partial_rotary_factor"} - _MROPE)
    if extra:
        raise r.error(key, f"has {extra}: thdpack does not know what they change")
    theta = params.get("rope_theta", 10000.0)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise r.error(key, f"has rope_theta {theta!r}: a positive number expected")
    number = isinstance(partial, (int, float)) and not isinstance(partial, bool)
    if not number or not 0 < partial <= 1 or int(head_dim * partial) % 2:
        raise r.error(
            partial_key,
            f"has partial_rotary_factor {partial!r}: thdpack rotates an even number of each head's {head_dim} "
            "dimensions (0 < factor <= 1)",
        )
    return float(theta), float(partial)


# MRoPE's keys: with text only, transformers' three position rows are equal, so any section layout is plain RoPE
_MROPE = {"mrope_section", "mrope_interleaved"}


def model_group(r: ConfigReader, *, seq_length: int, tp: int) -> dict[str, Any]:
    """Qwen3.5's model group (:class:`~thdpack.models.family.ModelGroup`)."""
    config, group = hybrid_config(r, "qwen3_5_text")
    config["ffn_hidden_size"] = r.require("intermediate_size")
    return hybrid_group(r, "qwen3_5", config, group, tp)


def hybrid_group(r: ConfigReader, name: str, config: dict, group: dict, tp: int) -> dict[str, Any]:
    if config["linear_num_key_heads"] % tp:
        raise r.error(
            "linear_num_key_heads",
            f"is {config['linear_num_key_heads']}: tensor parallelism ({tp} ranks) splits the gated DeltaNet "
            "layers by key heads, so it must divide them",
        )
    vocab = r.require("vocab_size")
    return {**group, "name": f"hf_{name}", "vocab_size": -(-vocab // tp) * tp, "config": config}


def check(cfg: Mapping) -> None:
    """Start-up rules of a Qwen3.5 recipe: no context parallelism (the DeltaNet recurrence runs over each whole
    sample, which CP would split over ranks: thdpack passes no state between them)."""
    cp = int(cfg["parallel"]["context_parallel_size"])
    if cp > 1:
        raise ValueError(
            f"parallel.context_parallel_size={cp}: Qwen3.5's gated DeltaNet layers run one recurrence over each "
            "whole sample, and context parallelism would split every sample over ranks (thdpack passes no "
            "recurrent state between them); use context_parallel_size=1 (tensor, pipeline, expert and data "
            "parallelism work)"
        )


MODEL_KEYS = (*DECODER_KEYS, "rotary_percent")


def hybrid_family(
    name: str, architectures: tuple[str, ...], group: ModelGroup, mapping: tuple[Rule, ...]
) -> ModelFamily:
    """The family of a Qwen3.5 text checkpoint (dense or MoE): built by :func:`thdpack.megatron.hybrid_model.
    build_hybrid_model`, its weights loaded before the loop wraps it (:func:`thdpack.models.decoder.load_pretrained`)."""

    def build(model: Mapping, config, vocab_size: int, max_sequence_length: int, runtime):
        from thdpack.hf.mapping import layer_types
        from thdpack.hf.vl_checkpoint import LanguageModelReader
        from thdpack.megatron.hybrid_model import build_hybrid_model
        from thdpack.megatron.output_loss import resolve_output_loss, use_output_loss

        from .decoder import load_pretrained

        if not model.get("freeze_vision", True):
            raise ValueError(
                f"model.freeze_vision=false trains a vision tower, but {model['pretrained']} is a text checkpoint "
                "(no vision tower): leave model.freeze_vision at true"
            )
        # a list, as Megatron tests it (the recipe hands OmegaConf's ListConfig): its checkpoints then keep each
        # layer under its own name (TransformerBlock.sharded_state_dict, non-homogeneous layers)
        config.linear_attention_freq = [int(f) for f in config.linear_attention_freq]
        module = build_hybrid_model(
            config,
            layer_types(config),
            vocab_size,
            max_sequence_length,
            backend=runtime.backend,
            te_op_fuser=model.get("te_op_fuser") is True,
            rotary_percent=float(model["rotary_percent"]),
            rotary_base=int(model["rotary_base"]),
            share_embeddings_and_output_weights=bool(model["share_embeddings_and_output_weights"]),
        )
        use_output_loss(module, resolve_output_loss(model, runtime.device))
        # transformers writes either model.layers.* or, for a language model taken out of the multimodal
        # checkpoints (Qwen3_5ForCausalLM.from_pretrained(VL_DIR)), model.language_model.layers.*
        loaded = load_pretrained(module, mapping, model, tensors=LanguageModelReader)
        log.info("loaded %d tensors of %s into this rank's model", loaded, model["pretrained"])
        return module

    def export(iteration_dir: Path, kept):
        from thdpack.hf.checkpoint_hf import checkpoint_hf_tensors

        return checkpoint_hf_tensors(iteration_dir, kept.directory, mapping, int(kept.config["vocab_size"]))

    return ModelFamily(
        name=name,
        build=build,
        forward=gpt_forward,
        model_keys=MODEL_KEYS,
        check=check,
        architectures=architectures,
        model_group=group,
        mapping=mapping,
        export=export,
    )


FAMILY = hybrid_family("qwen3_5", ("Qwen3_5ForCausalLM",), model_group, MAPPING)
