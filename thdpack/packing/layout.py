"""Alignment arithmetic and boundary arrays of a packed row (host only, no tensors on a device).

A packed row is a sequence of *segments*: one per real sample, then at most one trailing pad-only segment.
Each segment has a physical length (its place in the row, pad included) and an attention length (the
tokens attention treats as the sample): the real length in ``distinct`` mode, the physical length in
``fold`` mode. The trailing pad segment always attends to itself in full, so it never by itself makes the
logical and physical arrays differ (which would cost TE its FlashAttention backends).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from .validate import check_lengths

__all__ = ["Alignment", "PackLayout", "plan_layout"]

MODES = ("distinct", "fold")

# cu_seqlens are int32 (Transformer Engine's and Megatron-core's boundary dtype, and TE's max_seqlen), so a packed
# row holds at most this many tokens.
INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class Alignment:
    """How a packed row is aligned for the parallel layout and kernels that consume it.

    Each sample is padded only as context parallelism requires (to a multiple of ``2 * cp_size`` when
    ``cp_size > 1``: TE's THD partition kernel cuts every sample into ``2 * cp`` equal chunks). What the total
    still needs goes into one trailing pad segment: ``cp * tp`` under sequence parallelism (each CP rank's
    tokens split evenly over TP), ``fp8_multiple`` tokens per GEMM rank under FP8. This never pads more than
    Megatron-Bridge's rule of padding every sample to ``lcm(2cp, cp*tp)``.

    Attributes:
        cp_size, tp_size: context- and tensor-parallel sizes.
        sequence_parallel: Megatron's sequence parallelism (token dim split over TP).
        fp8: pad so that every rank's token dim is a multiple of ``fp8_multiple`` (16; 32 for MXFP8).
        mode: ``"distinct"``: pad after each sample, logical and physical boundaries differ, attention skips
            the pad. ``"fold"``: the pad joins its sample's segment, logical = physical (one tensor object),
            FlashAttention stays eligible; valid for causal attention only (real tokens never see later pad).
        pad_total_to: pad the total to exactly this many tokens (a fixed bucket for CUDA graphs or fixed-shape
            pipeline parallelism); must be a multiple of ``total_multiple``.
        fp8_multiple: token multiple FP8 GEMMs need per rank.
    """

    cp_size: int = 1
    tp_size: int = 1
    sequence_parallel: bool = False
    fp8: bool = False
    mode: str = "distinct"
    pad_total_to: int | None = None
    fp8_multiple: int = 16

    def __post_init__(self) -> None:
        for name in ("cp_size", "tp_size", "fp8_multiple"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Alignment.{name} must be a positive int, got {value!r}")
        if self.mode not in MODES:
            raise ValueError(f"Alignment.mode must be one of {MODES}, got {self.mode!r}")
        if self.pad_total_to is not None and (
            not isinstance(self.pad_total_to, int)
            or isinstance(self.pad_total_to, bool)
            or self.pad_total_to < 1
            or self.pad_total_to % self.total_multiple
        ):
            raise ValueError(
                f"Alignment.pad_total_to={self.pad_total_to!r} must be a multiple of {self.total_multiple} "
                f"(the total alignment for cp={self.cp_size}, tp={self.tp_size}, "
                f"sequence_parallel={self.sequence_parallel}, fp8={self.fp8})"
            )
        if self.pad_total_to is not None and self.pad_total_to > INT32_MAX:
            raise ValueError(
                f"Alignment.pad_total_to={self.pad_total_to} is above {INT32_MAX}: cu_seqlens are int32, so a packed "
                f"row holds at most {INT32_MAX} tokens"
            )

    @functools.cached_property
    def sample_multiple(self) -> int:
        """Every physical sample length is a multiple of this (``2 * cp_size`` under CP, else 1)."""
        return 2 * self.cp_size if self.cp_size > 1 else 1

    @functools.cached_property
    def total_multiple(self) -> int:
        """The packed row's total length is a multiple of this."""
        tokens_per_gemm_rank = self.cp_size * (self.tp_size if self.sequence_parallel else 1)
        multiple = math.lcm(self.sample_multiple, tokens_per_gemm_rank)
        if self.fp8:
            multiple = math.lcm(multiple, self.fp8_multiple * tokens_per_gemm_rank)
        return multiple

    def row_tokens(self, lengths: np.ndarray) -> tuple[np.ndarray, int]:
        """``(physical lengths, body)`` of samples of these real ``lengths`` (int64 numpy ``[N]``): each padded to
        ``sample_multiple``, and their sum (the row before the trailing pad segment)."""
        m = self.sample_multiple
        if m == 1:
            return lengths, int(lengths.sum())
        padded = (lengths + m - 1) // m * m
        return padded, int(padded.sum())

    def total_tokens(self, lengths: np.ndarray) -> int:
        """Tokens of the packed row for samples of these real ``lengths`` (int64 numpy ``[N]``): what
        :func:`plan_layout` gives as ``total_tokens``, without building the layout."""
        total = -(-self.row_tokens(lengths)[1] // self.total_multiple) * self.total_multiple
        return total if self.pad_total_to is None else max(total, self.pad_total_to)


@dataclass(frozen=True)
class PackLayout:
    """Where each sample sits in the packed row. Host tensors only.

    Attributes:
        lengths: int64 ``[N]`` real tokens of each sample.
        padded_lengths: int64 ``[M]`` physical length of each segment, ``M = N`` or ``N + 1`` with the trailing
            pad segment.
        attn_lengths: int64 ``[M]`` tokens attention treats as the segment (see module docstring).
        cu_seqlens: int32 ``[M + 1]`` cumulative ``attn_lengths``.
        cu_seqlens_padded: int32 ``[M + 1]`` cumulative ``padded_lengths``; the same object as ``cu_seqlens``
            when they are equal.
        max_seqlen: longest physical segment.
        total_tokens: length of the packed row.
        num_real_tokens: ``lengths.sum()``.
    """

    lengths: torch.Tensor
    padded_lengths: torch.Tensor
    attn_lengths: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    max_seqlen: int
    total_tokens: int
    num_real_tokens: int

    @classmethod
    def from_lengths(
        cls, lengths: torch.Tensor, padded_lengths: torch.Tensor, attn_lengths: torch.Tensor
    ) -> PackLayout:
        """The layout of segments with these physical and attention lengths (int64 host ``[N]``, ``[M]``,
        ``[M]``; the real samples first)."""
        padded = padded_lengths.numpy()
        total = int(padded.sum())
        if total > INT32_MAX:
            raise ValueError(
                f"the packed row has {total} tokens: cu_seqlens are int32, so a packed row holds at most "
                f"{INT32_MAX} tokens"
            )
        same = attn_lengths is padded_lengths or np.array_equal(attn_lengths.numpy(), padded)
        attn = None if same else attn_lengths.numpy()
        return _layout(lengths, padded, attn, int(lengths.numpy().sum()), total)

    @functools.cached_property
    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(padded_lengths, cu_seqlens_padded, cu_seqlens)`` as numpy arrays sharing the tensors' memory (the
        two boundaries one array when they are one tensor): host work reads these, not the tensors."""
        cu_padded = self.cu_seqlens_padded.numpy()
        cu = cu_padded if self.cu_seqlens is self.cu_seqlens_padded else self.cu_seqlens.numpy()
        return self.padded_lengths.numpy(), cu_padded, cu

    @property
    def num_samples(self) -> int:
        return self.lengths.numel()

    @property
    def pad_overhead(self) -> float:
        """Physical over real tokens (1.0 = no pad)."""
        return self.total_tokens / self.num_real_tokens


def plan_layout(lengths: torch.Tensor, alignment: Alignment) -> PackLayout:
    """Place samples of the given real ``lengths`` (integer ``[N]``, host, each >= 1) into one aligned row.

    Raises:
        TypeError: ``lengths`` not an integer tensor, ``alignment`` not an :class:`Alignment`.
        ValueError: ``lengths`` on a device, not 1-D, empty or with a length below 1; a row above
            ``INT32_MAX`` tokens (``cu_seqlens`` are int32); a row longer than ``pad_total_to``.
    """
    if not isinstance(alignment, Alignment):
        raise TypeError(f"plan_layout's alignment is a {type(alignment).__name__}: pass a thdpack.Alignment")
    return layout_of(lengths, check_lengths(lengths), alignment)


def layout_of(lengths: torch.Tensor, real: np.ndarray, alignment: Alignment) -> PackLayout:
    """:func:`plan_layout` after its entrance checks, ``real`` being ``lengths`` as int64 numpy (for callers
    whose lengths are valid by construction, e.g. ``pack_bshd``'s segments)."""
    a = alignment
    num_real = int(real.sum())
    padded, body = a.row_tokens(real)
    total = -(-body // a.total_multiple) * a.total_multiple
    if total > INT32_MAX:
        raise ValueError(
            f"the packed row needs {total} tokens ({lengths.numel()} samples, {num_real} real tokens): cu_seqlens "
            f"are int32, so a packed row holds at most {INT32_MAX} tokens; send fewer tokens per micro-batch"
        )
    if a.pad_total_to is not None:
        if total > a.pad_total_to:
            raise ValueError(
                f"the packed batch needs {total} tokens but Alignment.pad_total_to={a.pad_total_to}: raise the "
                "bucket or send fewer tokens per micro-batch"
            )
        total = a.pad_total_to
    if total > body:
        padded = np.append(padded, total - body)
    # Attention spans the physical length unless distinct mode pads inside samples (CP); the trailing pad
    # segment attends to itself in full. Each real length is at most its padded one, so the two agree exactly
    # when their sums do.
    attn = None
    if a.mode == "distinct" and body != num_real:
        attn = real if total == body else np.append(real, total - body)
    real_t = lengths if lengths.dtype == torch.int64 else torch.from_numpy(real)
    return _layout(real_t, padded, attn, num_real, total)


def _layout(
    lengths: torch.Tensor, padded: np.ndarray, attn: np.ndarray | None, num_real: int, total: int
) -> PackLayout:
    """The :class:`PackLayout` of these int64 physical lengths ``[M]`` and attention lengths (None: the same as
    the physical ones), ``num_real`` and ``total`` being their sums (``total`` checked against ``INT32_MAX``)."""
    # numpy: these arrays are small and torch's per-op overhead would dominate the packing of a batch.
    cu_padded = cumsum0(padded, np.int32)
    # One object when equal: TE decides pad_between_seqs by identity (docs/design.md, "logical vs physical
    # boundaries").
    cu = cu_padded if attn is None else cumsum0(attn, np.int32)
    padded_t, cu_padded_t = torch.from_numpy(padded), torch.from_numpy(cu_padded)
    return PackLayout(
        lengths=lengths,
        padded_lengths=padded_t,
        attn_lengths=padded_t if attn is None else torch.from_numpy(attn),
        cu_seqlens=cu_padded_t if attn is None else torch.from_numpy(cu),
        cu_seqlens_padded=cu_padded_t,
        max_seqlen=int(padded.max()),
        total_tokens=total,
        num_real_tokens=num_real,
    )


def cumsum0(x, dtype=None):
    """``[0, x0, x0 + x1, ...]``: boundaries from lengths. A numpy array gives a numpy array (``dtype`` a numpy
    dtype), a tensor on any device gives a tensor there (``dtype`` a torch dtype); int64 by default."""
    if isinstance(x, np.ndarray):
        out = np.zeros(x.size + 1, dtype=dtype or np.int64)
        out[1:] = x.cumsum()
        return out
    out = torch.zeros(x.numel() + 1, dtype=dtype or torch.int64, device=x.device)
    out[1:] = torch.cumsum(x, dim=0)
    return out
