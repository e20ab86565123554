"""The model-FLOPs count used for TFLOP/s and for the ideal speedup of packing over padding.

Training FLOPs = 3 x forward (backward is twice the forward). Forward, per token: 2 x the parameters of every
GEMM it passes through (attention projections, the MLP or the ``top-k`` experts it is routed to, the router, the
output layer); per sample of ``L`` tokens and per layer, causal attention costs ``2 * heads * head_dim * L**2``
(``QK^T`` and ``AV``, ``2 * L**2 * heads * head_dim`` each, halved by causality). So a step costs
``3 * (2 * tokens * gemm_params + 2 * layers * heads * head_dim * sum(L**2))``: linear in tokens, quadratic in each
sample's length. Counted on real tokens only, it is the work the model must do whatever the batching.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["FlopsModel"]


@dataclass(frozen=True)
class FlopsModel:
    """``gemm_params``: GEMM parameters a token passes through; ``attn_coeff``: forward attention FLOPs per
    ``L**2`` over all layers (``2 * layers * heads * head_dim``)."""

    gemm_params: float
    attn_coeff: float

    @classmethod
    def of(cls, config, vocab_size: int) -> FlopsModel:
        """From a Megatron ``TransformerConfig`` (or anything with its attribute names)."""
        h = config.hidden_size
        heads = config.num_attention_heads
        groups = config.num_query_groups or heads
        head_dim = config.kv_channels or h // heads
        attention = h * head_dim * (heads + 2 * groups) + heads * head_dim * h
        mlp_width = 3 if config.gated_linear_unit else 2
        experts = getattr(config, "num_moe_experts", None)
        if experts:
            ffn = config.moe_ffn_hidden_size or config.ffn_hidden_size
            mlp = config.moe_router_topk * mlp_width * h * ffn + h * experts
            shared = getattr(config, "moe_shared_expert_intermediate_size", None)
            if shared:
                mlp += mlp_width * h * shared
        else:
            mlp = mlp_width * h * config.ffn_hidden_size
        gemm = config.num_layers * (attention + mlp) + h * vocab_size
        return cls(gemm_params=float(gemm), attn_coeff=float(2 * config.num_layers * heads * head_dim))

    def training_flops(self, lengths) -> float:
        """Training FLOPs of samples of these lengths (each attends causally to itself only)."""
        lengths = np.asarray(lengths, dtype=np.float64)
        return 3.0 * (2.0 * lengths.sum() * self.gemm_params + self.attn_coeff * np.square(lengths).sum())

    def padded_training_flops(self, rows: int, row_length: int) -> float:
        """Training FLOPs of ``rows`` padded rows of ``row_length`` tokens each (what the padded run computes)."""
        return self.training_flops(np.full(rows, row_length))
