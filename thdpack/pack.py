"""``PackedBatch`` (the THD data contract), ``pack_bshd`` and its inverse ``unpack_thd``.

All metadata (which source position lands where, labels at sample boundaries, positions, boundaries,
``max_seqlen``) is computed on the host from ``Segments``; a batch on the GPU only sees one ``non_blocking``
copy of the index arrays and a few gathers, so packing costs no host-device sync.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from .context_parallel import cp_partition_indices
from .layout import Alignment, PackLayout, cumsum0, layout_of
from .positions import pack_mrope_position_ids
from .segments import INTEGER_DTYPES, MASK_DTYPES, Segments, check_tensor, segments_of

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
            into another sample (a negative label of the batch, no target, is kept as given).
        loss_mask: float32 ``[1, T]``, 1 where the loss counts (0 on pad, on negative labels, ``ignore_index``
            among them, and where the input loss mask was 0).
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
        return {**self._own_token_tensors(), **self.extra}

    def _own_token_tensors(self) -> dict[str, torch.Tensor]:
        out = {
            "tokens": self.tokens,
            "labels": self.labels,
            "loss_mask": self.loss_mask,
            "position_ids": self.position_ids,
            "padding_mask": self.padding_mask,
        }
        if self.mrope_position_ids is not None:
            out["mrope_position_ids"] = self.mrope_position_ids
        return out

    def to(self, device: torch.device | str, non_blocking: bool = True) -> PackedBatch:
        """Move every tensor (boundary arrays included) to ``device``; ``cu_seqlens_padded is cu_seqlens``
        is kept. Host metadata (``segments``, ``layout``) stays on the host."""
        device = torch.device(device)
        cu_padded = _to_device(self.cu_seqlens_padded, device, non_blocking)
        cu = (
            cu_padded
            if self.cu_seqlens is self.cu_seqlens_padded
            else _to_device(self.cu_seqlens, device, non_blocking)
        )
        return self._map_token_tensors(
            lambda t: _to_device(t, device, non_blocking), cu_seqlens=cu, cu_seqlens_padded=cu_padded
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
        params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=self.cu_seqlens,
            cu_seqlens_kv=self.cu_seqlens,
            cu_seqlens_q_padded=self.cu_seqlens_padded,
            cu_seqlens_kv_padded=self.cu_seqlens_padded,
            max_seqlen_q=self.max_seqlen,
            max_seqlen_kv=self.max_seqlen,
        )
        # Host copies ride along for kernels that loop over samples on the host (thdpack's torch attention):
        # reading the device arrays back would be a sync per layer.
        params.cu_seqlens_q_host = self.layout.cu_seqlens
        params.cu_seqlens_q_padded_host = self.layout.cu_seqlens_padded
        return params

    def shard_for_cp(self, cp_size: int, cp_rank: int) -> PackedBatch:
        """This CP rank's zigzag shard: every token-aligned tensor sliced with :func:`cp_partition_indices`,
        the boundary arrays and ``max_seqlen`` unchanged (global)."""
        if self.cp_size != 1:
            raise ValueError(f"this batch is already CP rank {self.cp_rank} of {self.cp_size}")
        if cp_size == 1:
            return self
        index = cp_partition_indices(self.layout.cu_seqlens_padded, cp_size, cp_rank)
        index = _to_device(index, self.tokens.device, True)
        return self._map_token_tensors(
            lambda t: t.index_select(t.dim() - 1, index), cp_size=cp_size, cp_rank=cp_rank
        )

    def _map_token_tensors(self, fn, **changes) -> PackedBatch:
        """A copy with ``fn`` applied to every token-aligned tensor (the fields of :meth:`token_tensors`)."""
        own = {name: fn(t) for name, t in self._own_token_tensors().items()}
        extra = {name: fn(t) for name, t in self.extra.items()}
        return dataclasses.replace(self, **own, extra=extra, **changes)


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
        batch: ``tokens`` (or ``input_ids``; both keys only if they hold the same tensor object) integer
            ``[B, S]``, ``B, S >= 1``; optional ``labels`` integer ``[B, S]`` (already shifted within each row,
            Megatron's convention), ``loss_mask`` ``[B, S]`` (bool, integer or float), ``attention_mask`` (any
            form :func:`find_segments` takes: ``[B, S]`` or ``[B, 1, S, S]``), ``position_ids`` integer
            ``[B, S]``, ``mrope_position_ids`` integer ``[3, B, S]``, and any other ``[B, S]`` tensor (gathered
            the same way into ``extra``). A key whose value is None is absent.
        alignment: how to pad for CP/TP/SP/FP8 and buckets; see :class:`Alignment`.
        segments: the real samples, if already known (e.g. from the host mask while the batch is on the GPU:
            then packing costs no device sync). Default: ``find_segments(attention_mask, position_ids=...)``.
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
        :class:`PackedBatch` on the device of ``tokens``.

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
    fields = split_bshd_batch(batch, "pack_bshd")
    tokens, labels, loss_mask = fields.tokens, fields.labels, fields.loss_mask
    check_fill_values(pad_token_id, ignore_index)
    B, S = tokens.shape
    if segments is None:
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
        _check_position_ids(fields.position_ids, segments)
    return packed


def check_fill_values(pad_token_id: int, ignore_index: int) -> None:
    """``pad_token_id`` an int >= 0 (pad goes through the embedding too), ``ignore_index`` an int."""
    if not isinstance(pad_token_id, int) or isinstance(pad_token_id, bool):
        raise TypeError(f"pad_token_id={pad_token_id!r}: it must be an int")
    if pad_token_id < 0:
        raise ValueError(f"pad_token_id={pad_token_id}: pad is embedded like any token, so it must be >= 0")
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise TypeError(f"ignore_index={ignore_index!r}: it must be an int")


class BshdFields(NamedTuple):
    """A ``[B, S]`` batch split by role, every tensor checked for type, dtype, shape and device."""

    tokens: torch.Tensor
    tokens_key: str
    labels: torch.Tensor | None
    loss_mask: torch.Tensor | None
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor | None
    mrope: torch.Tensor | None
    extra: dict[str, torch.Tensor]


# Keys of a batch that is already packed (Megatron-Bridge / NeMo): from_packed_batch takes those.
PACKED_KEYS = frozenset(
    {
        "cu_seqlens",
        "cu_seqlens_unpadded",
        "cu_seqlens_argmin",
        "cu_seqlens_unpadded_argmin",
        "max_seqlen",
        "cu_seqlens_q",
        "cu_seqlens_kv",
        "cu_seqlens_q_padded",
        "cu_seqlens_kv_padded",
        "max_seqlen_q",
        "max_seqlen_kv",
    }
)


def split_bshd_batch(batch: Mapping[str, torch.Tensor], caller: str) -> BshdFields:
    """The entrance checks of :func:`pack_bshd` (also run by ``get_batch``'s padded baseline): types, dtypes,
    shapes and devices of every key, from attributes only (no pass over the data, no device sync)."""
    if not isinstance(batch, Mapping):
        raise TypeError(f"{caller} takes a mapping of tensors (a dict), got a {type(batch).__name__}")
    fields = dict(batch)
    tokens = fields.pop("tokens", None)
    input_ids = fields.pop("input_ids", None)
    tokens_key = "tokens"
    if input_ids is not None:
        if tokens is not None and tokens is not input_ids:
            raise ValueError(
                "batch has both 'tokens' and 'input_ids' as different tensors: pass one (the same tensor under both "
                "names is accepted, as Megatron-Bridge's collators send it)"
            )
        tokens, tokens_key = input_ids, "input_ids" if tokens is None else "tokens"
    if tokens is None:
        raise ValueError("batch needs 'tokens' (or 'input_ids') of shape [B, S]")
    check_tensor(f"batch key '{tokens_key}'", tokens, INTEGER_DTYPES, "token ids must be an integer tensor")
    shape = tokens.shape
    if len(shape) != 2 or not shape[0] or not shape[1]:
        raise ValueError(
            f"batch key '{tokens_key}' is {list(shape)}: it must be [B, S] with B >= 1 rows and S >= 1 columns"
        )
    if not PACKED_KEYS.isdisjoint(fields):
        raise ValueError(
            f"batch key '{min(PACKED_KEYS.intersection(fields))}' marks a batch that is already packed "
            "(Megatron-Bridge / NeMo): adopt it with thdpack.from_packed_batch"
        )
    B, S = shape
    on_host = tokens.is_cpu
    labels = fields.pop("labels", None)
    loss_mask = fields.pop("loss_mask", None)
    position_ids = fields.pop("position_ids", None)
    mrope = fields.pop("mrope_position_ids", None)
    attention_mask = fields.pop("attention_mask", None)
    # Each key in one test on the common path (a tensor of an allowed dtype and the right shape, on the tokens'
    # side of host/device); _raise_bad_key names what is wrong otherwise. Position ids and the mask are read
    # where they are (host or device), like find_segments does. Written out, not looped: this runs per batch.
    if labels is not None and not (
        isinstance(labels, torch.Tensor)
        and labels.dtype in INTEGER_DTYPES
        and labels.shape == shape
        and labels.is_cpu
        and on_host
    ):
        _raise_bad_key("labels", labels, INTEGER_DTYPES, shape, True, tokens, tokens_key)
    if loss_mask is not None and not (
        isinstance(loss_mask, torch.Tensor)
        and loss_mask.dtype in MASK_DTYPES
        and loss_mask.shape == shape
        and loss_mask.is_cpu
        and on_host
    ):
        _raise_bad_key("loss_mask", loss_mask, MASK_DTYPES, shape, True, tokens, tokens_key)
    if position_ids is not None and not (
        isinstance(position_ids, torch.Tensor)
        and position_ids.dtype in INTEGER_DTYPES
        and position_ids.shape == shape
    ):
        _raise_bad_key("position_ids", position_ids, INTEGER_DTYPES, shape, False, tokens, tokens_key)
    if mrope is not None:
        _raise_bad_key("mrope_position_ids", mrope, INTEGER_DTYPES, (3, B, S), True, tokens, tokens_key)
    if attention_mask is not None and not (
        isinstance(attention_mask, torch.Tensor)
        and attention_mask.dtype in MASK_DTYPES
        and (attention_mask.shape == shape or attention_mask.shape == (B, 1, S, S))
    ):
        check_tensor("batch key 'attention_mask'", attention_mask, MASK_DTYPES, _WHAT[MASK_DTYPES])
        raise ValueError(
            f"batch key 'attention_mask' is {list(attention_mask.shape)} but '{tokens_key}' is {list(shape)}: "
            f"every [B, S] key must match {tokens_key} (a 4D mask is [B, 1, S, S] = {[B, 1, S, S]})"
        )
    any_none = False
    for name, t in fields.items():
        if t is None:
            any_none = True
        elif not (isinstance(t, torch.Tensor) and t.shape == shape and t.is_cpu and on_host):
            if not isinstance(t, torch.Tensor):
                raise TypeError(
                    f"batch key '{name}' is a {type(t).__name__}: {caller} packs only tensors (drop the key or make "
                    "it a [B, S] tensor)"
                )
            _raise_bad_key(name, t, None, shape, True, tokens, tokens_key, caller)
    if any_none:
        fields = {k: v for k, v in fields.items() if v is not None}
    return BshdFields(tokens, tokens_key, labels, loss_mask, attention_mask, position_ids, mrope, fields)


_WHAT = {
    INTEGER_DTYPES: "it must be an integer tensor (token ids, labels and position ids are integers)",
    MASK_DTYPES: "it holds bool, integer or floating values",
}


def _raise_bad_key(
    name: str,
    t,
    dtypes: frozenset | None,
    expected: tuple,
    same_device: bool,
    tokens: torch.Tensor,
    tokens_key: str,
    caller: str = "pack_bshd",
) -> None:
    """Name what is wrong with batch key ``name`` (error path of :func:`split_bshd_batch`): its type, dtype,
    shape, or device, in that order. Returns when nothing is (a device batch whose keys all agree)."""
    if dtypes is not None:
        check_tensor(f"batch key '{name}'", t, dtypes, _WHAT[dtypes])
    if t.shape != expected:
        if dtypes is None:
            rule = f"{caller} gathers every other key as a [B, S] tensor, and every [B, S] key must match {tokens_key}"
        elif len(expected) == 2:
            rule = f"every [B, S] key must match {tokens_key}"
        else:
            rule = f"{name} must be {list(expected)} ([3, B, S]: temporal, height, width)"
        raise ValueError(
            f"batch key '{name}' is {list(t.shape)} but '{tokens_key}' is {list(tokens.shape)}: {rule}"
        )
    if same_device and t.device != tokens.device:
        raise ValueError(
            f"batch key '{name}' is on {t.device} but '{tokens_key}' on {tokens.device}: token-aligned tensors must "
            "be on one device (the mask and position ids may stay on the host)"
        )


class _BadValue(Exception):
    """A value check failed at ``position`` of the packed row (turned into a ``ValueError`` by assemble)."""

    def __init__(self, key: str, position: int, value: int, rule: str):
        self.key, self.position, self.value, self.rule = key, position, value, rule


def _first_bad(key: str, values: np.ndarray, bad: np.ndarray, rule: str) -> _BadValue:
    position = int(np.argmax(bad.reshape(-1)))
    return _BadValue(key, position, int(values.reshape(-1)[position]), rule)


def _source_of(segments: Segments, layout: PackLayout, position: int) -> tuple[int, int]:
    """``(row, column)`` in the source batch of a real position of the packed row (error path only)."""
    cu_padded = layout.arrays[1]
    i = int(np.searchsorted(cu_padded, position, side="right")) - 1
    row, start, _ = segments.arrays
    return int(row[i]), int(start[i]) + position - int(cu_padded[i])


def _check_position_ids(position_ids: torch.Tensor, segments: Segments) -> None:
    """Each sample's first token has position id 0 (an ``N``-sized read of host ids: ids that count on across a
    sample boundary, or start a left-padded row at its column, are caught; the ids after a sample's first are
    not read, the packed row's restart at every sample and count up by 1)."""
    ids = position_ids.numpy()
    row, start, _ = segments.arrays
    # One sample per row, each at column 0 (right padding, the common case; two samples of one row cannot both
    # start there): a column view instead of a gather. count_nonzero: a fifth of .any()'s per-call cost here.
    one_per_row = row.size == ids.shape[0] and not np.count_nonzero(start)
    first = ids[:, 0] if one_per_row else ids[row, start]
    if np.count_nonzero(first):
        i = int(np.argmax(first != 0))
        raise ValueError(
            f"row {int(row[i])} of position_ids has {int(first[i])} at column {int(start[i])}, where sample {i} "
            "starts: position ids must restart at 0 at every sample (the packed row's position_ids do)"
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
    labels_cross_samples: bool = True,
    tokens_key: str = "tokens",
) -> PackedBatch:
    """Build the :class:`PackedBatch` that places ``segments`` of the ``[B, S]`` inputs as ``layout`` says.

    Shared by :func:`pack_bshd` and :func:`thdpack.from_packed_batch`; inputs are assumed validated, but for
    their values: on the host path, a negative token id at a real position raises ``ValueError`` naming
    ``tokens_key``, the source row and column.
    ``labels_cross_samples``: given labels are shifted over whole rows (Megatron's BSHD convention), so the last
    token of a sample followed by another in its row gets ``ignore_index``; False when they are shifted within
    each sample (packed SFT batches), where that label is the sample's own last target and is kept.
    """
    B, S = tokens.shape
    table = _segment_table(
        segments, layout, S, derive_labels=labels is None, labels_cross_samples=labels_cross_samples
    )
    if tokens.is_cpu:
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
    gather, fill = plan.gather, plan.pad_index
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
            mrope, torch.as_tensor(gather).view(-1), padding_mask.view(-1), position_ids.view(-1)
        ),
        extra={k: _take(v, gather, fill, 0) for k, v in extra.items()},
        source_shape=(B, S),
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


