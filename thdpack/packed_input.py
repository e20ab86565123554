"""Batches that arrive already packed, in the Megatron-Bridge / NeMo packed-SFT format."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .layout import PackLayout
from .pack import PackedBatch, assemble
from .segments import Segments

__all__ = ["from_packed_batch"]

_BOUNDARY_KEYS = (
    "cu_seqlens",
    "cu_seqlens_unpadded",
    "cu_seqlens_argmin",
    "cu_seqlens_unpadded_argmin",
    "max_seqlen",
)


def from_packed_batch(
    batch: Mapping[str, torch.Tensor], *, pad_token_id: int = 0, ignore_index: int = -100
) -> PackedBatch:
    """Adopt an already-packed Megatron-Bridge / NeMo batch as a :class:`PackedBatch`.

    Args:
        batch: ``tokens`` (or ``input_ids``) ``[1, T]``; optional ``labels``, ``loss_mask``, ``position_ids``
            and other ``[1, T]`` tensors; ``cu_seqlens`` int ``[1, K]`` or ``[K]``, the physical boundaries,
            possibly followed by ``-1`` sentinels; optional ``cu_seqlens_unpadded`` (logical boundaries, same
            form), ``cu_seqlens_argmin`` / ``cu_seqlens_unpadded_argmin`` (index of the first sentinel) and
            ``max_seqlen``. The boundary keys must be **host** tensors (as the data loader delivers them): that
            is what makes this sync-free, where Bridge's ``get_packed_seq_params`` calls ``.item()`` on
            ``cu_seqlens_argmin`` every micro-batch. Token tensors may be on any device.

    Returns:
        :class:`PackedBatch` with the batch's physical layout unchanged. Tokens after ``cu_seqlens[-1]`` form a
        trailing pad segment; tokens between a sample's logical and physical end are pad. ``position_ids`` are
        rebuilt (restart at every sample); ``labels`` are kept (derived within each sample when absent) except
        that, as in :func:`pack_bshd`, the last token of every sample but the row's last gets ``ignore_index``:
        all samples share one row, so its label may be the next sample's first token.

    Raises:
        ValueError: for a boundary array on a GPU, non-monotone or out-of-range boundaries, a logical sample
            longer than its physical slot, or mismatched token shapes.
    """
    fields = dict(batch)
    tokens = fields.pop("tokens", None)
    if tokens is None:
        tokens = fields.pop("input_ids", None)
    if tokens is None or tokens.dim() != 2 or tokens.shape[0] != 1:
        raise ValueError("a packed batch needs 'tokens' (or 'input_ids') of shape [1, T]")
    T = tokens.shape[1]
    boundaries = {k: fields.pop(k) for k in _BOUNDARY_KEYS if k in fields}
    for key, value in boundaries.items():
        if isinstance(value, torch.Tensor) and value.device.type != "cpu":
            raise ValueError(
                f"batch key '{key}' is on {value.device}: from_packed_batch reads the boundary arrays on the host so "
                "that it needs no device sync; keep them on the host (token tensors may be on the GPU)"
            )
    if "cu_seqlens" not in boundaries:
        raise ValueError("a packed batch needs 'cu_seqlens' (the physical sample boundaries)")
    physical = _trim("cu_seqlens", boundaries["cu_seqlens"], boundaries.get("cu_seqlens_argmin"), T)
    logical = physical
    if "cu_seqlens_unpadded" in boundaries:
        logical = _trim(
            "cu_seqlens_unpadded",
            boundaries["cu_seqlens_unpadded"],
            boundaries.get("cu_seqlens_unpadded_argmin"),
            T,
        )
        if logical.numel() != physical.numel():
            raise ValueError(
                f"cu_seqlens_unpadded has {logical.numel() - 1} samples but cu_seqlens has {physical.numel() - 1}"
            )
    lengths = logical.diff()
    slots = physical.diff()
    if bool((lengths > slots).any()):
        i = int((lengths > slots).nonzero()[0])
        raise ValueError(
            f"sample {i} has {int(lengths[i])} real tokens in a physical slot of {int(slots[i])}: cu_seqlens_unpadded "
            "must not outgrow cu_seqlens"
        )
    keep = slots > 0  # a repeated boundary is an empty entry, not a sample
    if bool((lengths[keep] == 0).any()):
        i = int(((lengths == 0) & keep).nonzero()[0])
        raise ValueError(f"sample {i} has a physical slot of {int(slots[i])} tokens but no real token")
    segments = Segments(
        row=torch.zeros(int(keep.sum()), dtype=torch.int64), start=physical[:-1][keep], length=lengths[keep]
    )
    if len(segments) == 0:
        raise ValueError("the packed batch has no real token")

    padded_lengths = slots[keep]
    attn_lengths = lengths[keep] if "cu_seqlens_unpadded" in boundaries else padded_lengths
    body = int(physical[-1])
    if body < T:
        padded_lengths = torch.cat([padded_lengths, padded_lengths.new_tensor([T - body])])
        attn_lengths = torch.cat([attn_lengths, attn_lengths.new_tensor([T - body])])
    layout = PackLayout.from_lengths(segments.length, padded_lengths, attn_lengths)
    labels = fields.pop("labels", None)
    loss_mask = fields.pop("loss_mask", None)
    fields.pop("position_ids", None)  # rebuilt from the boundaries
    for name, t in (("labels", labels), ("loss_mask", loss_mask), *fields.items()):
        if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != (1, T)):
            shape = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"batch key '{name}' is {shape}, expected [1, {T}] like 'tokens'")
    return assemble(
        tokens,
        labels,
        loss_mask,
        None,
        fields,
        segments,
        layout,
        pad_token_id=pad_token_id,
        ignore_index=ignore_index,
    )


def _trim(name: str, cu: torch.Tensor, argmin: torch.Tensor | None, total: int) -> torch.Tensor:
    """The valid prefix of a boundary array padded with -1 sentinels, as int64 ``[N + 1]``."""
    cu = torch.as_tensor(cu).reshape(-1).to(torch.int64)
    if argmin is not None:
        cu = cu[: int(torch.as_tensor(argmin).reshape(-1)[0])]
    else:
        sentinel = (cu < 0).nonzero()
        if sentinel.numel():
            cu = cu[: int(sentinel[0])]
    if (
        cu.numel() < 2
        or int(cu[0]) != 0
        or bool((cu.diff() < 0).any())
        or bool((cu < 0).any())
        or int(cu[-1]) > total
    ):
        raise ValueError(
            f"{name} = {cu.tolist()} is not a valid boundary array for {total} tokens: it must start at 0, never "
            f"decrease, and end at most at {total} (-1 sentinels only after the last boundary)"
        )
    return cu
