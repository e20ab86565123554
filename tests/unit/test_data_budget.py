"""Specification of token-budget micro-batches: hand-written cases for the rules, hypothesis for the
properties (every sample exactly once, budget respected, equal counts on every rank, determinism)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from thdpack.data import plan_microbatches, sample_cost


def test_cost_is_linear_plus_quadratic():
    assert sample_cost([2, 10], (1.0, 0.5)).tolist() == [2 + 2, 10 + 50]


def test_short_samples_share_a_micro_batch_up_to_the_budget():
    assert plan_microbatches([3, 3, 3, 3], dp_size=1, budget=6) == [[[0, 1], [2, 3]]]


def test_ranks_get_balanced_cost_and_the_same_count():
    # one long sample weighs as much as many short ones; the rank holding it still runs two micro-batches
    plan = plan_microbatches([4096] + [256] * 30, dp_size=2, budget=4096)
    assert [len(rank) for rank in plan] == [2, 2]
    tokens = [sum(4096 if i == 0 else 256 for mb in rank for i in mb) for rank in plan]
    assert abs(tokens[0] - tokens[1]) <= 512


def test_samples_of_a_micro_batch_keep_stream_order():
    for rank in plan_microbatches([5, 1, 4, 2, 3, 6], dp_size=2, budget=7):
        for mb in rank:
            assert mb == sorted(mb)


def test_a_rank_short_of_samples_borrows_the_smallest():
    # lengths 8, 8, 1, 1, 1 with budget 9 on 2 ranks: one rank must run 2 micro-batches, so both must
    plan = plan_microbatches([8, 8, 1, 1, 1], dp_size=2, budget=9)
    assert [len(rank) for rank in plan] == [2, 2]
    assert all(mb for rank in plan for mb in rank)  # no filler: 5 samples >= 2 ranks x 2


def test_a_filler_only_when_the_batch_has_too_few_samples():
    # 3 samples, 2 ranks, and no two of them fit together: 2 micro-batches each need 4 samples
    plan = plan_microbatches([10, 10, 1], dp_size=2, budget=10)
    assert sorted(len(mb) for rank in plan for mb in rank) == [0, 1, 1, 1]


def test_a_sample_longer_than_the_budget_is_named():
    with pytest.raises(ValueError, match="sample 1 has 9 tokens.*micro_batch_tokens \\(8\\)"):
        plan_microbatches([1, 9], dp_size=1, budget=8)


@st.composite
def batches(draw):
    budget = draw(st.integers(1, 64))
    lengths = draw(st.lists(st.integers(1, budget), min_size=1, max_size=60))
    dp = draw(st.integers(1, 6))
    return lengths, dp, budget


@settings(max_examples=300, deadline=None)
@given(batches())
def test_budget_plan_properties(batch):
    lengths, dp, budget = batch
    plan = plan_microbatches(lengths, dp, budget)
    assert len(plan) == dp
    counts = {len(rank) for rank in plan}
    assert len(counts) == 1 and counts.pop() >= 1  # the same number of micro-batches on every rank
    placed = sorted(i for rank in plan for mb in rank for i in mb)
    assert placed == list(range(len(lengths)))  # every sample exactly once, none split
    for rank in plan:
        for mb in rank:
            assert sum(lengths[i] for i in mb) <= budget
            assert mb == sorted(mb)
    fillers = sum(not mb for rank in plan for mb in rank)
    if len(lengths) >= dp * len(plan[0]):
        assert fillers == 0
    assert plan == plan_microbatches(list(lengths), dp, budget)  # deterministic


@settings(max_examples=200, deadline=None)
@given(batches())
def test_budget_plan_count_stays_near_the_token_bound(batch):
    # With cost = tokens, LPT leaves each rank at most the mean plus one budget of tokens, and first-fit bins
    # are more than half full but for one: K <= 2 * (mean + budget) / budget + 1.
    lengths, dp, budget = batch
    plan = plan_microbatches(lengths, dp, budget, cost_weights=(1.0, 0.0))
    assert len(plan[0]) <= 2 * sum(lengths) / (dp * budget) + 3


def test_plan_is_the_same_for_numpy_and_list_lengths():
    lengths = np.random.default_rng(0).integers(1, 100, 50)
    assert plan_microbatches(lengths, 3, 128) == plan_microbatches(lengths.tolist(), 3, 128)