class _TokenPlan(NamedTuple):
    """Where every position of the packed row comes from: ``[T]`` arrays and two short index lists, numpy
    arrays on the host and tensors on a GPU.

    ``gather``: flat ``B * S`` source of each position (0 on pad). ``label_index``: flat source of its label
    (the same position in ``labels``, or the next token when labels are derived; in bounds everywhere).
    ``no_target``: positions whose label must be ``ignore_index`` (pad, and sample ends the labels would
    cross or, when derived, every sample's last token). ``pad_index``: the pad positions. ``padding_mask``:
    True on pad. ``position_ids``: position within the segment.
    """

    gather: torch.Tensor
    label_index: torch.Tensor
    no_target: torch.Tensor
    pad_index: torch.Tensor
    padding_mask: torch.Tensor
    position_ids: torch.Tensor


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
    if num_pad:
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


def _gather_outputs(
    plan: _TokenPlan,
    tokens: torch.Tensor,
    labels: torch.Tensor | None,
    loss_mask: torch.Tensor | None,
    pad_token_id: int,
    ignore_index: int,
) -> tuple[torch.Tensor, ...]:
    """The packed row's ``(tokens, labels, loss_mask, position_ids, padding_mask)``, each ``[1, T]``, from a
    plan of numpy arrays (host batch: numpy gathers, cheaper per call there) or of tensors on the batch's
    device."""
    source = tokens if labels is None else labels
    if isinstance(plan.gather, np.ndarray):  # host: every output stays numpy until it is done
        # Token ids are checked on the packed row (pad holds pad_token_id >= 0): one pass over [T]. A negative
        # label is no target whatever its value (ignore_index, or -1 from another convention): it stays as given
        # and the loss mask is 0 there.
        tokens_np = _take_host(tokens, plan.gather, plan.pad_index, pad_token_id)  # integer dtypes numpy has
        if tokens_np.min() < 0:
            raise _first_bad(
                "tokens", tokens_np, tokens_np < 0, "token ids must be >= 0 (the embedding reads them)"
            )
        packed_tokens = torch.from_numpy(tokens_np)
        labels_np = _take_host(source, plan.label_index, plan.no_target, ignore_index, np.int64)
        no_count = labels_np < 0
        if ignore_index >= 0:
            no_count |= labels_np == ignore_index
        if loss_mask is None:
            loss_mask_np = np.logical_not(no_count).astype(np.float32)
        else:
            loss_mask_np = _take_host(loss_mask, plan.gather, no_count, 0, np.float32)
        packed_labels, packed_loss_mask = torch.from_numpy(labels_np), torch.from_numpy(loss_mask_np)
        position_ids = torch.from_numpy(plan.position_ids.reshape(1, -1))
        padding_mask = torch.from_numpy(plan.padding_mask.reshape(1, -1))
    else:
        packed_tokens = _take(tokens, plan.gather, plan.pad_index, pad_token_id)
        packed_labels = _take(source, plan.label_index, plan.no_target, ignore_index).long()
        no_count = packed_labels < 0  # as on the host
        if ignore_index >= 0:
            no_count |= packed_labels == ignore_index
        if loss_mask is None:
            packed_loss_mask = (~no_count).float()
        else:
            packed_loss_mask = _take(loss_mask, plan.gather, no_count, 0).float()
        position_ids, padding_mask = plan.position_ids.view(1, -1), plan.padding_mask.view(1, -1)
    return packed_tokens, packed_labels, packed_loss_mask, position_ids, padding_mask


