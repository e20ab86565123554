"""Build a :class:`PackedBatch` from a ``[B, S]`` batch, its samples and a layout.

Shared by :func:`thdpack.pack_bshd` and :func:`thdpack.from_packed_batch`. Every decision (which source position
lands where, labels at sample boundaries, positions, pad) is made per segment on the host
(:func:`_segment_table`, ``[M]``-sized arrays and two short position lists), then expanded to the ``[T]`` row
where the batch lives:

- host batch (training: ``get_batch`` packs the loader's host batch): numpy expands and gathers. At these sizes
  its repeat and take are several times faster than torch's CPU kernels, and its per-call overhead is lower;
- batch already on a GPU: the per-segment arrays go over in ``non_blocking`` copies from pinned memory and a
  few torch kernels expand and gather there. No ``[T]`` array crosses to the device, nothing comes back: no sync.

Pad is written by position (a few per sample under CP, one run for the trailing segment), never by comparing all
``T`` positions. Loops run over a handful of arrays, never over rows or samples.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from . import paths
from .labels import no_target
from .layout import PackLayout, cumsum0
from .packed_batch import PackedBatch, to_device
from .positions import pack_mrope_position_ids
from .segments import Segments

__all__ = ["assemble"]


def assemble(
    tokens: torch.Tensor,
    labels: torch.Tensor | None,
    loss_mask: torch.Tensor | None,
    mrope: torch.Tensor | None,
    extra: dict[str, torch.Tensor],
    segments: Segments,
    layout: PackLayout,
    *,
    pad_token_id: int,
    ignore_index: int,
    labels_cross_samples: bool = True,
    tokens_key: str = "tokens",
) -> PackedBatch:
    """The :class:`PackedBatch` that places ``segments`` of the ``[B, S]`` inputs as ``layout`` says.

    Inputs are assumed validated (:mod:`thdpack.packing.validate`), but for their values: on the host path, a negative
    token id at a real position raises ``ValueError`` naming ``tokens_key``, the source row and column.
    ``labels_cross_samples``: given labels are shifted over whole rows (Megatron's BSHD convention), so the last
    token of a sample followed by another in its row gets ``ignore_index``; False when they are shifted within
    each sample (packed SFT batches), where that label is the sample's own last target and is kept.
    """
    B, S = tokens.shape
    table = _segment_table(
        segments, layout, S, derive_labels=labels is None, labels_cross_samples=labels_cross_samples
    )
    if paths.numpy_path(tokens):
        plan, cu_padded, cu = _expand_on_host(table), layout.cu_seqlens_padded, layout.cu_seqlens
    else:
        plan, cu_padded, cu = _expand_on_device(table, layout, tokens.device)
    try:
        outputs = _gather_outputs(plan, tokens, labels, loss_mask, pad_token_id, ignore_index)
    except _BadValue as bad:
        key = tokens_key if bad.key == "tokens" else bad.key
        row, col = _source_of(segments, layout, bad.position)
        raise ValueError(
            f"row {row} of '{key}' has {bad.value} at column {col}, a real token: {bad.rule}"
        ) from None
    packed_tokens, packed_labels, packed_loss_mask, position_ids, padding_mask = outputs
    return PackedBatch(
        tokens=packed_tokens,
        labels=packed_labels,
        loss_mask=packed_loss_mask,
        position_ids=position_ids,
        cu_seqlens=cu,
        cu_seqlens_padded=cu_padded,
        max_seqlen=layout.max_seqlen,
        padding_mask=padding_mask,
        segments=segments,
        layout=layout,
        mrope_position_ids=None
        if mrope is None
        else pack_mrope_position_ids(
            mrope, torch.as_tensor(plan.gather), padding_mask.view(-1), position_ids.view(-1)
        ),
        extra={k: _take(v, plan.gather, plan.pad_index, 0) for k, v in extra.items()},
        source_shape=(B, S),
    )


# ----------------------------------------------------------------------------------------------------------
# The plan: per segment on the host, then [T] where the batch lives


class _SegmentTable(NamedTuple):
    """The packed row per segment, host numpy int64 ``[M]``, and two short position lists.

    ``padded_length``: physical length of each segment. ``seg_start``: packed position of its first token.
    ``shift``: flat ``B * S`` source position minus packed position (0 for the trailing pad segment).
    ``no_target``: positions whose label must be ``ignore_index`` (pad, and sample ends the labels would cross
    or, when derived, every sample's last token). ``pad_index``: the pad positions.
    """

    padded_length: np.ndarray
    seg_start: np.ndarray
    shift: np.ndarray
    no_target: np.ndarray
    pad_index: np.ndarray
    total_tokens: int
    derive_labels: bool


class _TokenPlan(NamedTuple):
    """Where every position of the packed row comes from: ``[T]`` arrays and two short index lists, numpy arrays
    on the host and tensors on a GPU.

    ``gather``: flat ``B * S`` source of each position (0 on pad). ``label_index``: flat source of its label (the
    same position in ``labels``, or the next token when labels are derived; in bounds everywhere). ``no_target``,
    ``pad_index``: as in :class:`_SegmentTable`. ``padding_mask``: True on pad. ``position_ids``: position within
    the segment.
    """

    gather: torch.Tensor
    label_index: torch.Tensor
    no_target: torch.Tensor
    pad_index: torch.Tensor
    padding_mask: torch.Tensor
    position_ids: torch.Tensor


def _segment_table(
    segments: Segments,
    layout: PackLayout,
    seq_len: int,
    derive_labels: bool,
    labels_cross_samples: bool = True,
) -> _SegmentTable:
    """Everything :class:`_TokenPlan` needs, per segment, computed on the host (``[M]`` and short lists)."""
    n, T = layout.num_samples, layout.total_tokens
    padded_length, cu_padded, _ = layout.arrays
    seg_start = cu_padded[:-1].astype(np.int64)
    row, first, length = segments.arrays
    shift = np.zeros(seg_start.size, dtype=np.int64)
    shift[:n] = row * seq_len + first - seg_start[:n]
    real_end = seg_start.copy()  # the trailing pad segment, if any, has no real token
    real_end[:n] += length
    num_pad = T - layout.num_real_tokens
    if num_pad:  # each segment's pad runs from the end of its real tokens to its physical end
        pad_count = seg_start + padded_length - real_end
        pad_index = np.repeat(real_end - cumsum0(pad_count)[:-1], pad_count) + np.arange(num_pad)
    else:
        pad_index = np.zeros(0, dtype=np.int64)
    # Labels at sample boundaries (docs/design.md, "labels at boundaries"). Derived labels: every sample's last
    # token has no target. Given labels shifted over whole rows: a sample followed by another in its row has
    # that sample's first token as its last token's label.
    last = real_end[:n] - 1
    if derive_labels:
        sample_ends = last
    elif labels_cross_samples:
        sample_ends = last[:-1][row[1:] == row[:-1]]
    else:
        sample_ends = last[:0]
    no_target = np.concatenate([sample_ends, pad_index]) if num_pad else sample_ends
    return _SegmentTable(padded_length, seg_start, shift, no_target, pad_index, T, derive_labels)


def _expand_on_host(table: _SegmentTable) -> _TokenPlan:
    """The plan as numpy arrays (a host batch)."""
    padded_length, seg_start, shift, no_target, pad_index, T, derive_labels = table
    index = np.arange(T)
    gather = shift.repeat(padded_length)
    gather += index
    pad = np.zeros(T, dtype=np.bool_)
    if pad_index.size:
        gather[pad_index] = 0
        pad[pad_index] = True
    if derive_labels:
        label_index = gather + 1
        label_index[no_target] = 0
    else:
        label_index = gather
    return _TokenPlan(gather, label_index, no_target, pad_index, pad, index - seg_start.repeat(padded_length))


def _expand_on_device(
    table: _SegmentTable, layout: PackLayout, device: torch.device
) -> tuple[_TokenPlan, torch.Tensor, torch.Tensor]:
    """The plan as tensors on ``device`` and the boundaries ``(cu_seqlens_padded, cu_seqlens)`` there (one object
    when they are one on the host). Only ``[M]``-sized arrays and the short position lists are copied."""

    def upload(a: np.ndarray) -> torch.Tensor:
        return to_device(torch.from_numpy(a), device)

    seg_start, shift = upload(table.seg_start), upload(table.shift)
    seg_end = upload(table.seg_start + table.padded_length)
    no_target, pad_index = upload(table.no_target), upload(table.pad_index)
    cu_padded = to_device(layout.cu_seqlens_padded, device)
    cu = cu_padded if layout.cu_seqlens is layout.cu_seqlens_padded else to_device(layout.cu_seqlens, device)
    T = table.total_tokens
    index = torch.arange(T, device=device)
    segment = torch.searchsorted(seg_end, index, right=True)  # the segment each position lies in
    gather = shift.index_select(0, segment).add_(index).index_fill_(0, pad_index, 0)
    label_index = (gather + 1).index_fill_(0, no_target, 0) if table.derive_labels else gather
    pad = torch.zeros(T, dtype=torch.bool, device=device).index_fill_(0, pad_index, True)
    position_ids = index - seg_start.index_select(0, segment)
    return _TokenPlan(gather, label_index, no_target, pad_index, pad, position_ids), cu_padded, cu


# ----------------------------------------------------------------------------------------------------------
# Gathers


def _gather_outputs(
    plan: _TokenPlan,
    tokens: torch.Tensor,
    labels: torch.Tensor | None,
    loss_mask: torch.Tensor | None,
    pad_token_id: int,
    ignore_index: int,
) -> tuple[torch.Tensor, ...]:
    """The packed row's ``(tokens, labels, loss_mask, position_ids, padding_mask)``, each ``[1, T]``, from a plan
    of numpy arrays (host batch: numpy gathers) or of tensors on the batch's device."""
    source = tokens if labels is None else labels
    if isinstance(plan.gather, np.ndarray):  # host: every output stays numpy until it is done
        # Token ids are checked on the packed row (pad holds pad_token_id >= 0): one pass over [T]. A label that
        # is no target (labels.no_target) stays as given and the loss mask is 0 there.
        tokens_np = _take_host(tokens, plan.gather, plan.pad_index, pad_token_id)  # integer dtypes numpy has
        if tokens_np.min() < 0:
            raise _first_bad(
                "tokens", tokens_np, tokens_np < 0, "token ids must be >= 0 (the embedding reads them)"
            )
        labels_np = _take_host(source, plan.label_index, plan.no_target, ignore_index, np.int64)
        no_count = no_target(labels_np, ignore_index)
        if loss_mask is None:
            loss_mask_np = np.logical_not(no_count).astype(np.float32)
        else:
            loss_mask_np = _take_host(loss_mask, plan.gather, no_count, 0, np.float32)
        return (
            torch.from_numpy(tokens_np),
            torch.from_numpy(labels_np),
            torch.from_numpy(loss_mask_np),
            torch.from_numpy(plan.position_ids.reshape(1, -1)),
            torch.from_numpy(plan.padding_mask.reshape(1, -1)),
        )
    packed_tokens = _take(tokens, plan.gather, plan.pad_index, pad_token_id)
    packed_labels = _take(source, plan.label_index, plan.no_target, ignore_index).long()
    no_count = no_target(packed_labels, ignore_index)
    if loss_mask is None:
        packed_loss_mask = (~no_count).float()
    else:
        packed_loss_mask = _take(loss_mask, plan.gather, no_count, 0).float()
    position_ids, padding_mask = plan.position_ids.view(1, -1), plan.padding_mask.view(1, -1)
    return packed_tokens, packed_labels, packed_loss_mask, position_ids, padding_mask


def _take(x: torch.Tensor, index, fill, value: float) -> torch.Tensor:
    """``x.reshape(-1)[index]`` as ``[1, T]``, with ``value`` written at ``fill`` (positions, or a bool mask over
    the result). On the host ``index`` and ``fill`` are numpy arrays and numpy gathers; on a GPU they are
    tensors."""
    if isinstance(index, np.ndarray):
        if x.dtype not in _NUMPY_DTYPES:  # e.g. bfloat16: torch gathers, with the plan's arrays
            return _take(x, torch.from_numpy(index), torch.from_numpy(fill), value)
        return torch.from_numpy(_take_host(x, index, fill, value))
    out = x.reshape(-1).index_select(0, index.view(-1))
    out = (
        out.masked_fill_(fill.view(-1), value)
        if fill.dtype == torch.bool
        else out.index_fill_(0, fill, value)
    )
    return out.view(1, -1)


def _take_host(x: torch.Tensor, index: np.ndarray, fill: np.ndarray, value: float, dtype=None) -> np.ndarray:
    """:func:`_take` on the host as a numpy array ``[1, T]``, cast to the numpy ``dtype`` if given (the value is
    written after the cast, so that it is exact in ``dtype``). Without ``dtype``, ``x`` must be a dtype numpy
    has (:func:`_take` sends the others through torch)."""
    if x.dtype not in _NUMPY_DTYPES:  # e.g. a bfloat16 loss mask, cast to dtype
        out = x.reshape(-1).index_select(0, torch.from_numpy(index)).to(_TORCH_DTYPES[np.dtype(dtype)])
        return _fill_host(out.numpy(), fill, value)
    # take() without an axis reads the array flattened in row-major order, as x.reshape(-1) would be.
    out = x.numpy().take(index)
    return _fill_host(out if dtype is None else out.astype(dtype, copy=False), fill, value)


def _fill_host(out: np.ndarray, fill: np.ndarray, value: float) -> np.ndarray:
    """``out`` (``[T]``) as ``[1, T]`` with ``value`` written at ``fill`` (positions, or a bool mask over it)."""
    out = out.reshape(1, -1)  # numpy's reshape costs less than a view of the tensor
    if fill.dtype == np.bool_:
        # copyto skips runs of False quickly (several times faster than putmask at 64x8192)
        np.copyto(out, value, where=fill, casting="unsafe")
    elif fill.size:
        out[0, fill] = value
    return out


_NUMPY_DTYPES = {
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.float32,
    torch.float64,
}
_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.float32): torch.float32}


# ----------------------------------------------------------------------------------------------------------
# Error path: a bad value found on the packed row, named by its source row and column


class _BadValue(Exception):
    """A value check failed at ``position`` of the packed row (turned into a ``ValueError`` by assemble)."""

    def __init__(self, key: str, position: int, value: int, rule: str):
        self.key, self.position, self.value, self.rule = key, position, value, rule


def _first_bad(key: str, values: np.ndarray, bad: np.ndarray, rule: str) -> _BadValue:
    position = int(np.argmax(bad.reshape(-1)))
    return _BadValue(key, position, int(values.reshape(-1)[position]), rule)


def _source_of(segments: Segments, layout: PackLayout, position: int) -> tuple[int, int]:
    """``(row, column)`` in the source batch of a real position of the packed row."""
    cu_padded = layout.arrays[1]
    i = int(np.searchsorted(cu_padded, position, side="right")) - 1
    row, start, _ = segments.arrays
    return int(row[i]), int(start[i]) + position - int(cu_padded[i])
