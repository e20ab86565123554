"""The loader hands the packer the lengths it knows: ``seq_lengths`` [B] next to a right-padded batch gives the
PackedBatch the mask gives, without reading the mask; the metrics count a packed row's tokens from lengths."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from thdpack import Alignment, pack_bshd, plan_layout
from thdpack.data import Sample, collate


def right_padded(lengths, S, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths)
    mask = (torch.arange(S) < lengths[:, None]).long()
    return {
        "tokens": torch.randint(1, 100, (len(lengths), S), generator=g) * mask,
        "attention_mask": mask,
        "labels": torch.randint(-1, 100, (len(lengths), S), generator=g),
        "seq_lengths": lengths,
    }


def assert_same_packed(a, b):
    for name in (
        "tokens",
        "labels",
        "loss_mask",
        "position_ids",
        "padding_mask",
        "cu_seqlens",
        "cu_seqlens_padded",
    ):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert (a.cu_seqlens is a.cu_seqlens_padded) == (b.cu_seqlens is b.cu_seqlens_padded)
    assert a.max_seqlen == b.max_seqlen and a.source_shape == b.source_shape
    assert torch.equal(a.segments.row, b.segments.row) and torch.equal(a.segments.length, b.segments.length)


@pytest.mark.parametrize("alignment", [Alignment(), Alignment(cp_size=2), Alignment(cp_size=2, mode="fold")])
def test_lengths_and_mask_give_the_same_packed_batch(alignment):
    batch = right_padded([3, 1, 5], S=6)
    from_lengths = pack_bshd(batch, alignment=alignment)
    from_mask = pack_bshd({k: v for k, v in batch.items() if k != "seq_lengths"}, alignment=alignment)
    assert_same_packed(from_lengths, from_mask)


def test_with_lengths_the_mask_is_not_read():
    batch = right_padded([2, 4], S=4)
    batch["attention_mask"] = torch.full((2, 4), 7)  # segment ids the mask path would split differently
    packed = pack_bshd(batch)
    assert packed.cu_seqlens.tolist() == [0, 2, 6]


@pytest.mark.parametrize(
    ("lengths", "match"),
    [
        (
            torch.tensor([2, 0]),
            r"row 1 of seq_lengths is 0: each row holds one right-padded sample of 1 to S = 4",
        ),
        (torch.tensor([2, 5]), r"row 1 of seq_lengths is 5"),
        (torch.tensor([2]), r"batch key 'seq_lengths' is \[1\]: it must be \[B\] = \[2\]"),
        (torch.tensor([2.0, 3.0]), r"batch key 'seq_lengths' is torch.float32"),
    ],
)
def test_bad_lengths_are_named(lengths, match):
    batch = right_padded([2, 3], S=4)
    batch["seq_lengths"] = lengths
    with pytest.raises((ValueError, TypeError), match=match):
        pack_bshd(batch)


def test_the_collator_emits_each_row_s_length():
    samples = [Sample(np.arange(1, 4), None, "a"), Sample(np.arange(1, 2), None, "b")]
    batch = collate(samples, seq_length=5, pad_id=0)
    assert batch["seq_lengths"].tolist() == [3, 1]
    assert batch["attention_mask"].sum(1).tolist() == [3, 1]


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 50), min_size=1, max_size=8),
    cp=st.sampled_from([1, 2, 4]),
    tp=st.sampled_from([1, 2]),
    sp=st.booleans(),
    fp8=st.booleans(),
)
def test_total_tokens_from_lengths_is_the_planned_row(lengths, cp, tp, sp, fp8):
    alignment = Alignment(cp_size=cp, tp_size=tp, sequence_parallel=sp, fp8=fp8)
    lengths = np.array(lengths, dtype=np.int64)
    assert alignment.total_tokens(lengths) == plan_layout(torch.from_numpy(lengths), alignment).total_tokens
