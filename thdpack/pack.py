"""``PackedBatch`` (the THD data contract), ``pack_bshd`` and its inverse ``unpack_thd``.

All metadata (which source position lands where, labels at sample boundaries, positions, boundaries,
``max_seqlen``) is computed on the host from ``Segments``; a batch on the GPU only sees one ``non_blocking``
copy of the index arrays and a few gathers, so packing costs no host-device sync.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from .context_parallel import cp_partition_indices
from .layout import Alignment, PackLayout, plan_layout
from .positions import pack_mrope_position_ids
from .segments import Segments, find_segments

__all__ = ["PackedBatch", "pack_bshd", "unpack_thd"]

_RESERVED = (
    "tokens",
    "input_ids",
    "labels",
    "loss_mask",
    "attention_mask",
    "position_ids",
    "mrope_position_ids",
)


@dataclass
class PackedBatch:
    """One padding-free THD row and the metadata attention, RoPE/MRoPE and the MoE router need.

    Token-aligned tensors are ``[1, T]`` (``T`` = ``total_tokens``, or ``T / cp_size`` after
    :meth:`shard_for_cp`) on the batch's device; boundary arrays are global (never sharded).

    Attributes:
        tokens: int64 ``[1, T]``, real tokens of every sample concatenated, ``pad_token_id`` on pad.
        labels: int64 ``[1, T]``, next-token target; ``ignore_index`` on pad and on targets that would cross
            into another sample.
        loss_mask: float32 ``[1, T]``, 1 where the loss counts (0 on pad, on ``ignore_index`` labels and where
            the input loss mask was 0).
        position_ids: int64 ``[1, T]``, restart at 0 at every segment; pad continues counting.
        cu_seqlens: int32 ``[M + 1]``, logical boundaries (the tokens attention treats as each sample).
        cu_seqlens_padded: int32 ``[M + 1]``, physical boundaries; *the same object* as ``cu_seqlens`` when no
            pad lies between samples (TE then keeps its FlashAttention backends).
        max_seqlen: longest physical segment, a Python int (never a device tensor: no ``.item()`` sync).
        padding_mask: bool ``[1, T]``, True on pad (Megatron's MoE router convention).
        mrope_position_ids: int64 ``[3, 1, T]`` or None, per-sample (temporal, height, width) ids.
        extra: other ``[B, S]`` inputs, gathered like ``tokens`` to ``[1, T]`` (0 on pad).
        segments: the real samples of the source batch (host).
        layout: the host-side plan of the row (lengths, boundaries on the host).
        source_shape: ``(B, S)`` of the source batch (``(1, T)`` when built by ``from_packed_batch``).
        cp_size, cp_rank: the context-parallel shard this batch holds (1, 0 = the full row).
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    max_seqlen: int
    padding_mask: torch.Tensor
    segments: Segments
    layout: PackLayout
    mrope_position_ids: torch.Tensor | None = None
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    source_shape: tuple[int, int] = (0, 0)
    cp_size: int = 1
    cp_rank: int = 0
    # (packed position, flat source position) of every real token, host int64 [R] each; None on a CP shard.
    _unpack_index: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    @property
    def rope_cu_seqlens(self) -> torch.Tensor:
        """The boundaries RoPE restarts positions at: the physical ones."""
        return self.cu_seqlens_padded

    @property
    def num_real_tokens(self) -> int:
        return self.layout.num_real_tokens

    @property
    def total_tokens(self) -> int:
        """Tokens in the full packed row, pad included (before CP sharding)."""
        return self.layout.total_tokens

    def token_tensors(self) -> dict[str, torch.Tensor]:
        """Every token-aligned tensor by name (``mrope_position_ids`` and ``extra`` entries included)."""
        out = {
            "tokens": self.tokens,
            "labels": self.labels,
            "loss_mask": self.loss_mask,
            "position_ids": self.position_ids,
            "padding_mask": self.padding_mask,
        }
        if self.mrope_position_ids is not None:
            out["mrope_position_ids"] = self.mrope_position_ids
        out.update(self.extra)
        return out

    def to(self, device: torch.device | str, non_blocking: bool = True) -> PackedBatch:
        """Move every tensor (boundary arrays included) to ``device``; ``cu_seqlens_padded is cu_seqlens``
        is kept. Host metadata (``segments``, ``layout``) stays on the host."""
        device = torch.device(device)
        moved: dict[int, torch.Tensor] = {}

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            if id(t) not in moved:
                moved[id(t)] = _to_device(t, device, non_blocking)
            return moved[id(t)]

        return dataclasses.replace(
            self,
            tokens=move(self.tokens),
            labels=move(self.labels),
            loss_mask=move(self.loss_mask),
            position_ids=move(self.position_ids),
            cu_seqlens=move(self.cu_seqlens),
            cu_seqlens_padded=move(self.cu_seqlens_padded),
            padding_mask=move(self.padding_mask),
            mrope_position_ids=move(self.mrope_position_ids),
            extra={k: move(v) for k, v in self.extra.items()},
        )

    def packed_seq_params(self):
        """Megatron-core ``PackedSeqParams(qkv_format="thd", ...)`` for this row.

        Follows the TE fast-path rule: when no pad lies between samples, ``cu_seqlens_q_padded`` is the very
        object ``cu_seqlens_q``, so TE does not set ``pad_between_seqs`` and FlashAttention stays eligible.
        Boundaries are global: on a CP shard every rank passes the same arrays and TE divides by ``cp_size``.
        """
        try:
            from megatron.core.packed_seq_params import PackedSeqParams
        except ImportError as e:  # pragma: no cover - megatron-core is a dependency
            raise ImportError(
                "PackedBatch.packed_seq_params() needs megatron-core: pip install 'megatron-core>=0.16'"
            ) from e
        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=self.cu_seqlens,
            cu_seqlens_kv=self.cu_seqlens,
            cu_seqlens_q_padded=self.cu_seqlens_padded,
            cu_seqlens_kv_padded=self.cu_seqlens_padded,
            max_seqlen_q=self.max_seqlen,
            max_seqlen_kv=self.max_seqlen,
        )

    def shard_for_cp(self, cp_size: int, cp_rank: int) -> PackedBatch:
        """This CP rank's zigzag shard: every token-aligned tensor sliced with :func:`cp_partition_indices`,
        the boundary arrays and ``max_seqlen`` unchanged (global)."""
        if self.cp_size != 1:
            raise ValueError(f"this batch is already CP rank {self.cp_rank} of {self.cp_size}")
        if cp_size == 1:
            return self
        index = cp_partition_indices(self.layout.cu_seqlens_padded, cp_size, cp_rank)
        index = _to_device(index, self.tokens.device, True)

        def take(t: torch.Tensor) -> torch.Tensor:
            return t.index_select(t.dim() - 1, index)

        return dataclasses.replace(
            self,
            tokens=take(self.tokens),
            labels=take(self.labels),
            loss_mask=take(self.loss_mask),
            position_ids=take(self.position_ids),
            padding_mask=take(self.padding_mask),
            mrope_position_ids=None if self.mrope_position_ids is None else take(self.mrope_position_ids),
            extra={k: take(v) for k, v in self.extra.items()},
            cp_size=cp_size,
            cp_rank=cp_rank,
            _unpack_index=None,
        )


