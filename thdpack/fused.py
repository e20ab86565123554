"""The GPU side of :func:`thdpack.pack_bshd` in one Triton kernel.

On a GPU-resident batch the torch path costs about a dozen small kernels and as many allocations per
call, and at the batch sizes of training that host-side overhead, not the GPU, is the packing time. This
kernel writes every token-aligned output of a packed row in one launch, from the per-segment table the
host computed (:func:`thdpack.pack._segment_table`): for packed position ``p`` it finds its segment by
binary search over the segment starts, then gathers the token, the label (or the next token) and the
loss mask from the source position, or writes pad. Nothing is read back to the host.

Used when Triton imports, the batch is on CUDA and the dtypes are the common ones (integer tokens and
labels, floating loss mask); ``THDPACK_FUSED=0`` turns it off. Otherwise the torch path runs; both give
identical results (``tests/unit/test_pack_gpu.py``).
"""

from __future__ import annotations

import functools
import os

import torch

__all__ = ["fused_pack_available", "fused_pack"]

BLOCK = 1024


@functools.cache
def _kernel():
    # Imported on first use: Triton reads TRITON_INTERPRET when the kernel is defined.
    from ._pack_kernel import pack_kernel

    return pack_kernel


@functools.cache
def _triton_imports() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


def fused_pack_available(
    tokens: torch.Tensor, labels: torch.Tensor | None, loss_mask: torch.Tensor | None
) -> bool:
    """Whether :func:`fused_pack` handles this batch (CUDA, Triton, integer tokens/labels, float loss mask)."""
    if tokens.device.type != "cuda" or os.environ.get("THDPACK_FUSED", "1") == "0" or not _triton_imports():
        return False
    integer = (torch.int64, torch.int32)
    return (
        tokens.dtype in integer
        and (labels is None or labels.dtype in integer)
        and (loss_mask is None or loss_mask.is_floating_point())
    )


def fused_pack(
    tokens: torch.Tensor,
    labels: torch.Tensor | None,
    loss_mask: torch.Tensor | None,
    seg_start: torch.Tensor,
    shift: torch.Tensor,
    real_end: torch.Tensor,
    end_flag: torch.Tensor,
    total_tokens: int,
    *,
    pad_token_id: int,
    ignore_index: int,
) -> tuple[torch.Tensor, ...]:
    """The packed row's ``(tokens, labels, loss_mask, position_ids, padding_mask, gather)``, each ``[T]``.

    ``seg_start``, ``shift``, ``real_end`` and ``end_flag`` are int64 ``[M]`` on the batch's device: each
    segment's packed start, flat source minus packed position, end of its real tokens, and 1 where its
    last real token has no target. ``labels=None`` derives next-token labels. ``gather`` is the flat
    source of each position (0 on pad), for other tensors gathered the same way.
    """
    device, T, M = tokens.device, total_tokens, seg_start.numel()
    out_tokens = torch.empty(T, dtype=tokens.dtype, device=device)
    out_long = torch.empty(3, T, dtype=torch.int64, device=device)  # labels, positions, gather
    out_loss_mask = torch.empty(T, dtype=torch.float32, device=device)
    out_pad = torch.empty(T, dtype=torch.bool, device=device)
    flat = tokens.reshape(-1)
    _kernel()[(-(-T // BLOCK),)](
        flat,
        flat if labels is None else labels.reshape(-1),
        out_loss_mask if loss_mask is None else loss_mask.reshape(-1),
        seg_start,
        shift,
        real_end,
        end_flag,
        out_tokens,
        out_long[0],
        out_loss_mask,
        out_long[1],
        out_pad,
        out_long[2],
        T,
        M,
        pad_token_id,
        ignore_index,
        # Binary-search steps, rounded up to a multiple of 4 so that few variants are ever compiled.
        STEPS=-(-(M.bit_length() + 1) // 4) * 4,
        DERIVE=labels is None,
        HAS_LOSS_MASK=loss_mask is not None,
        BLOCK=BLOCK,
    )
    return out_tokens, out_long[0], out_loss_mask, out_long[1], out_pad, out_long[2]
