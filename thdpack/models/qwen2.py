"""Qwen2 and Qwen2.5 (``Qwen2ForCausalLM``): Llama's decoder with biases on q, k and v (o_proj without), and Qwen's
per-layer sliding-window keys (:func:`window_within_rows`, which Qwen3 and Qwen3-MoE share)."""

from __future__ import annotations

from thdpack.hf.config_keys import ConfigReader
from thdpack.hf.mapping import HF_LAYER, LAYER, QKV, Rule

from . import llama
from .decoder import decoder_family

__all__ = ["FAMILY", "MAPPING", "QKV_BIAS", "model_group", "window_within_rows"]

QKV_BIAS = (
    Rule(
        (LAYER + "self_attention.linear_qkv.bias",),
        tuple(HF_LAYER + f"self_attn.{p}_proj.bias" for p in "qkv"),
        QKV,
    ),
)
MAPPING = llama.MAPPING + QKV_BIAS


def window_within_rows(r: ConfigReader, num_layers: int, seq_length: int) -> None:
    """Qwen's sliding window bites only in the layers that use it (``layer_types``, or ``use_sliding_window`` from
    layer ``max_window_layers`` on); where some do, :func:`thdpack.models.llama.window_within_rows` decides."""
    types = r.get("layer_types")
    use, first = r.get("use_sliding_window", False), r.get("max_window_layers", num_layers)
    if types is None:
        sliding = bool(use) and any(i >= first for i in range(num_layers))
    else:
        bad = sorted(set(types) - {"full_attention", "sliding_attention"})
        if bad or len(types) != num_layers:
            raise r.error("layer_types", f"is {types!r}: one of full_attention/sliding_attention per layer")
        sliding = "sliding_attention" in types
    if sliding:
        llama.window_within_rows(r, seq_length)
    r.get("sliding_window")  # read either way: a window no layer uses changes nothing


def model_group(r: ConfigReader, *, seq_length: int, tp: int) -> dict:
    """Qwen2's model group (:class:`~thdpack.models.family.ModelGroup`)."""
    config = {**llama.decoder_config(r, "qwen2"), "add_qkv_bias": True}
    group = llama.decoder_group(r, "qwen2", config, tp)
    window_within_rows(r, config["num_layers"], seq_length)
    return group


FAMILY = decoder_family("qwen2", ("Qwen2ForCausalLM",), model_group, MAPPING)