def pack_bshd(
    batch: Mapping[str, torch.Tensor],
    *,
    alignment: Alignment = Alignment(),  # noqa: B008 - frozen dataclass, safe as a default
    segments: Segments | None = None,
    pad_token_id: int = 0,
    ignore_index: int = -100,
) -> PackedBatch:
    """Pack a padded BSHD batch into one THD row.

    Args:
        batch: ``tokens`` (or ``input_ids``) int ``[B, S]``; optional ``labels`` ``[B, S]`` (already shifted
            within each row, Megatron's convention), ``loss_mask`` ``[B, S]``, ``attention_mask`` (any form
            :func:`find_segments` takes), ``position_ids`` ``[B, S]``, ``mrope_position_ids`` ``[3, B, S]``,
            and any other ``[B, S]`` tensor (gathered the same way into ``extra``).
        alignment: how to pad for CP/TP/SP/FP8 and buckets; see :class:`Alignment`.
        segments: the real samples, if already known (e.g. from the host mask while the batch is on the GPU:
            then packing costs no device sync). Default: ``find_segments(attention_mask, position_ids=...)``.
        pad_token_id: token written on pad.
        ignore_index: label written where no target exists.

    Without ``labels``, targets are the next token within each sample (the last token of a sample gets
    ``ignore_index``). With ``labels``, a sample's last token that is followed by another sample in the same
    row gets ``ignore_index``: its shifted label is the next sample's first token.

    Returns:
        :class:`PackedBatch` on the device of ``tokens``.
    """
    fields = dict(batch)
    if "tokens" in fields and "input_ids" in fields:
        raise ValueError("batch has both 'tokens' and 'input_ids': pass one")
    tokens = fields.pop("tokens", None)
    if tokens is None:
        tokens = fields.pop("input_ids", None)
    if tokens is None or tokens.dim() != 2:
        raise ValueError("batch needs 'tokens' (or 'input_ids') of shape [B, S]")
    B, S = tokens.shape
    labels = fields.pop("labels", None)
    loss_mask = fields.pop("loss_mask", None)
    attention_mask = fields.pop("attention_mask", None)
    position_ids = fields.pop("position_ids", None)
    mrope = fields.pop("mrope_position_ids", None)
    for name, t in (
        ("labels", labels),
        ("loss_mask", loss_mask),
        ("position_ids", position_ids),
        *fields.items(),
    ):
        if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != (B, S)):
            shape = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"batch key '{name}' is {shape}, but pack_bshd packs only [B, S] = [{B}, {S}] tensors"
            )
    if mrope is not None and tuple(mrope.shape) != (3, B, S):
        raise ValueError(f"batch key 'mrope_position_ids' is {list(mrope.shape)}, expected [3, {B}, {S}]")

    if segments is None:
        if attention_mask is None and position_ids is None:
            raise ValueError(
                "pack_bshd needs 'attention_mask' or 'position_ids' in the batch (or segments=...) to know the "
                "real tokens; for trailing pad ids use segments=find_segments(input_ids=..., pad_token_id=...)"
            )
        segments = find_segments(attention_mask, position_ids=position_ids)
    else:
        segments.check((B, S))
    return assemble(
        tokens,
        labels,
        loss_mask,
        mrope,
        fields,
        segments,
        plan_layout(segments.length, alignment),
        pad_token_id=pad_token_id,
        ignore_index=ignore_index,
    )


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
) -> PackedBatch:
    """Build the :class:`PackedBatch` that places ``segments`` of the ``[B, S]`` inputs as ``layout`` says.

    Shared by :func:`pack_bshd` and :func:`thdpack.from_packed_batch`; inputs are assumed validated.
    """
    B, S = tokens.shape
    device = tokens.device
    plan = _TokenPlan.build(segments, layout, S, derive_labels=labels is None)
    gather, label_index, no_target, pad, pos = plan.to(device)
    packed_tokens = tokens.reshape(-1).index_select(0, gather).masked_fill_(pad, pad_token_id)
    label_source = tokens if labels is None else labels
    packed_labels = (
        label_source.reshape(-1).index_select(0, label_index).long().masked_fill_(no_target, ignore_index)
    )
    counts = packed_labels != ignore_index
    if loss_mask is None:
        packed_loss_mask = counts.float()
    else:
        packed_loss_mask = loss_mask.reshape(-1).index_select(0, gather).float() * counts

    cu_padded = _to_device(layout.cu_seqlens_padded, device, True)
    cu = (
        cu_padded
        if layout.cu_seqlens is layout.cu_seqlens_padded
        else _to_device(layout.cu_seqlens, device, True)
    )
    return PackedBatch(
        tokens=packed_tokens.view(1, -1),
        labels=packed_labels.view(1, -1),
        loss_mask=packed_loss_mask.view(1, -1),
        position_ids=pos.view(1, -1),
        cu_seqlens=cu,
        cu_seqlens_padded=cu_padded,
        max_seqlen=layout.max_seqlen,
        padding_mask=pad.view(1, -1),
        segments=segments,
        layout=layout,
        mrope_position_ids=None if mrope is None else pack_mrope_position_ids(mrope, gather, pad, pos),
        extra={
            k: v.reshape(-1).index_select(0, gather).masked_fill(pad, 0).view(1, -1) for k, v in extra.items()
        },
        source_shape=(B, S),
        _unpack_index=plan.unpack_index,
    )


