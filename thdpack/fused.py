"""The GPU side of :func:`thdpack.pack_bshd` and of :func:`thdpack.find_segments` in one Triton kernel each.

On a GPU-resident batch the torch path costs about a dozen small kernels and as many allocations per
call, and at the batch sizes of training that host-side overhead, not the GPU, is the packing time. The
packing kernel writes every token-aligned output of a packed row in one launch, from the per-segment table the
host computed (:func:`thdpack.pack._segment_table`): for packed position ``p`` it finds its segment by
binary search over the segment starts, then gathers the token, the label (or the next token) and the
loss mask from the source position, or writes pad. Nothing is read back to the host.

Used when Triton imports, the batch is on CUDA and the dtypes are the common ones (integer tokens and
labels, floating loss mask); ``THDPACK_FUSED=0`` turns it off. Otherwise the torch path runs; both give
identical results (``tests/unit/test_pack_gpu.py``).

A 0/1 mask on the GPU is reduced to per-row statistics by a second kernel (:func:`fused_row_stats`): one
launch and one device-to-host copy of a ``[7, B]`` table, in place of about fifteen torch kernels.
"""

from __future__ import annotations

import functools
import os

import torch

from ._triton_launch import fits_int32, launch

__all__ = ["fused_pack_available", "fused_pack", "fused_row_stats_available", "fused_row_stats"]

BLOCK = 1024
ROW_BLOCK = 1024  # columns of a mask row read per step by the row-statistics kernel


@functools.cache
def _kernel():
    # Imported on first use: Triton reads TRITON_INTERPRET when the kernel is defined.
    from ._pack_kernel import pack_kernel

    return pack_kernel


@functools.cache
def _row_stats_kernel():
    from ._mask_kernel import row_stats_kernel

    return row_stats_kernel


@functools.cache
def _triton_imports() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


def _enabled(t: torch.Tensor) -> bool:
    # Triton launches on the current device: a tensor on another GPU takes the torch path.
    return (
        t.is_cuda
        and os.environ.get("THDPACK_FUSED", "1") != "0"
        and _triton_imports()
        and t.device.index == torch.cuda.current_device()
    )


def fused_pack_available(
    tokens: torch.Tensor, labels: torch.Tensor | None, loss_mask: torch.Tensor | None
) -> bool:
    """Whether :func:`fused_pack` handles this batch (CUDA, Triton, integer tokens/labels, float loss mask)."""
    if not _enabled(tokens):
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
    table: torch.Tensor,
    num_segments: int,
    total_tokens: int,
    *,
    pad_token_id: int,
    ignore_index: int,
) -> tuple[torch.Tensor, ...]:
    """The packed row's ``(tokens, labels, loss_mask, position_ids, padding_mask, gather)``, each ``[1, T]``.

    ``table`` is a buffer on the batch's device whose first ``4 * M`` int64 values (``M = num_segments``) are
    four rows: each segment's packed start, flat source minus packed position, end of its real tokens, and
    1 where its last real token has no target. Its element type does not matter (the caller uploads the
    table and the boundary arrays in one buffer, and the kernel reads the table from its start).
    ``labels=None`` derives next-token labels. ``gather`` is the flat source of each position (0 on pad), for
    other tensors gathered the same way.

    Host cost is what this function is about (the kernel itself takes microseconds): three allocations, one
    ``unbind`` and the launch (:func:`thdpack._triton_launch.launch`, without the JIT's dispatch), with no
    reshapes of the inputs when they are contiguous.
    """
    device, T, M = tokens.device, total_tokens, num_segments
    # labels, position ids, gather (and the tokens, when they are int64) in one allocation.
    long_rows = torch.empty(4 if tokens.dtype == torch.int64 else 3, 1, T, dtype=torch.int64, device=device)
    out_labels, out_positions, out_gather, *out_tokens = long_rows.unbind(0)
    out_tokens = out_tokens[0] if out_tokens else torch.empty(1, T, dtype=tokens.dtype, device=device)
    out_loss_mask = torch.empty(1, T, dtype=torch.float32, device=device)
    out_pad = torch.empty(1, T, dtype=torch.bool, device=device)
    tokens = _contiguous(tokens)
    # Binary-search steps, rounded up to a multiple of 4 so that few variants are ever compiled.
    steps = -(-(M.bit_length() + 1) // 4) * 4
    launch(
        _kernel(),
        device.index,
        (
            tokens.dtype,
            None if labels is None else labels.dtype,
            None if loss_mask is None else loss_mask.dtype,
            table.dtype,
        ),
        -(-T // BLOCK),
        (
            tokens,
            tokens if labels is None else _contiguous(labels),
            out_loss_mask if loss_mask is None else _contiguous(loss_mask),
            table,
            out_tokens,
            long_rows,
            out_loss_mask,
            out_pad,
            T,
            M,
            int(pad_token_id),
            int(ignore_index),
        ),
        {"STEPS": steps, "DERIVE": labels is None, "HAS_LOSS_MASK": loss_mask is not None, "BLOCK": BLOCK},
        direct=fits_int32(T, M, pad_token_id, ignore_index),
    )
    return out_tokens, out_labels, out_loss_mask, out_positions, out_pad, out_gather


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    # The kernel indexes the [B, S] inputs as flat arrays.
    return t if t.is_contiguous() else t.contiguous()


_INTEGERS = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def fused_row_stats_available(mask: torch.Tensor, position_ids: torch.Tensor | None) -> bool:
    """Whether :func:`fused_row_stats` handles this ``[B, S]`` mask (CUDA, Triton, a common dtype)."""
    return (
        _enabled(mask)
        and mask.numel() > 0
        and (mask.dtype == torch.bool or mask.dtype in _INTEGERS or mask.is_floating_point())
        and (position_ids is None or (position_ids.device == mask.device and position_ids.dtype in _INTEGERS))
    )


def fused_row_stats(mask: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
    """Per-row statistics of a ``[B, S]`` mask, an int64 ``[7, B]`` tensor on the mask's device.

    Rows: the first real (non-zero) column (0 in a row without one), the number of real tokens, the number of
    runs of real tokens (more than one: a hole), and 0/1 for a ``position_ids`` value of 0 at a real token
    whose left neighbour is real (a sample restarts inside a run), a negative value, a value above 1 and a
    fractional or NaN value (floating masks only). Nothing is read back; the caller copies the table to the
    host once.
    """
    B, S = mask.shape
    kind = 0 if mask.dtype == torch.bool else 2 if mask.is_floating_point() else 1
    mask = _contiguous(mask.view(torch.uint8) if kind == 0 else mask)
    out = torch.empty(7, B, dtype=torch.int64, device=mask.device)
    positions = None if position_ids is None else _contiguous(position_ids)
    launch(
        _row_stats_kernel(),
        mask.device.index,
        (mask.dtype, None if positions is None else positions.dtype),
        B,
        (mask, mask if positions is None else positions, out, B, S),
        {"KIND": kind, "HAS_POSITIONS": positions is not None, "BLOCK": ROW_BLOCK},
        direct=fits_int32(B, S),
    )
    return out
