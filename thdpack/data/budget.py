"""Token-budget micro-batches: cut one global batch into micro-batches of at most ``budget`` tokens, the same
number on every data-parallel rank, ranks balanced by compute cost. Pure host arithmetic on lengths, the same
result on every rank without communication.

Algorithm (each step keeps every sample whole and in exactly one micro-batch):

1. cost of a sample ``a * L + b * L**2`` (linear layers plus causal attention; see ``DEFAULT_COST_WEIGHTS``);
2. ranks: samples by cost, largest first, each to the rank with the least cost so far (LPT greedy);
3. micro-batches per rank: first-fit decreasing by length into bins of ``budget`` tokens;
4. equal counts: ``K`` = the most bins any rank needs. A rank with fewer bins splits its fullest bin (most
   samples) in two until it has ``K``; a rank with fewer than ``K`` samples takes the smallest sample of
   the rank with the most samples (which has a bin of two or more: it loses no bin); only when the global
   batch holds fewer than ``dp_size * K`` samples is a micro-batch left empty (a *filler*: the loader
   puts one fully masked pad token there, so every rank still runs ``K`` forward/backward passes).

Within a micro-batch samples keep stream order (ascending index); a rank's micro-batches are ordered by their
first sample.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

__all__ = ["DEFAULT_COST_WEIGHTS", "plan_microbatches", "sample_cost"]

# Cost in units of "linear-layer work per token": a = 1, b = attention work per token per token of context.
# Forward FLOPs of a sample of L tokens: 2 * N * L (N params) + 2 * layers * hidden * L**2 (causal QK^T and
# AV). So b / a = layers * hidden / N: Llama-3.2-1B gives 16 * 2048 / 1.24e9 = 2.6e-5; we round up to
# 1 / 32768 = 3.05e-5 because attention kernels reach lower utilization than GEMMs.
DEFAULT_COST_WEIGHTS = (1.0, 1.0 / 32768)


def sample_cost(lengths, weights: Sequence[float] = DEFAULT_COST_WEIGHTS) -> np.ndarray:
    """float64 ``[N]``: ``a * L + b * L**2`` for ``weights = (a, b)``."""
    L = np.asarray(lengths, dtype=np.float64)
    return weights[0] * L + weights[1] * L * L


def plan_microbatches(
    lengths: Sequence[int] | np.ndarray,
    dp_size: int,
    budget: int,
    cost_weights: Sequence[float] = DEFAULT_COST_WEIGHTS,
) -> list[list[list[int]]]:
    """Assign the samples of one global batch to ranks and micro-batches.

    Args:
        lengths: int ``[N]`` tokens per sample, each ``1 <= L <= budget``.
        dp_size: data-parallel ranks.
        budget: most tokens (sum of lengths) in one micro-batch.
        cost_weights: ``(a, b)`` of :func:`sample_cost`.

    Returns:
        ``plan[rank][m]``: the sample indices (ascending) of micro-batch ``m`` of ``rank``; every ``plan[rank]``
        has the same length ``K >= 1``. An empty list is a filler (only when ``N < dp_size * K``).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if dp_size < 1:
        raise ValueError(f"dp_size is {dp_size}: it must be >= 1")
    bad = np.flatnonzero((lengths < 1) | (lengths > budget))
    if bad.size:
        raise ValueError(
            f"sample {bad[0]} has {lengths[bad[0]]} tokens: every sample needs 1 to micro_batch_tokens ({budget})"
        )
    ranks = _assign_ranks(sample_cost(lengths, cost_weights), dp_size)
    bins = [_first_fit_decreasing(members, lengths, budget) for members in ranks]
    count = max(1, max(len(b) for b in bins))
    for rank_bins in bins:
        while len(rank_bins) < count and any(len(b) >= 2 for b in rank_bins):
            _split_fullest(rank_bins, lengths)
    _borrow_for_short_ranks(bins, count, lengths)
    return [
        sorted((sorted(b) for b in rank_bins), key=lambda b: b[0] if b else len(lengths))
        for rank_bins in bins
    ]


def _assign_ranks(cost: np.ndarray, dp_size: int) -> list[list[int]]:
    """LPT: largest cost first (ties: lower index), each to the least-loaded rank (ties: lower rank)."""
    order = np.argsort(-cost, kind="stable")
    heap = [(0.0, rank) for rank in range(dp_size)]
    ranks: list[list[int]] = [[] for _ in range(dp_size)]
    for i in order.tolist():
        load, rank = heapq.heappop(heap)
        ranks[rank].append(i)
        heapq.heappush(heap, (load + float(cost[i]), rank))
    return ranks


def _first_fit_decreasing(members: list[int], lengths: np.ndarray, budget: int) -> list[list[int]]:
    bins: list[list[int]] = []
    free: list[int] = []
    for i in sorted(members, key=lambda i: (-lengths[i], i)):
        for b, room in enumerate(free):
            if lengths[i] <= room:
                bins[b].append(i)
                free[b] -= int(lengths[i])
                break
        else:
            bins.append([i])
            free.append(budget - int(lengths[i]))
    return bins


def _split_fullest(rank_bins: list[list[int]], lengths: np.ndarray) -> None:
    """Split the bin with the most samples (ties: first) into two, alternating its samples by length, so the
    halves carry similar token counts. Both halves are subsets of a bin that fit: the budget still holds."""
    b = max(range(len(rank_bins)), key=lambda b: (len(rank_bins[b]), -b))
    members = sorted(rank_bins[b], key=lambda i: (-lengths[i], i))
    rank_bins[b] = members[0::2]
    rank_bins.append(members[1::2])


def _borrow_for_short_ranks(bins: list[list[list[int]]], count: int, lengths: np.ndarray) -> None:
    """Give every rank ``count`` micro-batches: a rank with fewer samples than ``count`` takes the smallest
    sample (from the bin with the most samples) of the rank holding the most samples; fillers when none has
    more than ``count``."""
    for rank_bins in bins:
        while len(rank_bins) < count:
            donor = max(range(len(bins)), key=lambda r: (sum(len(b) for b in bins[r]), -r))
            if sum(len(b) for b in bins[donor]) <= count:
                rank_bins.append([])  # filler: the global batch has fewer than dp_size * count samples
                continue
            # The donor has more samples than bins, so its fullest bin holds two or more: it keeps every bin.
            source = max(bins[donor], key=len)
            smallest = min(source, key=lambda i: (lengths[i], -i))
            source.remove(smallest)
            rank_bins.append([smallest])