def unpack_thd(x: torch.Tensor, packed: PackedBatch, pad_value: float = 0) -> torch.Tensor:
    """Scatter a packed tensor back to the padded batch: the inverse of :func:`pack_bshd` on real tokens.

    Args:
        x: ``[1, T, ...]`` or ``[T, ...]``, aligned with ``packed.tokens`` (a full row, not a CP shard).
        packed: the :class:`PackedBatch` ``x`` belongs to.
        pad_value: value written at every position that held no real token.

    Returns:
        ``[B, S, ...]`` with ``x``'s values at the original positions of the real tokens.
    """
    if packed._unpack_index is None:
        raise ValueError(
            "unpack_thd needs a full row packed by pack_bshd: on a CP shard, reassemble the row first with "
            "thdpack.cp_unshard"
        )
    T = packed.total_tokens
    if x.dim() >= 2 and x.shape[0] == 1 and x.shape[1] == T:
        x = x[0]
    if x.shape[0] != T:
        raise ValueError(
            f"unpack_thd got a tensor of shape {list(x.shape)}; expected [1, {T}, ...] or [{T}, ...]"
        )
    B, S = packed.source_shape
    packed_pos, source_pos = (_to_device(t, x.device, True) for t in packed._unpack_index)
    out = x.new_full((B * S, *x.shape[1:]), pad_value)
    out.index_copy_(0, source_pos, x.index_select(0, packed_pos))
    return out.view(B, S, *x.shape[1:])


