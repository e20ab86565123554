"""Position ids of a packed row: restarted at every sample, so RoPE/MRoPE see each sample as if alone."""

from __future__ import annotations

import torch

__all__ = ["pack_mrope_position_ids"]


def pack_mrope_position_ids(
    mrope_position_ids: torch.Tensor,
    gather_index: torch.Tensor,
    padding_mask: torch.Tensor,
    position_ids: torch.Tensor,
) -> torch.Tensor:
    """Gather Qwen-VL style ``(temporal, height, width)`` ids sample by sample into the packed row.

    The ids a processor computes for a padded batch already restart at every sample (text tokens count up,
    image tokens share a temporal id and spread over height and width), so gathering each sample's ids keeps
    them exact; nothing is recomputed across samples.

    Args:
        mrope_position_ids: int64 ``[3, B, S]``.
        gather_index: int64 ``[T]`` flat ``B * S`` source index of every packed position (any value on pad).
        padding_mask: bool ``[T]``, True on pad.
        position_ids: int64 ``[T]``, the packed 1-D position ids; alignment pad takes them on all three axes
            (pad is masked from loss and router, and under causal attention no real token sees it).

    Returns:
        int64 ``[3, 1, T]`` on ``mrope_position_ids``' device.
    """
    flat = mrope_position_ids.reshape(3, -1)
    packed = flat.index_select(1, gather_index)
    packed = torch.where(padding_mask, position_ids.to(packed.dtype), packed)
    return packed.unsqueeze(1)
