"""``PackedBatch``: the THD data contract between the packer and the model.

One padding-free row (``[1, T]`` token tensors) and the metadata attention, RoPE/MRoPE and the MoE router need;
:func:`thdpack.megatron.packed_seq_params.thd_packed_seq_params` turns it into Megatron-core's
``PackedSeqParams``. What each field means,
and the rules behind it, are in docs/design.md ("logical vs physical boundaries", "CP partition", "syncs").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from .context_parallel import cp_partition_indices
from .layout import PackLayout
from .segments import Segments

__all__ = ["PackedBatch", "to_device"]


@dataclass
class PackedBatch:
    """One padding-free THD row and the metadata attention, RoPE/MRoPE and the MoE router need.

    ``T`` is ``total_tokens``, or ``total_tokens / cp_size`` after :meth:`shard_for_cp`. Token-aligned tensors
    live on the batch's device (where the packed ``tokens`` came from, or where :meth:`to` moved them); the
    boundary arrays travel with them but are global (never sharded); ``segments`` and ``layout`` stay on the host.

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

    ``M`` counts the samples and, when the row's total needed alignment pad, one trailing pad-only segment.
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
        """Move every tensor (boundary arrays included) to ``device``; ``cu_seqlens_padded is cu_seqlens`` is
        kept. Host metadata (``segments``, ``layout``) stays on the host."""
        device = torch.device(device)
        cu_padded = to_device(self.cu_seqlens_padded, device, non_blocking)
        cu = (
            cu_padded
            if self.cu_seqlens is self.cu_seqlens_padded
            else to_device(self.cu_seqlens, device, non_blocking)
        )
        return self._map_token_tensors(
            lambda t: to_device(t, device, non_blocking), cu_seqlens=cu, cu_seqlens_padded=cu_padded
        )

    def shard_for_cp(self, cp_size: int, cp_rank: int) -> PackedBatch:
        """This CP rank's zigzag shard: every token-aligned tensor sliced with :func:`cp_partition_indices`,
        the boundary arrays and ``max_seqlen`` unchanged (global)."""
        if self.cp_size != 1:
            raise ValueError(f"this batch is already CP rank {self.cp_rank} of {self.cp_size}")
        if cp_size == 1:
            return self
        index = cp_partition_indices(self.layout.cu_seqlens_padded, cp_size, cp_rank)
        index = to_device(index, self.tokens.device)
        return self._map_token_tensors(
            lambda t: t.index_select(t.dim() - 1, index), cp_size=cp_size, cp_rank=cp_rank
        )

    def _map_token_tensors(self, fn, **changes) -> PackedBatch:
        """A copy with ``fn`` applied to every token-aligned tensor (the fields of :meth:`token_tensors`)."""
        own = {name: fn(t) for name, t in self._own_token_tensors().items()}
        extra = {name: fn(t) for name, t in self.extra.items()}
        return dataclasses.replace(self, **own, extra=extra, **changes)


def to_device(t: torch.Tensor, device: torch.device, non_blocking: bool = True) -> torch.Tensor:
    """``t`` on ``device``: itself when already there; from the host to a GPU through pinned memory, so that a
    ``non_blocking`` copy stays asynchronous."""
    if t.device == device:
        return t
    if non_blocking and t.device.type == "cpu" and device.type == "cuda" and not t.is_pinned():
        # From pageable memory cudaMemcpyAsync first waits for the stream to drain (a hidden sync that torch's
        # sync-debug mode does not report); from pinned memory (torch caches the buffers) it stays async.
        t = t.pin_memory()
    return t.to(device, non_blocking=non_blocking)