@dataclass(frozen=True)
class _TokenPlan:
    """Host-side index arrays of a packed row, one entry per packed position (int64 / bool ``[T]``)."""

    gather: torch.Tensor  # flat B*S source of each position (0 on pad)
    label_index: torch.Tensor  # flat source of each position's target (labels: same as gather; tokens: +1)
    no_target: torch.Tensor  # True where the label must be ignore_index
    padding_mask: torch.Tensor
    position_ids: torch.Tensor
    unpack_index: tuple[torch.Tensor, torch.Tensor]

    @staticmethod
    def build(segments: Segments, layout: PackLayout, seq_len: int, derive_labels: bool) -> _TokenPlan:
        T = layout.total_tokens
        n, m = layout.num_samples, layout.padded_lengths.numel()
        seg = torch.repeat_interleave(torch.arange(m), layout.padded_lengths, output_size=T)
        offset = torch.arange(T) - layout.cu_seqlens_padded[:-1].long()[seg]
        real_len = torch.zeros(m, dtype=torch.int64)
        real_len[:n] = segments.length
        base = torch.zeros(m, dtype=torch.int64)
        base[:n] = segments.row * seq_len + segments.start
        remaining = real_len[seg] - offset  # real tokens left in the sample from here on (<= 0 on pad)
        pad = remaining <= 0
        gather = (base[seg] + offset).masked_fill_(pad, 0)
        if derive_labels:
            no_target = remaining <= 1
            label_index = (gather + 1).masked_fill_(no_target, 0)
        else:
            # A sample's last token predicts the next sample's first when both share a row: no target there.
            followed = torch.zeros(m, dtype=torch.bool)
            followed[: n - 1] = segments.row[1:] == segments.row[:-1]
            no_target = pad | ((remaining == 1) & followed[seg])
            label_index = gather
        packed_pos = (~pad).nonzero().flatten()
        return _TokenPlan(gather, label_index, no_target, pad, offset, (packed_pos, gather[packed_pos]))

    def to(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """``(gather, label_index, no_target, padding_mask, position_ids)`` on ``device`` with one copy."""
        if device.type == "cpu":
            return self.gather, self.label_index, self.no_target, self.padding_mask, self.position_ids
        flags = self.no_target.long() | (self.padding_mask.long() << 1)
        stacked = _to_device(
            torch.stack([self.gather, self.label_index, flags, self.position_ids]), device, True
        )
        gather, label_index, flags, pos = stacked.unbind(0)
        return gather, label_index, (flags & 1).bool(), (flags & 2).bool(), pos


def _to_device(t: torch.Tensor, device: torch.device, non_blocking: bool) -> torch.Tensor:
    if t.device == device:
        return t
    if non_blocking and t.device.type == "cpu" and device.type == "cuda" and not t.is_pinned():
        # A pageable source makes the copy synchronous; pinned memory (cached by torch) keeps it async.
        t = t.pin_memory()
    return t.to(device, non_blocking=non_blocking)
