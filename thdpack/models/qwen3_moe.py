"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention with a mixture of experts in every layer: a router
(``mlp.gate``) and per-expert SwiGLU MLPs, ``norm_topk_prob`` deciding whether the top-k probabilities are
renormalised. Megatron: alltoall dispatcher, fp32 router, ``moe_layer_freq`` 1 (dense layers in between are
refused: :data:`thdpack.models.llama.FIXED_VALUES`)."""

from __future__ import annotations

from typing import Any

from thdpack.hf.config_keys import ConfigReader
from thdpack.hf.mapping import GATED, HF_EXPERT, HF_LAYER, LAYER, REPLICATED, ROW, Rule

from . import llama, qwen2, qwen3
from .decoder import decoder_family

__all__ = ["EXPERTS", "FAMILY", "MAPPING", "model_group", "moe_config"]

EXPERTS = (
    Rule((LAYER + "mlp.router.weight",), (HF_LAYER + "mlp.gate.weight",), REPLICATED),
    Rule(
        (
            LAYER + "mlp.experts.local_experts.{expert}.linear_fc1.weight",
            LAYER + "mlp.experts.linear_fc1.weight{expert}",
        ),
        (HF_EXPERT + "gate_proj.weight", HF_EXPERT + "up_proj.weight"),
        GATED,
    ),
    Rule(
        (
            LAYER + "mlp.experts.local_experts.{expert}.linear_fc2.weight",
            LAYER + "mlp.experts.linear_fc2.weight{expert}",
        ),
        (HF_EXPERT + "down_proj.weight",),
        ROW,
    ),
)
MAPPING = llama.EMBEDDINGS + llama.ATTENTION + qwen3.QK_NORMS + llama.MLP_NORM + EXPERTS


def moe_config(r: ConfigReader) -> dict[str, Any]:
    """The Megatron MoE settings of a Qwen3-MoE ``config.json``."""
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


def model_group(r: ConfigReader, *, seq_length: int, tp: int) -> dict:
    """Qwen3-MoE's model group (:class:`~thdpack.models.family.ModelGroup`)."""
    config = {**llama.decoder_config(r, "qwen3_moe"), "qk_layernorm": True}
    group = llama.decoder_group(r, "qwen3_moe", config, tp)
    qwen2.window_within_rows(r, config["num_layers"], seq_length)
    config.update(moe_config(r))
    return group


FAMILY = decoder_family("qwen3_moe", ("Qwen3MoeForCausalLM",), model_group, MAPPING)