def _expand_on_device(
    table: _SegmentTable, layout: PackLayout, device: torch.device
) -> tuple[_TokenPlan, torch.Tensor, torch.Tensor]:
    """The plan on ``device`` and the boundaries ``(cu_seqlens_padded, cu_seqlens)`` there (one object when
    they are one on the host), all from one pinned copy."""
    seg_end = table.seg_start + table.padded_length
    arrays = [seg_end, table.seg_start, table.shift, table.no_target, table.pad_index]
    buffer, offsets, cu_padded, cu = _upload_with_boundaries(arrays, layout, device)
    seg_end, seg_start, shift, no_target, pad_index = _views(buffer, arrays, offsets)
    T = table.total_tokens
    index = torch.arange(T, device=device)
    segment = torch.searchsorted(seg_end, index, right=True)  # the segment each position lies in
    gather = shift.index_select(0, segment).add_(index).index_fill_(0, pad_index, 0)
    label_index = (gather + 1).index_fill_(0, no_target, 0) if table.derive_labels else gather
    pad = torch.zeros(T, dtype=torch.bool, device=device).index_fill_(0, pad_index, True)
    plan = _TokenPlan(
        gather, label_index, no_target, pad_index, pad, index - seg_start.index_select(0, segment)
    )
    return plan, cu_padded, cu


