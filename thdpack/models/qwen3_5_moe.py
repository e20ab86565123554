"""Qwen3.5-MoE (``Qwen3_5MoeForCausalLM``, the text model): Qwen3.5's hybrid layers (:mod:`thdpack.models.qwen3_5`)
with a mixture of experts in every layer: a softmax router over all experts whose top-k probabilities are always
renormalised (transformers' ``Qwen3_5MoeTopKRouter`` has no ``norm_topk_prob``), SwiGLU experts, and a shared
expert scaled by ``sigmoid(shared_expert_gate(x))`` (Megatron's ``moe_shared_expert_gate``)."""

from __future__ import annotations

from typing import Any

from thdpack.hf.config_keys import ConfigReader
from thdpack.hf.mapping import GATED, HF_LAYER, LAYER, REPLICATED, ROW, Rule

from . import llama, qwen3_5, qwen3_moe

__all__ = ["FAMILY", "MAPPING", "SHARED_EXPERT", "model_group"]

SHARED_EXPERT = (
    Rule(
        (LAYER + "mlp.shared_experts.linear_fc1.weight",),
        (HF_LAYER + "mlp.shared_expert.gate_proj.weight", HF_LAYER + "mlp.shared_expert.up_proj.weight"),
        GATED,
    ),
    Rule(
        (LAYER + "mlp.shared_experts.linear_fc2.weight",),
        (HF_LAYER + "mlp.shared_expert.down_proj.weight",),
        ROW,
    ),
    Rule(
        (LAYER + "mlp.shared_experts.gate_weight",), (HF_LAYER + "mlp.shared_expert_gate.weight",), REPLICATED
    ),
)
MAPPING = (
    llama.EMBEDDINGS
    + qwen3_5.INPUT_NORM
    + qwen3_5.LINEAR_ATTENTION
    + qwen3_5.FULL_ATTENTION
    + llama.MLP_NORM
    + qwen3_moe.EXPERTS
    + SHARED_EXPERT
)


def moe_config(r: ConfigReader) -> dict[str, Any]:
    """The Megatron MoE settings of a Qwen3.5-MoE ``config.json``."""
    experts = r.require("num_experts")
    topk = r.require("num_experts_per_tok")
    if topk > experts:
        raise r.error("num_experts_per_tok", f"is {topk}: more than the {experts} experts")
    if r.get("norm_topk_prob", True) is not True:
        raise r.error(
            "norm_topk_prob",
            f"is {r.config['norm_topk_prob']!r}: transformers' Qwen3.5-MoE router always renormalises the top-k "
            "probabilities (it never reads this key); thdpack computes that",
        )
    # Qwen3.5-MoE has no dense MLP (every layer is a mixture of experts): transformers never reads it
    r.get("intermediate_size")
    for key, value in (("decoder_sparse_step", 1), ("mlp_only_layers", [])):
        if r.get(key, value) != value:
            raise r.error(
                key,
                f"is {r.config[key]!r}: transformers' Qwen3.5-MoE has experts in every layer (it never reads this "
                f"key); thdpack computes that ({value!r})",
            )
    width = r.require("moe_intermediate_size")
    return {
        "ffn_hidden_size": width,  # TransformerConfig wants one; no dense layer uses it
        "num_moe_experts": experts,
        "moe_router_topk": topk,
        "moe_ffn_hidden_size": width,
        "moe_shared_expert_intermediate_size": r.require("shared_expert_intermediate_size"),
        "moe_shared_expert_gate": True,
        # transformers: softmax over all experts (fp32), top-k, renormalised. Megatron without pre-softmax: top-k of
        # the logits, then a softmax over those k, which is the renormalised top-k of the full softmax.
        "moe_router_pre_softmax": False,
        "moe_router_score_function": "softmax",
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": float(r.get("router_aux_loss_coef") or 0.0),
        "moe_router_dtype": "fp32",
        "moe_token_dispatcher_type": "alltoall",  # packed rows differ in length from rank to rank
    }


def model_group(r: ConfigReader, *, seq_length: int, tp: int) -> dict[str, Any]:
    """Qwen3.5-MoE's model group (:class:`~thdpack.models.family.ModelGroup`)."""
    config, group = qwen3_5.hybrid_config(r, "qwen3_5_moe_text")
    config.update(moe_config(r))
    return qwen3_5.hybrid_group(r, "qwen3_5_moe", config, group, tp)


FAMILY = qwen3_5.hybrid_family("qwen3_5_moe", ("Qwen3_5MoeForCausalLM",), model_group, MAPPING)
