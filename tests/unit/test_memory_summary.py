"""thdpack.training.metrics.memory_summary: a CUDA run's peak memory and the caching allocator's free-and-retry
count (each a hidden device synchronization), read from ``torch.cuda.memory_stats()``'s keys."""

from __future__ import annotations

from thdpack.training.metrics import memory_summary

GIB = 2**30


def test_peaks_in_gib_and_the_retry_count_come_from_the_allocator_statistics():
    stats = {
        "allocated_bytes.all.peak": 62 * GIB + GIB // 2,
        "reserved_bytes.all.peak": 66 * GIB,
        "num_alloc_retries": 3,
    }
    assert memory_summary(stats) == {"peak_memory_gib": 62.5, "peak_reserved_gib": 66.0, "alloc_retries": 3}


def test_statistics_without_a_retry_count_mean_no_retry():
    stats = {"allocated_bytes.all.peak": GIB, "reserved_bytes.all.peak": 2 * GIB}
    assert memory_summary(stats)["alloc_retries"] == 0
