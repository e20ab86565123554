"""from_packed_batch: Megatron-Bridge / NeMo packed batches with -1 sentinels."""

import pytest
import torch

from thdpack import from_packed_batch, unpack_thd

IGNORE = -100


def bridge_batch():
    """Two samples (3 and 2 real tokens) padded to 4 each, 2 trailing pad tokens, sentinels after."""
    tokens = torch.tensor([[11, 12, 13, 0, 21, 22, 0, 0, 0, 0]])
    return {
        "tokens": tokens,
        "labels": torch.tensor([[12, 13, 14, 0, 22, 23, 0, 0, 0, 0]]),
        "loss_mask": torch.tensor([[1, 1, 1, 0, 1, 1, 0, 0, 0, 0]]),
        "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 0, 1]]),
        "cu_seqlens": torch.tensor([[0, 4, 8, -1, -1]], dtype=torch.int32),
        "cu_seqlens_unpadded": torch.tensor([[0, 3, 5, -1, -1]], dtype=torch.int32),
        "cu_seqlens_argmin": torch.tensor([[3]]),
        "cu_seqlens_unpadded_argmin": torch.tensor([[3]]),
        "max_seqlen": torch.tensor([[4]], dtype=torch.int32),
    }


def test_sentinels_are_trimmed_and_trailing_tokens_become_a_pad_segment():
    p = from_packed_batch(bridge_batch())
    assert p.cu_seqlens_padded.tolist() == [0, 4, 8, 10]
    assert p.cu_seqlens.tolist() == [0, 3, 5, 7]
    assert p.padding_mask.int().tolist() == [[0, 0, 0, 1, 0, 0, 1, 1, 1, 1]]
    assert p.max_seqlen == 4 and p.num_real_tokens == 5


def test_labels_kept_except_pad_and_targets_crossing_into_the_next_sample():
    p = from_packed_batch(bridge_batch())
    # label 14 of sample 0's last token may be sample 1's first token: one row holds both, so it is masked
    assert p.labels.tolist() == [[12, 13, IGNORE, IGNORE, 22, 23, IGNORE, IGNORE, IGNORE, IGNORE]]
    assert p.loss_mask.tolist() == [[1, 1, 0, 0, 1, 1, 0, 0, 0, 0]]


def test_sentinels_found_without_argmin():
    batch = bridge_batch()
    del batch["cu_seqlens_argmin"], batch["cu_seqlens_unpadded_argmin"]
    assert from_packed_batch(batch).cu_seqlens_padded.tolist() == [0, 4, 8, 10]


def test_without_unpadded_boundaries_logical_equals_physical():
    batch = bridge_batch()
    del batch["cu_seqlens_unpadded"], batch["cu_seqlens_unpadded_argmin"]
    p = from_packed_batch(batch)
    assert p.cu_seqlens is p.cu_seqlens_padded


def test_array_without_sentinel_is_used_whole():
    batch = bridge_batch()
    batch["cu_seqlens"] = torch.tensor([0, 4, 8, 10])
    batch["cu_seqlens_unpadded"] = torch.tensor([0, 3, 5, 7])
    del batch["cu_seqlens_argmin"], batch["cu_seqlens_unpadded_argmin"]
    p = from_packed_batch(batch)
    assert p.cu_seqlens_padded.tolist() == [0, 4, 8, 10]
    assert p.segments.length.tolist() == [3, 5 - 3, 2]


def test_unpack_round_trips_the_packed_row():
    p = from_packed_batch(bridge_batch())
    assert unpack_thd(p.tokens, p, pad_value=-1).tolist() == [[11, 12, 13, -1, 21, 22, -1, -1, -1, -1]]


def test_boundaries_on_a_gpu_are_refused_with_the_reason(monkeypatch):
    batch = bridge_batch()
    fake = batch["cu_seqlens"]
    monkeypatch.setattr(type(fake), "device", property(lambda self: torch.device("cuda", 0)), raising=False)
    with pytest.raises(ValueError, match="boundary arrays on the host so that it needs no device sync"):
        from_packed_batch(batch)


def test_logical_sample_longer_than_its_slot_is_an_error():
    batch = bridge_batch()
    batch["cu_seqlens_unpadded"] = torch.tensor([[0, 5, 6, -1, -1]])
    with pytest.raises(ValueError, match="sample 0 has 5 real tokens in a physical slot of 4"):
        from_packed_batch(batch)


def test_decreasing_boundaries_are_an_error():
    batch = bridge_batch()
    batch["cu_seqlens"] = torch.tensor([[0, 8, 4, -1, -1]])
    with pytest.raises(ValueError, match="is not a valid boundary array for 10 tokens"):
        from_packed_batch(batch)


def test_token_key_of_wrong_length_is_an_error():
    batch = bridge_batch()
    batch["labels"] = torch.zeros(1, 9, dtype=torch.long)
    with pytest.raises(ValueError, match=r"batch key 'labels' is \[1, 9\], expected \[1, 10\]"):
        from_packed_batch(batch)
