"""Specification of ``collate``: right-padded BSHD micro-batches with Megatron's already-shifted labels."""

import numpy as np
import pytest
import torch

from thdpack import pack_bshd
from thdpack.data import IGNORE_INDEX, Sample, collate

X = IGNORE_INDEX
PAD = 0


def lm(*tokens):
    return Sample(np.array(tokens, dtype=np.int64), None, "test")


def sft(tokens, targets):
    return Sample(np.array(tokens, dtype=np.int64), np.array(targets, dtype=bool), "test")


def test_lm_labels_are_the_next_token_within_the_row():
    batch = collate([lm(5, 6, 7)], seq_length=5, pad_id=PAD)
    assert batch["tokens"].tolist() == [[5, 6, 7, PAD, PAD]]
    assert batch["labels"].tolist() == [[6, 7, X, X, X]]
    assert batch["loss_mask"].tolist() == [[1, 1, 0, 0, 0]]


def test_sft_labels_target_only_masked_tokens():
    # the Sample docstring's worked example: bos H i | Y o eos, loss on the response and its eos
    batch = collate([sft([1, 72, 105, 89, 111, 2], [0, 0, 0, 1, 1, 1])], seq_length=6, pad_id=PAD)
    assert batch["labels"].tolist() == [[X, X, 89, 111, 2, X]]
    assert batch["loss_mask"].tolist() == [[0, 0, 1, 1, 1, 0]]


def test_target_mask_of_the_first_token_is_ignored():
    batch = collate([sft([4, 5], [1, 0])], seq_length=2, pad_id=PAD)
    assert batch["labels"].tolist() == [[X, X]]


def test_rows_are_right_padded_with_a_prefix_attention_mask():
    batch = collate([lm(1, 2, 3), lm(4)], seq_length=4, pad_id=9)
    assert batch["tokens"].tolist() == [[1, 2, 3, 9], [4, 9, 9, 9]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]
    assert batch["labels"].tolist() == [[2, 3, X, X], [X, X, X, X]]


def test_dtypes_and_shapes():
    batch = collate([lm(1, 2), lm(3)], seq_length=8, pad_id=PAD, mrope=True)
    assert {k: (v.dtype, tuple(v.shape)) for k, v in batch.items()} == {
        "tokens": (torch.int64, (2, 8)),
        "labels": (torch.int64, (2, 8)),
        "loss_mask": (torch.float32, (2, 8)),
        "attention_mask": (torch.int64, (2, 8)),
        "seq_lengths": (torch.int64, (2,)),
        "mrope_position_ids": (torch.int64, (3, 2, 8)),
    }


def test_pad_to_longest_uses_the_longest_sample():
    batch = collate([lm(1, 2, 3), lm(4)], seq_length=100, pad_id=PAD, pad_to="longest")
    assert batch["tokens"].shape == (2, 3)


def test_loss_mask_is_labels_not_ignored():
    batch = collate([sft([1, 2, 3, 4], [0, 1, 0, 1]), lm(5, 6)], seq_length=5, pad_id=PAD)
    assert torch.equal(batch["loss_mask"], (batch["labels"] != X).float())


def test_mrope_ids_count_positions_on_every_axis_through_the_pad():
    ids = collate([lm(1, 2, 3), lm(4)], seq_length=4, pad_id=PAD, mrope=True)["mrope_position_ids"]
    assert ids.tolist() == [[[0, 1, 2, 3], [0, 1, 2, 3]]] * 3


def test_no_mrope_ids_unless_asked():
    assert "mrope_position_ids" not in collate([lm(1, 2)], seq_length=2, pad_id=PAD)


@pytest.mark.parametrize(
    ("samples", "match"),
    [
        ([], "at least one sample"),
        ([lm(1, 2, 3, 4)], r"row 0 \(test\).*seq_length \(3\)"),
        ([lm(1), Sample(np.zeros(0, np.int64), None, "f.jsonl:7")], r"row 1 \(f\.jsonl:7\)"),
        ([Sample(np.arange(3), np.ones(2, bool), "s")], "target_mask"),
    ],
)
def test_bad_samples_raise_naming_the_row(samples, match):
    with pytest.raises(ValueError, match=match):
        collate(samples, seq_length=3, pad_id=PAD)


def test_pad_to_must_be_known():
    with pytest.raises(ValueError, match="pad_to"):
        collate([lm(1)], seq_length=3, pad_id=PAD, pad_to="bucket")


def test_pack_bshd_keeps_every_real_token_and_label():
    batch = collate([sft([1, 2, 3, 4], [0, 0, 1, 1]), lm(5, 6, 7)], seq_length=6, pad_id=PAD)
    packed = pack_bshd(batch)
    assert packed.tokens.tolist() == [[1, 2, 3, 4, 5, 6, 7]]
    assert packed.labels.tolist() == [[X, 3, 4, X, 6, 7, X]]
    assert packed.loss_mask.tolist() == [[0, 1, 1, 0, 1, 1, 0]]
    assert packed.cu_seqlens.tolist() == [0, 4, 7]
