"""Helpers shared by the tests."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from thdpack import find_segments


def count_syncs(fn: Callable[[], object]) -> int:
    """Host-device syncs that ``fn()`` makes, counted with ``torch.cuda.set_sync_debug_mode("warn")``."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # Only torch's per-operation warning: its first use in a process also warns that the mode is a prototype.
    return sum("called a synchronizing CUDA operation" in str(w.message) for w in caught)


def segments_or_error(mask: torch.Tensor, position_ids: torch.Tensor | None = None):
    """find_segments' samples as lists, or its error message: two calls agree iff this is equal."""
    try:
        s = find_segments(mask, position_ids=position_ids)
        return s.row.tolist(), s.start.tolist(), s.length.tolist()
    except ValueError as e:
        return str(e)
