"""Qwen3 (``Qwen3ForCausalLM``): Llama's decoder with an RMSNorm on each head's queries and keys (``q_norm``,
``k_norm``), no q/k/v bias, and a ``head_dim`` free of hidden / heads; Qwen2's sliding-window keys."""

from __future__ import annotations

from thdpack.hf.config_keys import ConfigReader
from thdpack.hf.mapping import HF_LAYER, LAYER, REPLICATED, Rule

from . import llama, qwen2
from .decoder import decoder_family

__all__ = ["FAMILY", "MAPPING", "QK_NORMS", "model_group"]

QK_NORMS = (
    Rule((LAYER + "self_attention.q_layernorm.weight",), (HF_LAYER + "self_attn.q_norm.weight",), REPLICATED),
    Rule((LAYER + "self_attention.k_layernorm.weight",), (HF_LAYER + "self_attn.k_norm.weight",), REPLICATED),
)
MAPPING = llama.MAPPING + QK_NORMS


def model_group(r: ConfigReader, *, seq_length: int, tp: int) -> dict:
    """Qwen3's model group (:class:`~thdpack.models.family.ModelGroup`)."""
    config = {**llama.decoder_config(r, "qwen3"), "qk_layernorm": True}
    group = llama.decoder_group(r, "qwen3", config, tp)
    qwen2.window_within_rows(r, config["num_layers"], seq_length)
    return group


FAMILY = decoder_family("qwen3", ("Qwen3ForCausalLM",), model_group, MAPPING)
