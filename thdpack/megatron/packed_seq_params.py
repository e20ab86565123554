"""``THDPackedSeqParams``: Megatron-core's ``PackedSeqParams`` with the host copies of the boundaries declared.

Transformer Engine reads the device boundaries and never needs host values. A kernel that loops over samples on
the host (thdpack's torch attention: the per-sample SDPA and its CP gather order) needs them as host values, and
reading the device arrays back would cost a sync per layer: :meth:`thdpack.PackedBatch.packed_seq_params` fills
both. Everything Megatron and TE read is inherited unchanged, so the TE path sees the same object it always did
(``cu_seqlens_q_padded is cu_seqlens_q`` when no pad lies between samples).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams

__all__ = ["THDPackedSeqParams"]


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
