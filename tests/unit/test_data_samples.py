"""Specification of ``Sample`` and the length statistics."""

import numpy as np
import pytest

from thdpack.data import Sample, format_length_stats, length_stats


def test_plain_lm_sample_targets_every_token_but_the_first():
    assert Sample(np.arange(5), None, "x").num_targets == 4


def test_target_mask_counts_only_from_the_second_token():
    s = Sample(np.arange(4), np.array([True, False, True, True]), "x")
    assert s.num_targets == 2  # target_mask[0] is never used


def test_truncated_keeps_the_prefix_and_its_mask():
    s = Sample(np.arange(6), np.array([0, 0, 0, 1, 1, 1], bool), "f:3").truncated(4)
    assert s.tokens.tolist() == [0, 1, 2, 3]
    assert s.target_mask.tolist() == [False, False, False, True]
    assert s.source == "f:3"


def test_length_stats_buckets_are_powers_of_two():
    stats = length_stats([1, 2, 3, 4, 7, 8, 100])
    assert stats["buckets"] == {1: 1, 2: 2, 4: 2, 8: 1, 64: 1}
    assert (stats["samples"], stats["tokens"]) == (7, 125)


def test_length_stats_quantiles_are_observed_lengths():
    stats = length_stats([10, 20, 30, 40])
    assert stats["quantiles"][0.0] == 10
    assert stats["quantiles"][0.5] == 20
    assert stats["quantiles"][1.0] == 40


def test_length_stats_rejects_empty_samples():
    with pytest.raises(ValueError, match=">= 1"):
        length_stats([3, 0])


def test_format_length_stats_prints_each_bucket():
    text = format_length_stats(length_stats([1, 5, 5]))
    assert "[      4,       8)        2" in text
    assert "p50=5" in text
