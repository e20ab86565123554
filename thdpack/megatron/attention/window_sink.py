"""Sliding windows and attention sinks: the two departures from plain causal softmax attention that Gemma 3 and
gpt-oss make, as thdpack's torch attention computes them (the THD rows of one sample, or a padded batch).

- A sliding window is Megatron's and Transformer Engine's ``window_size=(left, 0)``: a query at position ``i``
  sees the keys ``j`` with ``i - left <= j <= i``. transformers' ``sliding_window=w`` keeps ``kv_idx > q_idx - w``
  (``masking_utils.sliding_window_overlay``), which is ``left = w - 1``. On packed rows the positions are within a
  sample, so a window never reaches into the previous sample.
- An attention sink is gpt-oss's learned logit per head (``self_attn.sinks``; Megatron's and TE's
  ``softmax_type="learnable"``, parameter ``softmax_offset``): one more column in every softmax row that attends
  to nothing, ``probs = softmax([scores, sink])[..., :-1]`` (transformers' ``eager_attention_forward`` of
  gpt-oss). No SDPA kernel takes it, so :func:`sdpa_with_sinks` computes the scores explicitly, softmax in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["causal_window_mask", "sdpa_with_sinks"]


def causal_window_mask(q_pos: Tensor, k_pos: Tensor, window: int | None) -> Tensor:
    """Bool ``[Lq, Lk]``, True where the query at position ``q_pos[i]`` sees the key at ``k_pos[j]``: causal
    (``k <= q``) and, with ``window`` (Megatron's left window size), ``q - k <= window``."""
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed = allowed & (q_pos[:, None] - k_pos[None, :] <= window)
    return allowed


def sdpa_with_sinks(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    allowed: Tensor,
    sinks: Tensor,
    scale: float,
    dropout_p: float = 0.0,
) -> Tensor:
    """Softmax attention with one sink logit per head, in ``F.scaled_dot_product_attention``'s layout.

    Args:
        query: ``[..., H, Lq, D]``; key, value: ``[..., H, Lk, D]`` (heads already expanded for GQA).
        allowed: bool, broadcastable to ``[..., H, Lq, Lk]``: True where a query sees a key.
        sinks: ``[H]``: each head's sink logit, compared with the scaled scores.
        scale: the scores' scale (``1/sqrt(D)`` or the model's own).

    Returns:
        ``[..., H, Lq, D]`` in ``value``'s dtype (scores and softmax in fp32, or fp64 for fp64 inputs). A query that sees no key gives zeros (its whole probability goes
        to the sink), never NaN.
    """
    wide = torch.promote_types(query.dtype, torch.float32)  # fp32 at least, as transformers' fp32 softmax
    scores = torch.matmul(query.to(wide), key.to(wide).transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    sink = sinks.to(wide).reshape(-1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    if dropout_p:
        probs = F.dropout(probs, p=dropout_p)
    return torch.matmul(probs.to(value.dtype), value)
