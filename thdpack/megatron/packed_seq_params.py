"""``THDPackedSeqParams``: Megatron-core's ``PackedSeqParams`` with the host copies of the boundaries declared.

Transformer Engine reads the device boundaries and never needs host values. A kernel that loops over samples on
the host (thdpack's torch attention: the per-sample SDPA and its CP gather order) needs them as host values, and
reading the device arrays back would cost a sync per layer: :func:`thd_packed_seq_params` fills both. Everything Megatron and TE read is inherited unchanged, so the TE path sees the same object it always did
(``cu_seqlens_q_padded is cu_seqlens_q`` when no pad lies between samples).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from thdpack.packing.packed_batch import PackedBatch

__all__ = ["THDPackedSeqParams", "thd_packed_seq_params"]


@dataclass
class THDPackedSeqParams(PackedSeqParams):
    """``PackedSeqParams(qkv_format="thd", ...)`` plus host copies of the (self-attention) boundaries.

    Attributes:
        cu_seqlens_q_host: int32 ``[M + 1]`` host tensor, the values of ``cu_seqlens_q`` (= ``cu_seqlens_kv``);
            None when unknown.
        cu_seqlens_q_padded_host: int32 ``[M + 1]`` host tensor, the values of ``cu_seqlens_q_padded``; the
            same object as ``cu_seqlens_q_host`` when the device arrays are one object.
    """

    cu_seqlens_q_host: torch.Tensor | None = None
    cu_seqlens_q_padded_host: torch.Tensor | None = None


def thd_packed_seq_params(packed: PackedBatch) -> THDPackedSeqParams:
    """Megatron-core ``PackedSeqParams(qkv_format="thd", ...)`` for a packed row: Megatron's fields, plus host
    copies of the boundaries for kernels that loop over samples on the host (thdpack's torch attention; reading
    the device arrays back would be a sync per layer).

    Follows the TE fast-path rule: when no pad lies between samples, ``cu_seqlens_q_padded`` is the very object
    ``cu_seqlens_q``, so TE does not set ``pad_between_seqs`` and FlashAttention stays eligible. Boundaries are
    global: on a CP shard every rank passes the same arrays and TE divides by ``cp_size``.
    """
    return THDPackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=packed.cu_seqlens,
        cu_seqlens_kv=packed.cu_seqlens,
        cu_seqlens_q_padded=packed.cu_seqlens_padded,
        cu_seqlens_kv_padded=packed.cu_seqlens_padded,
        max_seqlen_q=packed.max_seqlen,
        max_seqlen_kv=packed.max_seqlen,
        cu_seqlens_q_host=packed.layout.cu_seqlens,
        cu_seqlens_q_padded_host=packed.layout.cu_seqlens_padded,
    )