def _upload_with_boundaries(
    arrays: list[np.ndarray], layout: PackLayout, device: torch.device
) -> tuple[torch.Tensor, list[int], torch.Tensor, torch.Tensor]:
    """One ``non_blocking`` copy of ``arrays`` followed by the layout's boundaries: ``(buffer, offsets,
    cu_seqlens_padded, cu_seqlens)`` on ``device``, ``buffer`` and ``offsets`` as :func:`_upload` returns them
    (``arrays`` from the buffer's start); the two boundaries are one object when they are one on the host."""
    _, cu_padded, cu = layout.arrays
    boundaries = [cu_padded] if cu is cu_padded else [cu_padded, cu]
    buffer, offsets = _upload(arrays + boundaries, device)
    cu_padded, *cu = _views(buffer, boundaries, offsets[len(arrays) :])
    return buffer, offsets, cu_padded, cu[0] if cu else cu_padded


_TORCH_DTYPES = {
    np.dtype(np.int64): torch.int64,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.float32): torch.float32,
}


def _upload(arrays: list[np.ndarray], device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """Copy small host arrays (int64/int32) to ``device`` in one ``non_blocking`` copy from pinned memory.

    Returns a uint8 buffer holding them one after another, each at an 8-byte boundary, and the byte offset of
    each in it (then the buffer's size), for :func:`_views`.
    """
    offsets = [0]
    for a in arrays:  # a handful of arrays: a Python loop costs less than numpy's per-call overhead here
        offsets.append(offsets[-1] + -(-a.nbytes // 8) * 8)
    # Pinned: from pageable memory cudaMemcpyAsync first waits for the stream to drain (a hidden sync that
    # torch's sync-debug mode does not report). torch's host allocator caches the buffers.
    staging = torch.empty(offsets[-1], dtype=torch.uint8, pin_memory=device.type == "cuda")
    host = staging.numpy()
    for a, start in zip(arrays, offsets, strict=False):
        host[start : start + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    return staging.to(device, non_blocking=True), offsets


def _views(buffer: torch.Tensor, arrays: list[np.ndarray], offsets: list[int]) -> list[torch.Tensor]:
    """A view of each of ``arrays`` in ``buffer`` at its byte offset (:func:`_upload`'s, from that array on),
    with its dtype and shape. Each view costs host time, so callers ask only for the ones they read."""
    views = []
    for a, start in zip(arrays, offsets, strict=False):
        view = buffer[start : start + a.nbytes].view(_TORCH_DTYPES[a.dtype])
        views.append(view if a.ndim == 1 else view.view(a.shape))
    return views


def _take(x: torch.Tensor, index, fill, value: float) -> torch.Tensor:
    """``x.reshape(-1)[index]`` as ``[1, T]``, with ``value`` written at ``fill`` (positions, or a bool mask over
    the result). On the host ``index`` and ``fill`` are numpy arrays and numpy gathers (see
    :func:`_segment_table`); on a GPU they are tensors."""
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
        # copyto skips runs of False quickly (measured: 8.6 against putmask's 55 us at 64x8192)
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


def _unpack_index(packed: PackedBatch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed position, flat source position)`` of every real token, int64 ``[R]`` each, on ``device``."""
    segments, layout = packed.segments, packed.layout
    n, R = len(segments), layout.num_real_tokens
    row, start, length = segments.arrays
    offset = cumsum0(length)[:-1]  # index of each sample's first token among the real tokens
    packed_start = layout.arrays[1][:n].astype(np.int64)
    source_start = row * packed.source_shape[1] + start
    # Per sample, position minus index among the real tokens; expanded on ``device`` after one small copy.
    arrays = [np.stack([packed_start - offset, source_start - offset]), length]
    buffer, offsets = _upload(arrays, device)
    table, length = _views(buffer, arrays, offsets)
    segment = torch.repeat_interleave(torch.arange(n, device=device), length, output_size=R)
    packed_pos, source_pos = table.index_select(1, segment) + torch.arange(R, device=device)
    return packed_pos, source_pos


def _to_device(t: torch.Tensor, device: torch.device, non_blocking: bool) -> torch.Tensor:
    if t.device == device:
        return t
    if non_blocking and t.device.type == "cpu" and device.type == "cuda" and not t.is_pinned():
        # From pageable memory cudaMemcpyAsync first waits for the stream to drain (a hidden sync that torch's
        # sync-debug mode does not report); from pinned memory (torch caches the buffers) it stays async.
        t = t.pin_memory()
    return t.to(device, non_blocking=non_blocking)
