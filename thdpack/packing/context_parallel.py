"""Context-parallel partition of a packed row: TE's per-sample zigzag, as pure tensor functions.

Each physical sample of length ``L`` (a multiple of ``2 * cp``) is cut into ``2 * cp`` equal chunks; rank ``r``
keeps chunk ``r`` and chunk ``2 * cp - 1 - r``, sample after sample. This balances causal attention work,
and it is what ``transformer_engine.pytorch.attention.dot_product_attention.utils``'s
``thd_get_partitioned_indices`` computes, so our shards line up with TE's CP attention.
"""

from __future__ import annotations

import torch

from .layout import cumsum0

__all__ = ["cp_partition_indices", "cp_unshard"]


def cp_partition_indices(cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global token indices that CP rank ``cp_rank`` keeps, in the order it keeps them.

    Args:
        cu_seqlens_padded: int ``[M + 1]`` physical boundaries of the full (unsharded) row; a host tensor
            (on a GPU it costs one sync for the output size).
        cp_size, cp_rank: context-parallel size and this rank.

    Returns:
        int64 ``[T // cp_size]`` on ``cu_seqlens_padded``'s device.

    Raises:
        ValueError: when a sample length is not a multiple of ``2 * cp_size``.
    """
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, {cp_size}), got {cp_rank}")
    cu = cu_seqlens_padded.to(torch.int64)
    total = int(cu[-1])
    if cp_size == 1:
        return torch.arange(total, device=cu.device)
    lengths = cu.diff()
    bad = lengths % (2 * cp_size) != 0
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(
            f"sample {i} has physical length {int(lengths[i])}, not a multiple of 2*cp = {2 * cp_size}: pack with "
            f"Alignment(cp_size={cp_size}) before sharding for context parallelism"
        )
    chunk = lengths // (2 * cp_size)
    seg = torch.repeat_interleave(
        torch.arange(lengths.numel(), device=cu.device), 2 * chunk, output_size=total // cp_size
    )
    local_start = cumsum0(2 * chunk)
    j = torch.arange(total // cp_size, device=cu.device) - local_start[seg]
    c = chunk[seg]
    first = j < c
    offset = torch.where(first, cp_rank * c + j, (2 * cp_size - 1 - cp_rank) * c + (j - c))
    return cu[:-1][seg] + offset


def cp_unshard(shards: list[torch.Tensor], cu_seqlens_padded: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Reassemble the full row from every CP rank's shard (the inverse of slicing with
    :func:`cp_partition_indices`). ``shards[r]`` is rank ``r``'s tensor; the token axis is ``dim``."""
    cp_size = len(shards)
    dim = dim % shards[0].dim()
    shape = list(shards[0].shape)
    shape[dim] *= cp_size
    out = shards[0].new_empty(shape)
    for rank, shard in enumerate(shards):
        idx = cp_partition_indices(cu_seqlens_padded, cp_size, rank).to(shard.device)
        out.index_copy_(dim, idx, shard)
    return out
