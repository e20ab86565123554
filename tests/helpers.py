"""Helpers shared by the tests."""

from __future__ import annotations

from collections.abc import Callable

import torch

from thdpack import find_segments
from thdpack.training.profiling import catch_syncs


def count_syncs(fn: Callable[[], object]) -> int:
    """Host-device syncs that ``fn()`` makes (``thdpack.training.profiling.catch_syncs``)."""
    with catch_syncs() as sites:
        fn()
    return len(sites)


def segments_or_error(mask: torch.Tensor, position_ids: torch.Tensor | None = None):
    """find_segments' samples as lists, or its error message: two calls agree iff this is equal."""
    try:
        s = find_segments(mask, position_ids=position_ids)
        return s.row.tolist(), s.start.tolist(), s.length.tolist()
    except ValueError as e:
        return str(e)
