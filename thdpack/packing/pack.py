"""``pack_bshd`` and its inverse ``unpack_thd``: a padded BSHD batch to one THD row and back.

``pack_bshd`` checks the batch (:mod:`thdpack.packing.validate`), finds its samples (:func:`thdpack.find_segments`),
plans the row (:func:`thdpack.plan_layout`) and assembles it (:mod:`thdpack.packing.assemble`). All metadata is computed
on the host; a batch already on a GPU only receives ``non_blocking`` copies of per-segment arrays, so packing
costs no host-device sync.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from .assemble import assemble
from .labels import IGNORE_INDEX
from .layout import Alignment, cumsum0, layout_of
from .packed_batch import PackedBatch, to_device
from .segments import Segments, segments_of
from .validate import check_bshd_batch, check_fill_values, check_position_ids

__all__ = ["pack_bshd", "unpack_thd"]


def pack_bshd(
    batch: Mapping[str, torch.Tensor],
    *,
    alignment: Alignment = Alignment(),  # noqa: B008 - frozen dataclass, safe as a default
    segments: Segments | None = None,
    pad_token_id: int = 0,
    ignore_index: int = IGNORE_INDEX,
) -> PackedBatch:
    """Pack a padded BSHD batch into one THD row.

    Args:
        batch: ``tokens`` (or ``input_ids``; both keys only if they hold the same tensor object) integer
            ``[B, S]``, ``B, S >= 1``; optional ``labels`` integer ``[B, S]`` (already shifted within each row,
            Megatron's convention), ``loss_mask`` ``[B, S]`` (bool, integer or float), ``attention_mask`` (any
            form :func:`find_segments` takes: ``[B, S]`` or ``[B, 1, S, S]``), ``position_ids`` integer
            ``[B, S]``, ``mrope_position_ids`` integer ``[3, B, S]``, ``seq_lengths`` integer host ``[B]`` (the
            real tokens of each right-padded row, one sample a row, as a loader knows them: then the mask is not
            read), and any other ``[B, S]`` tensor (gathered the same way into ``extra``). A key whose value is
            None is absent.
        alignment: how to pad for CP/TP/SP/FP8 and buckets; see :class:`Alignment`.
        segments: the real samples, if already known (e.g. from the host mask while the batch is on the GPU:
            then packing costs no device sync). Default: one sample a row from ``seq_lengths``, else
            ``find_segments(attention_mask, position_ids=...)``.
        pad_token_id: token written on pad (an int >= 0: pad goes through the embedding too).
        ignore_index: label written where no target exists.

    Without ``labels``, targets are the next token within each sample (the last token of a sample gets
    ``ignore_index``). With ``labels``, a sample's last token that is followed by another sample in the same
    row gets ``ignore_index``: its shifted label is the next sample's first token.

    A negative label is no target, whatever its value (``ignore_index``, or -1 from another convention): it is
    kept as given and its loss mask is 0.

    ``position_ids`` next to a mask are used, not ignored: with a 2D mask they split a real run where they
    restart at 0, and in every case (2D or 4D mask, ``segments=``) each sample's first token must have id 0
    (checked on host ids; the ids after a sample's first are not read). The packed row's ``position_ids``
    restart at every sample and count up by 1.

    Returns:
        :class:`PackedBatch` on the device of ``tokens``: ``tokens``, ``labels``, ``loss_mask``,
        ``position_ids``, ``padding_mask`` ``[1, T]`` (``T``: the real tokens and the alignment pad),
        ``cu_seqlens`` and ``cu_seqlens_padded`` int32 ``[M + 1]``, ``max_seqlen`` an int.

    Raises:
        TypeError: a batch that is not a mapping, a value that is not a tensor, a dtype a key may not have
            (float token ids or labels, say).
        ValueError: naming the key, the row where there is one, and the rule: shapes that do not match
            ``tokens``, an empty batch, a tensor on another device than ``tokens`` (the mask and position ids
            may stay on the host), a batch already packed (use :func:`thdpack.from_packed_batch`), any mask
            error of :func:`find_segments`, a row above ``2**31 - 1`` tokens; and, for a batch on the host, a
            negative token id on a real token, or position ids that do not restart at 0 at a sample. A batch on
            a GPU is not read back for these value checks (that would cost a sync): pack on the host, as
            :func:`thdpack.megatron.batch.get_batch` does.
    """
    fields = check_bshd_batch(batch, "pack_bshd")
    tokens, labels, loss_mask = fields.tokens, fields.labels, fields.loss_mask
    check_fill_values(pad_token_id, ignore_index)
    B, S = tokens.shape
    if segments is None and fields.seq_lengths is not None:
        segments = Segments.from_numpy(
            np.arange(B, dtype=np.int64),
            np.zeros(B, dtype=np.int64),
            fields.seq_lengths.numpy().astype(np.int64),
        )
    elif segments is None:
        if fields.attention_mask is None and fields.position_ids is None:
            raise ValueError(
                "pack_bshd needs 'attention_mask' or 'position_ids' in the batch (or segments=...) to know the "
                "real tokens; for trailing pad ids use segments=find_segments(input_ids=..., pad_token_id=...)"
            )
        # The mask and position ids passed the entrance checks above (find_segments' own are not run twice).
        segments = segments_of(fields.attention_mask, fields.position_ids)
    else:
        if not isinstance(segments, Segments):
            raise TypeError(f"segments is a {type(segments).__name__}: pass thdpack.Segments (find_segments)")
        segments.check((B, S))
    if not isinstance(alignment, Alignment):
        raise TypeError(f"alignment is a {type(alignment).__name__}: pass a thdpack.Alignment")
    packed = assemble(
        tokens,
        labels,
        loss_mask,
        fields.mrope,
        fields.extra,
        segments,
        # Valid segments have lengths >= 1 by construction: plan_layout's own checks are not run twice.
        layout_of(segments.length, segments.arrays[2], alignment),
        pad_token_id=pad_token_id,
        ignore_index=ignore_index,
        tokens_key=fields.tokens_key,
    )
    if fields.position_ids is not None and fields.position_ids.is_cpu:
        check_position_ids(fields.position_ids, *segments.arrays[:2])
    return packed


def unpack_thd(x: torch.Tensor, packed: PackedBatch, pad_value: float = 0) -> torch.Tensor:
    """Scatter a packed tensor back to the padded batch: the inverse of :func:`pack_bshd` on real tokens.

    Args:
        x: ``[1, T, ...]`` or ``[T, ...]``, aligned with ``packed.tokens`` (a full row, not a CP shard).
        packed: the :class:`PackedBatch` ``x`` belongs to.
        pad_value: value written at every position that held no real token.

    Returns:
        ``[B, S, ...]`` with ``x``'s values at the original positions of the real tokens.
    """
    if not isinstance(packed, PackedBatch):
        raise TypeError(
            f"unpack_thd's packed is a {type(packed).__name__}: pass the PackedBatch x belongs to"
        )
    if not isinstance(x, torch.Tensor):
        raise TypeError(
            f"unpack_thd's x is a {type(x).__name__}: pass a torch.Tensor [1, T, ...] or [T, ...]"
        )
    if packed.cp_size != 1:
        raise ValueError(
            "unpack_thd needs a full row packed by pack_bshd: on a CP shard, reassemble the row first with "
            "thdpack.cp_unshard"
        )
    T = packed.total_tokens
    if x.dim() == 0:
        raise ValueError(f"unpack_thd got a 0-d tensor; expected [1, {T}, ...] or [{T}, ...]")
    if x.dim() >= 2 and x.shape[0] == 1 and x.shape[1] == T:
        x = x[0]
    if x.shape[0] != T:
        raise ValueError(
            f"unpack_thd got a tensor of shape {list(x.shape)}; expected [1, {T}, ...] or [{T}, ...]"
        )
    B, S = packed.source_shape
    packed_pos, source_pos = _unpack_index(packed, x.device)
    out = x.new_full((B * S, *x.shape[1:]), pad_value)
    out.index_copy_(0, source_pos, x.index_select(0, packed_pos))
    return out.view(B, S, *x.shape[1:])


def _unpack_index(packed: PackedBatch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed position, flat source position)`` of every real token, int64 ``[R]`` each, on ``device``."""
    n, R = len(packed.segments), packed.layout.num_real_tokens
    row, start, length = packed.segments.arrays
    offset = cumsum0(length)[:-1]  # index of each sample's first token among the real tokens
    packed_start = packed.layout.arrays[1][:n].astype(np.int64)
    source_start = row * packed.source_shape[1] + start
    # Per sample, position minus index among the real tokens; expanded on ``device`` from [N]-sized copies.
    per_sample = to_device(torch.from_numpy(np.stack([packed_start - offset, source_start - offset])), device)
    segment = torch.repeat_interleave(
        torch.arange(n, device=device), to_device(packed.segments.length, device), output_size=R
    )
    packed_pos, source_pos = per_sample.index_select(1, segment) + torch.arange(R, device=device)
    return packed_pos, source_pos
