"""from_packed_batch: every published form of Megatron-Bridge and NeMo packed SFT batches, and their errors.

Each form's batch is written out by hand as its collate function builds it (the source named in each test), from
a small packed item: token ids 11.. / 21.. are samples, 2 is EOS (the offline forms' pad), -100 ignore_index.
"""

import pytest
import torch

from thdpack import from_packed_batch, unpack_thd

IGNORE = -100
I32 = torch.int32


def assert_real(p, tokens, labels, loss_mask):
    """The packed row's real tokens, their labels and loss mask, read back at their source positions."""
    real = ~p.padding_mask[0]
    assert p.tokens[0][real].tolist() == tokens
    assert p.labels[0][real].tolist() == labels
    assert p.loss_mask[0][real].tolist() == loss_mask


# ---------------------------------------------------------------------------------------------------------
# NeMo: GPTSFTPackedDataset.collate_fn, nemo/collections/nlp/data/language_modeling/megatron/gpt_sft_dataset.py
# (NeMo 1) and nemo/collections/llm/gpt/data/core.py (NeMo 2), the same code.


def nemo_batch():
    """Packed item input_ids [11 12 13 2 | 21 22 2], seq_boundaries [0, 4, 7], answer-only loss mask of ones,
    max_length 8 (pad_seq_length_to_mult 8). Inputs drop each sample's last stored token, labels its first."""
    return {
        "tokens": torch.tensor([[11, 12, 13, 21, 22, 2, 2, 2]]),
        "labels": torch.tensor([[12, 13, 2, 22, 2, 2, 2, 2]]),
        "loss_mask": torch.tensor([[1, 1, 1, 1, 1, 0, 0, 0]]),
        "position_ids": torch.tensor([[0, 1, 2, 0, 1, 0, 0, 0]]),
        "token_count": [5],
        "attention_mask": torch.tensor([1]),  # "no attention mask is needed for packed seq"
        "cu_seqlens": torch.tensor([[0, 3, 5, 8, -1]], dtype=I32),  # the fill [5, 8) appended as a slot
        "cu_seqlens_argmin": torch.tensor([[4]]),
        "max_seqlen": torch.tensor([[3]], dtype=I32),
        "cu_seqlens_unpadded": torch.tensor([[0, 3, 5, 5, -1]], dtype=I32),  # the fill: zero real tokens
        "cu_seqlens_unpadded_argmin": torch.tensor([[4]]),
    }


def test_nemo_form_trailing_fill_slot_becomes_the_pad_segment():
    p = from_packed_batch(nemo_batch())
    assert p.cu_seqlens_padded.tolist() == [0, 3, 5, 8]
    assert p.cu_seqlens is p.cu_seqlens_padded  # no pad between samples: TE keeps FlashAttention
    assert p.segments.length.tolist() == [3, 2] and p.num_real_tokens == 5
    assert p.padding_mask.int().tolist() == [[0, 0, 0, 0, 0, 1, 1, 1]]


def test_nemo_form_keeps_each_samples_last_label():
    # Labels are built inside each sample: 13 -> 2 (EOS) is sample 0's own last target, not sample 1's first token.
    p = from_packed_batch(nemo_batch())
    assert p.labels.tolist() == [[12, 13, 2, 22, 2, IGNORE, IGNORE, IGNORE]]
    assert p.loss_mask.tolist() == [[1, 1, 1, 1, 1, 0, 0, 0]]


def test_nemo_form_with_cp_prepadding_follows_the_logical_boundaries():
    # Items pre-padded with EOS to a multiple of 2*cp = 4: [11 12 2 2 2 | 21 2 2 2 2], boundaries [0, 5, 10],
    # answer_only_loss=False (loss 0 on EOS). NeMo's logical length ends at a sample's second EOS.
    batch = {
        "tokens": torch.tensor([[11, 12, 2, 2, 21, 2, 2, 2]]),
        "labels": torch.tensor([[12, 2, 2, 2, 2, 2, 2, 2]]),
        "loss_mask": torch.tensor([[1, 1, 0, 0, 1, 0, 0, 0]]),
        "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]]),
        "token_count": [8],
        "attention_mask": torch.tensor([1]),
        "cu_seqlens": torch.tensor([[0, 4, 8, -1]], dtype=I32),
        "cu_seqlens_argmin": torch.tensor([[3]]),
        "max_seqlen": torch.tensor([[4]], dtype=I32),
        "cu_seqlens_unpadded": torch.tensor([[0, 4, 7, -1]], dtype=I32),
        "cu_seqlens_unpadded_argmin": torch.tensor([[3]]),
    }
    p = from_packed_batch(batch)
    assert p.cu_seqlens_padded.tolist() == [0, 4, 8] and p.cu_seqlens.tolist() == [0, 4, 7]
    assert_real(p, [11, 12, 2, 2, 21, 2, 2], [12, 2, 2, 2, 2, 2, 2], [1, 1, 0, 0, 1, 0, 0])


def test_nemo_pad_cu_seqlens_adds_zero_length_physical_slots_only():
    # pad_cu_seqlens (CUDA graphs): cu_seqlens padded with the width to max_samples_per_bin + 2 entries, the
    # logical array not; max_seqlen the dataset's static bound.
    batch = nemo_batch()
    batch["cu_seqlens"] = torch.tensor([[0, 3, 5, 8, 8, 8, -1]], dtype=I32)
    batch["cu_seqlens_argmin"] = torch.tensor([[6]])
    batch["max_seqlen"] = torch.tensor([[6]], dtype=I32)
    p = from_packed_batch(batch)
    assert p.cu_seqlens_padded.tolist() == [0, 3, 5, 8]
    assert p.max_seqlen == 3  # exact; the given 6 is an upper bound
    assert p.labels.tolist() == [[12, 13, 2, 22, 2, IGNORE, IGNORE, IGNORE]]


# ---------------------------------------------------------------------------------------------------------
# Megatron-Bridge, legacy: GPTSFTPackedDataset.collate_fn in src/megatron/bridge/data/datasets/sft.py (until
# July 2026). cu_seqlens_unpadded only with pad_seq_to_mult > 1; attention_mask None.


def bridge_legacy_batch():
    """The NeMo item above; Bridge's legacy collate also zeroes the loss mask on EOS tokens."""
    batch = nemo_batch()
    del batch["cu_seqlens_unpadded"], batch["cu_seqlens_unpadded_argmin"]
    batch["attention_mask"] = None
    return batch


def test_bridge_legacy_form_token_count_tells_the_fill_slot():
    p = from_packed_batch(bridge_legacy_batch())
    assert p.cu_seqlens_padded.tolist() == [0, 3, 5, 8]
    assert p.padding_mask.int().tolist() == [[0, 0, 0, 0, 0, 1, 1, 1]]
    assert p.labels.tolist() == [[12, 13, 2, 22, 2, IGNORE, IGNORE, IGNORE]]


def test_bridge_legacy_form_without_token_count_keeps_the_fill_as_a_slot():
    # Nothing in the batch tells the fill from a sample (Bridge's attention treats it as one): it stays a slot.
    batch = bridge_legacy_batch()
    del batch["token_count"]
    p = from_packed_batch(batch)
    assert p.segments.length.tolist() == [3, 2, 3]
    assert not p.padding_mask.any()
    assert p.loss_mask.tolist() == [[1, 1, 1, 1, 1, 0, 0, 0]]


def test_bridge_legacy_form_with_pad_seq_to_mult_and_a_trailing_fill_slot():
    # The case: pad_seq_to_mult = 4, a row shorter than the width (pad_to_max_length, 12). Items
    # [11 12 13 2 2 | 21 22 2 2 2], answer-only loss mask [0 1 1 1 0 | 0 1 1 0 0]; logical length = last
    # non-EOS + 1; the fill [8, 12) a slot with zero real tokens.
    batch = {
        "tokens": torch.tensor([[11, 12, 13, 2, 21, 22, 2, 2, 2, 2, 2, 2]]),
        "labels": torch.tensor([[12, 13, 2, 2, 22, 2, 2, 2, 2, 2, 2, 2]]),
        "loss_mask": torch.tensor([[0, 1, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0]]),
        "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 0, 0, 0, 0]]),
        "token_count": [8],
        "attention_mask": None,
        "cu_seqlens": torch.tensor([[0, 4, 8, 12, -1]], dtype=I32),
        "cu_seqlens_argmin": torch.tensor([[4]]),
        "max_seqlen": torch.tensor([[4]], dtype=I32),
        "cu_seqlens_unpadded": torch.tensor([[0, 3, 5, 5, -1]], dtype=I32),
        "cu_seqlens_unpadded_argmin": torch.tensor([[4]]),
    }
    p = from_packed_batch(batch)
    assert p.cu_seqlens_padded.tolist() == [0, 4, 8, 12]
    assert p.cu_seqlens.tolist() == [0, 3, 5, 9]  # the trailing pad segment attends to itself in full
    assert p.labels.tolist() == [[12, 13, 2, IGNORE, 22, 2] + [IGNORE] * 6]
    assert_real(p, [11, 12, 13, 21, 22], [12, 13, 2, 22, 2], [0, 1, 1, 0, 1])


def test_bridge_audio_form_without_sentinel_uses_argmin_equal_to_the_length():
    # src/megatron/bridge/training/audio_lm_step.py: in-batch packing, cu_seqlens_argmin = len(cu_seqlens).
    batch = {
        "tokens": torch.tensor([[11, 12, 21, 22, 23]]),
        "cu_seqlens": torch.tensor([0, 2, 5], dtype=I32),
        "cu_seqlens_argmin": torch.tensor(3),
    }
    p = from_packed_batch(batch)
    assert p.cu_seqlens_padded.tolist() == [0, 2, 5]
    assert p.labels.tolist() == [[12, IGNORE, 22, 23, IGNORE]]  # derived within each sample


# ---------------------------------------------------------------------------------------------------------
# Megatron-Bridge, current offline packing: GPTSFTPackedDataset.collate_fn in
# src/megatron/bridge/data/packing/gpt_sft.py (its tests: tests/unit_tests/data/datasets/test_gpt_sft.py).


def test_bridge_offline_form_fill_slot_inside_cu_seqlens_q_is_told_by_padding_mask():
    # test_collate_fn_marks_offline_trailing_padding_without_alignment: item [10 11 12 2], width 8.
    batch = {
        "tokens": torch.tensor([[10, 11, 12, 2, 2, 2, 2, 2]]),
        "labels": torch.tensor([[11, 12, 2, 2, 2, 2, 2, 2]]),
        "loss_mask": torch.tensor([[1, 1, 1, 0, 0, 0, 0, 0]]),
        "position_ids": torch.tensor([[0, 1, 2, 0, 0, 0, 0, 0]]),
        "token_count": [3],
        "padding_mask": torch.tensor([[False, False, False, True, True, True, True, True]]),
        "attention_mask": None,
        "cu_seqlens_q": torch.tensor([[0, 3, 8]], dtype=I32),
        "max_seqlen_q": torch.tensor([[5]], dtype=I32),
        "max_seqlen_kv": torch.tensor([[5]], dtype=I32),
    }
    batch["cu_seqlens_kv"] = batch["cu_seqlens_q"]
    p = from_packed_batch(batch)
    assert p.segments.length.tolist() == [3]
    assert p.cu_seqlens_padded.tolist() == [0, 3, 8]
    assert torch.equal(p.padding_mask, batch["padding_mask"])
    assert "padding_mask" not in p.extra
    assert p.labels.tolist() == [[11, 12, 2] + [IGNORE] * 5]


def test_bridge_offline_form_with_alignment_gaps():
    # test_collate_fn_marks_offline_alignment_padding: pad_seq_to_mult = 4, items [10 11 12 2 2 | 20 21 2 2 2]
    # (the prepared loss mask is 0 on the alignment pad, as offline.py pads it).
    batch = {
        "tokens": torch.tensor([[10, 11, 12, 2, 20, 21, 2, 2]]),
        "labels": torch.tensor([[11, 12, 2, 2, 21, 2, 2, 2]]),
        "loss_mask": torch.tensor([[1, 1, 1, 0, 1, 1, 0, 0]]),
        "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]]),
        "token_count": [8],
        "padding_mask": torch.tensor([[False, False, False, True, False, False, True, True]]),
        "attention_mask": None,
        "cu_seqlens_q": torch.tensor([[0, 3, 5]], dtype=I32),
        "cu_seqlens_q_padded": torch.tensor([[0, 4, 8]], dtype=I32),
        "max_seqlen_q": torch.tensor([[4]], dtype=I32),
        "max_seqlen_kv": torch.tensor([[4]], dtype=I32),
    }
    batch["cu_seqlens_kv"], batch["cu_seqlens_kv_padded"] = (
        batch["cu_seqlens_q"],
        batch["cu_seqlens_q_padded"],
    )
    p = from_packed_batch(batch)
    assert p.cu_seqlens.tolist() == [0, 3, 5] and p.cu_seqlens_padded.tolist() == [0, 4, 8]
    assert torch.equal(p.padding_mask, batch["padding_mask"])
    assert_real(p, [10, 11, 12, 20, 21], [11, 12, 2, 21, 2], [1, 1, 1, 1, 1])


def test_bridge_offline_form_rows_filled_by_repeating_the_last_boundary():
    # test_collate_fn_supports_different_sequence_counts, second row once split to micro-batch size 1.
    batch = {
        "tokens": torch.tensor([[30, 31, 32, 33, 34, 35, 36]]),
        "labels": torch.tensor([[31, 32, 33, 34, 35, 36, 37]]),
        "loss_mask": torch.ones(1, 7, dtype=torch.long),
        "padding_mask": torch.zeros(1, 7, dtype=torch.bool),
        "cu_seqlens_q": torch.tensor([[0, 7, 7, 7]], dtype=I32),
        "max_seqlen_q": torch.tensor([[7]], dtype=I32),
    }
    p = from_packed_batch(batch)
    assert p.cu_seqlens_padded.tolist() == [0, 7] and p.labels[0, -1] == 37


def test_bridge_offline_form_without_padding_mask_token_count_marks_the_trailing_fill():
    # GPTSFTPackedDataset.collate_fn with pad_seq_to_mult = 1, collated without padding_mask (before Bridge PR
    # 5470 added it): item [10 11 12 13 14 15 16 2] gives 7 inputs in a row of width 8; the collate appends the
    # one-token fill [7, 8) to cu_seqlens_q and writes token_count = 7. Bridge marks [7, 8) as padding.
    batch = {
        "tokens": torch.tensor([[10, 11, 12, 13, 14, 15, 16, 2]]),
        "labels": torch.tensor([[11, 12, 13, 14, 15, 16, 2, 2]]),
        "loss_mask": torch.tensor([[1, 1, 1, 1, 1, 1, 1, 0]]),
        "position_ids": torch.tensor([[0, 1, 2, 3, 4, 5, 6, 0]]),
        "token_count": [7],
        "attention_mask": None,
        "cu_seqlens_q": torch.tensor([[0, 7, 8]], dtype=I32),
        "max_seqlen_q": torch.tensor([[7]], dtype=I32),
        "max_seqlen_kv": torch.tensor([[7]], dtype=I32),
    }
    batch["cu_seqlens_kv"] = batch["cu_seqlens_q"]
    p = from_packed_batch(batch)
    assert p.segments.length.tolist() == [7]
    assert p.padding_mask.int().tolist() == [[0, 0, 0, 0, 0, 0, 0, 1]]
    assert p.labels.tolist() == [[11, 12, 13, 14, 15, 16, 2, IGNORE]]


def test_bridge_offline_global_batch_of_rows_with_different_sample_counts_is_adopted_side_by_side():
    # test_collate_fn_supports_different_sequence_counts, collated as Bridge's test collates it (two rows, width 7):
    # row 0 holds [10 11 12] [20 21 22] and a one-token fill, row 1 one sample of 7; boundaries filled by repeats.
    batch = {
        "tokens": torch.tensor([[10, 11, 12, 20, 21, 22, 2], [30, 31, 32, 33, 34, 35, 36]]),
        "labels": torch.tensor([[11, 12, 13, 21, 22, 23, 2], [31, 32, 33, 34, 35, 36, 37]]),
        "loss_mask": torch.tensor([[1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1]]),
        "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 0], [0, 1, 2, 3, 4, 5, 6]]),
        "token_count": [6, 7],
        "padding_mask": torch.tensor([[False] * 6 + [True], [False] * 7]),
        "attention_mask": None,
        "cu_seqlens_q": torch.tensor([[0, 3, 6, 7], [0, 7, 7, 7]], dtype=I32),
        "cu_seqlens_kv": torch.tensor([[0, 3, 6, 7], [0, 7, 7, 7]], dtype=I32),
        "max_seqlen_q": torch.tensor([[3], [7]], dtype=I32),
        "max_seqlen_kv": torch.tensor([[3], [7]], dtype=I32),
    }
    p = from_packed_batch(batch)
    # row 0's fill is the tail of its last sample's slot, marked as pad; row 1 follows
    assert p.cu_seqlens.tolist() == [0, 3, 6, 13] and p.cu_seqlens_padded.tolist() == [0, 3, 7, 14]
    assert p.padding_mask.tolist() == [[False] * 6 + [True] + [False] * 7]
    assert_real(
        p, [10, 11, 12, 20, 21, 22, *range(30, 37)], [11, 12, 13, 21, 22, 23, *range(31, 38)], [1] * 13
    )


def test_bridge_offline_rows_without_padding_mask_take_the_fill_from_token_count():
    batch = {
        "tokens": torch.tensor([[10, 11, 12, 2], [20, 21, 22, 23]]),
        "labels": torch.tensor([[11, 12, 2, 2], [21, 22, 23, 24]]),
        "token_count": [3, 4],
        "cu_seqlens_q": torch.tensor([[0, 3, 4], [0, 4, 4]], dtype=I32),
    }
    p = from_packed_batch(batch)
    assert p.cu_seqlens.tolist() == [0, 3, 7] and p.cu_seqlens_padded.tolist() == [0, 4, 8]
    assert p.padding_mask.int().tolist() == [[0, 0, 0, 1, 0, 0, 0, 0]]


def test_bridge_offline_fill_inside_the_last_declared_sequence_is_marked_as_pad():
    # test_collate_fn_marks_offline_trailing_padding_without_alignment's row with the fill inside the last
    # declared sequence ([0, 8]), told by padding_mask or by token_count: the sample's slot keeps the fill as pad.
    for told in ({"padding_mask": torch.tensor([[False] * 3 + [True] * 5])}, {"token_count": [3]}):
        batch = {
            "tokens": torch.tensor([[10, 11, 12, 2, 2, 2, 2, 2]]),
            "labels": torch.tensor([[11, 12, 2, 2, 2, 2, 2, 2]]),
            "loss_mask": torch.tensor([[1, 1, 1, 0, 0, 0, 0, 0]]),
            "cu_seqlens_q": torch.tensor([[0, 8]], dtype=I32),
            **told,
        }
        p = from_packed_batch(batch)
        assert p.cu_seqlens.tolist() == [0, 3] and p.cu_seqlens_padded.tolist() == [0, 8]
        assert p.padding_mask.tolist() == [[False] * 3 + [True] * 5]
        assert p.labels.tolist() == [[11, 12, 2] + [IGNORE] * 5]


# ---------------------------------------------------------------------------------------------------------
# Megatron-Bridge, in-batch packing: build_mcore_thd_sequence_batch_from_rows in
# src/megatron/bridge/data/packing/in_batch.py (used by src/megatron/bridge/data/collators/sft.py).


def test_bridge_in_batch_form_with_a_fixed_width():
    # test_direct_rows_can_pad_final_pack_to_fixed_width: rows [1 2 3] and [4 5], sequence_length 8,
    # pad_to_max_length: the last sample's physical slot widened to the width.
    ids = torch.tensor([[1, 2, 3, 4, 5, 0, 0, 0]])
    cu = torch.tensor([0, 3, 5], dtype=I32)
    cu_padded = torch.tensor([0, 3, 8], dtype=I32)
    batch = {
        "input_ids": ids,
        "tokens": ids,
        "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]]),
        "labels": torch.tensor([[2, 3, IGNORE, 5, IGNORE, IGNORE, IGNORE, IGNORE]]),
        "loss_mask": torch.tensor([[1.0, 1, 0, 1, 0, 0, 0, 0]]),
        "attention_mask": None,
        "cu_seqlens_q": cu,
        "cu_seqlens_kv": cu,
        "cu_seqlens_q_padded": cu_padded,
        "cu_seqlens_kv_padded": cu_padded,
        "max_seqlen_q": torch.tensor(5, dtype=I32),
        "max_seqlen_kv": torch.tensor(5, dtype=I32),
        "total_tokens": 8,
        "metadata": [{"id": "a"}, {"id": "b"}],
        "token_count": [3, 2],
    }
    p = from_packed_batch(batch)
    assert p.cu_seqlens.tolist() == [0, 3, 5] and p.cu_seqlens_padded.tolist() == [0, 3, 8]
    assert p.max_seqlen == 5 and p.extra == {}
    assert_real(p, [1, 2, 3, 4, 5], [2, 3, IGNORE, 5, IGNORE], [1, 1, 0, 1, 0])


def test_bridge_in_batch_form_with_cp_alignment_and_padding_mask():
    # pad_to_multiple_of = 4 (CP 2), emit_padding_mask: rows [1 2 3] and [4 5] each padded to 4.
    batch = {
        "input_ids": torch.tensor([[1, 2, 3, 0, 4, 5, 0, 0]]),
        "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]]),
        "labels": torch.tensor([[2, 3, IGNORE, IGNORE, 5, IGNORE, IGNORE, IGNORE]]),
        "loss_mask": torch.tensor([[1.0, 1, 0, 0, 1, 0, 0, 0]]),
        "padding_mask": torch.tensor([[False, False, False, True, False, False, True, True]]),
        "cu_seqlens_q": torch.tensor([0, 3, 5], dtype=I32),
        "cu_seqlens_q_padded": torch.tensor([0, 4, 8], dtype=I32),
        "max_seqlen_q": torch.tensor(4, dtype=I32),
        "total_tokens": 8,
    }
    p = from_packed_batch(batch)
    assert p.cu_seqlens.tolist() == [0, 3, 5] and p.cu_seqlens_padded.tolist() == [0, 4, 8]
    assert p.shard_for_cp(2, 0).tokens.tolist() == [
        [1, 0, 4, 0]
    ]  # TE's zigzag: chunks 0 and 3 of each sample


# ---------------------------------------------------------------------------------------------------------
# Megatron-Bridge's and Megatron-LM's readers of packed batches: what they accept, thdpack adopts.


def test_boundaries_under_leading_batch_dimensions_are_squeezed():
    # Bridge tests/unit_tests/training/test_gpt_step.py, test_packed_seq_params_batch_dimension_removal:
    # cu_seqlens [1, 1, 4] and max_seqlen [1, 1, 1]; get_packed_seq_params squeezes them to [0, 6, 12] and 20.
    batch = {
        "tokens": torch.arange(1, 13).view(1, 12),
        "cu_seqlens": torch.tensor([[[0, 6, 12, -1]]], dtype=I32),
        "max_seqlen": torch.tensor([[[20]]], dtype=I32),
    }
    p = from_packed_batch(batch)
    assert p.cu_seqlens_padded.tolist() == [0, 6, 12]
    assert p.max_seqlen == 6  # exact; the given 20 is an upper bound


def test_loss_mask_on_positions_the_boundaries_declare_pad_is_zeroed():
    # Megatron-LM megatron/core/datasets/data_schedule.py, get_batch_on_this_rank_for_sequence_packing: the
    # padding mask built from cu_seqlens / cu_seqlens_padded zeroes loss_mask there (_sanitize_thd_padding_values).
    batch = bridge_batch()  # samples [0, 3) and [4, 6) in slots of 4; position 3 and 6.. are pad
    batch["loss_mask"] = torch.ones(1, 10, dtype=torch.long)
    p = from_packed_batch(batch)
    assert p.loss_mask.tolist() == [[1, 1, 1, 0, 1, 1, 0, 0, 0, 0]]
    assert p.labels.tolist() == [[12, 13, 14, IGNORE, 22, 23] + [IGNORE] * 4]


# ---------------------------------------------------------------------------------------------------------
# Properties shared by the forms, and the errors.


def bridge_batch():
    """Two samples (3 and 2 real tokens) padded to 4 each, 2 tokens after the last boundary, sentinels after."""
    tokens = torch.tensor([[11, 12, 13, 0, 21, 22, 0, 0, 0, 0]])
    return {
        "tokens": tokens,
        "labels": torch.tensor([[12, 13, 14, 0, 22, 23, 0, 0, 0, 0]]),
        "loss_mask": torch.tensor([[1, 1, 1, 0, 1, 1, 0, 0, 0, 0]]),
        "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 0, 1]]),
        "cu_seqlens": torch.tensor([[0, 4, 8, -1, -1]], dtype=I32),
        "cu_seqlens_unpadded": torch.tensor([[0, 3, 5, -1, -1]], dtype=I32),
        "cu_seqlens_argmin": torch.tensor([[3]]),
        "cu_seqlens_unpadded_argmin": torch.tensor([[3]]),
        "max_seqlen": torch.tensor([[4]], dtype=I32),
    }


def test_tokens_after_the_last_boundary_become_a_pad_segment():
    p = from_packed_batch(bridge_batch())
    assert p.cu_seqlens_padded.tolist() == [0, 4, 8, 10]
    assert p.cu_seqlens.tolist() == [0, 3, 5, 7]
    assert p.padding_mask.int().tolist() == [[0, 0, 0, 1, 0, 0, 1, 1, 1, 1]]
    assert p.max_seqlen == 4 and p.num_real_tokens == 5


def test_sentinels_found_without_argmin():
    batch = bridge_batch()
    del batch["cu_seqlens_argmin"], batch["cu_seqlens_unpadded_argmin"]
    assert from_packed_batch(batch).cu_seqlens_padded.tolist() == [0, 4, 8, 10]


def test_without_labels_they_are_derived_within_each_sample():
    batch = bridge_batch()
    del batch["labels"]
    assert from_packed_batch(batch).labels.tolist() == [[12, 13, IGNORE, IGNORE, 22, IGNORE] + [IGNORE] * 4]


def test_negative_labels_are_no_target():
    batch = bridge_batch()
    batch["labels"] = torch.tensor([[-1, 13, 14, 0, 22, 23, 0, 0, 0, 0]])
    p = from_packed_batch(batch)
    assert p.loss_mask.tolist() == [[0, 1, 1, 0, 1, 1, 0, 0, 0, 0]]


def test_unpack_round_trips_the_packed_row():
    p = from_packed_batch(bridge_batch())
    assert unpack_thd(p.tokens, p, pad_value=-1).tolist() == [[11, 12, 13, -1, 21, 22, -1, -1, -1, -1]]
    assert unpack_thd(p.labels, p, pad_value=-1).tolist() == [[12, 13, 14, -1, 22, 23, -1, -1, -1, -1]]


def test_boundaries_on_a_gpu_are_refused_with_the_reason(monkeypatch):
    batch = bridge_batch()
    fake = batch["cu_seqlens"]
    monkeypatch.setattr(type(fake), "device", property(lambda self: torch.device("cuda", 0)), raising=False)
    with pytest.raises(ValueError, match="boundary arrays on the host so that it needs no device sync"):
        from_packed_batch(batch)


def test_logical_sample_longer_than_its_slot_is_an_error():
    batch = bridge_batch()
    batch["cu_seqlens_unpadded"] = torch.tensor([[0, 5, 6, -1, -1]])
    with pytest.raises(ValueError, match="sample 0 has 5 real tokens .* in a physical slot of 4"):
        from_packed_batch(batch)


def test_decreasing_boundaries_are_an_error():
    batch = bridge_batch()
    batch["cu_seqlens"] = torch.tensor([[0, 8, 4, -1, -1]])
    with pytest.raises(ValueError, match=r"'cu_seqlens' decreases at index 2 \(8 then 4\)"):
        from_packed_batch(batch)


def test_token_key_of_wrong_length_is_an_error():
    batch = bridge_batch()
    batch["labels"] = torch.zeros(1, 9, dtype=torch.long)
    with pytest.raises(ValueError, match=r"batch key 'labels' is \[1, 9\] but 'tokens' is \[1, 10\]"):
        from_packed_batch(batch)


def test_argmin_that_is_not_the_first_sentinel_is_an_error():
    batch = bridge_batch()
    batch["cu_seqlens_argmin"] = torch.tensor([[2]])
    with pytest.raises(
        ValueError, match="'cu_seqlens_argmin' is 2 but 'cu_seqlens' has its first sentinel at index 3"
    ):
        from_packed_batch(batch)


def test_boundary_after_a_sentinel_is_an_error():
    batch = bridge_batch()
    batch["cu_seqlens"] = torch.tensor([[0, 4, -1, 8, -1]])
    del batch["cu_seqlens_argmin"]
    with pytest.raises(ValueError, match="'cu_seqlens' has 8 at index 3, after a sentinel at index 2"):
        from_packed_batch(batch)


def test_fill_slot_before_a_sample_is_an_error():
    batch = bridge_batch()
    batch["cu_seqlens_unpadded"] = torch.tensor([[0, 0, 2, -1, -1]])
    with pytest.raises(
        ValueError, match="slot 0 .* has no real token but a later slot has: fill slots must be trailing"
    ):
        from_packed_batch(batch)


def test_both_naming_conventions_is_an_error():
    batch = bridge_batch()
    batch["cu_seqlens_q"] = torch.tensor([0, 3, 5], dtype=I32)
    with pytest.raises(ValueError, match="a packed batch uses one convention"):
        from_packed_batch(batch)


def test_kv_boundaries_other_than_q_are_an_error():
    batch = {"tokens": torch.ones(1, 4, dtype=torch.long), "cu_seqlens_q": torch.tensor([0, 2, 4])}
    batch["cu_seqlens_kv"] = torch.tensor([0, 1, 4])
    with pytest.raises(ValueError, match="'cu_seqlens_kv' differs from 'cu_seqlens_q'"):
        from_packed_batch(batch)


def test_padding_mask_that_disagrees_with_the_boundaries_is_an_error():
    batch = bridge_batch()
    batch["padding_mask"] = torch.zeros(1, 10, dtype=torch.bool)
    with pytest.raises(
        ValueError, match="'padding_mask' marks position 3 as a real token but the boundaries make it pad"
    ):
        from_packed_batch(batch)


def test_padding_mask_with_a_hole_inside_a_slot_is_an_error():
    # Without logical boundaries the mask decides each slot's real tokens: they come first in their slot.
    batch = {
        "tokens": torch.tensor([[1, 2, 3, 4]]),
        "cu_seqlens_q": torch.tensor([0, 4]),
        "padding_mask": torch.tensor([[False, True, False, True]]),
    }
    with pytest.raises(
        ValueError, match="'padding_mask' marks position 1 as pad but the boundaries make it a real"
    ):
        from_packed_batch(batch)


def test_boundaries_of_several_rows_are_an_error_that_says_to_split():
    batch = bridge_batch()
    batch["cu_seqlens"] = torch.tensor([[[0, 4, 8, -1, -1]], [[0, 4, 8, -1, -1]]], dtype=I32)
    with pytest.raises(ValueError, match=r"'cu_seqlens' is \[2, 1, 5\]: .* split a global batch row by row"):
        from_packed_batch(batch)


def test_max_seqlen_below_a_slot_is_an_error():
    batch = bridge_batch()
    batch["max_seqlen"] = torch.tensor([[3]])
    with pytest.raises(ValueError, match="max_seqlen is 3 but sample 0 spans 4 tokens"):
        from_packed_batch(batch)


def test_total_tokens_other_than_the_row_is_an_error():
    batch = bridge_batch()
    batch["total_tokens"] = 12
    with pytest.raises(ValueError, match="'total_tokens' is 12 but the row holds 10 tokens"):
        from_packed_batch(batch)


def test_several_rows_are_an_error_that_says_to_split():
    batch = bridge_batch()
    batch = {k: torch.cat([v, v]) for k, v in batch.items()}
    with pytest.raises(ValueError, match=r"'tokens' is \[2, 10\]: a packed batch is one row"):
        from_packed_batch(batch)


def test_a_real_attention_mask_is_an_error():
    batch = bridge_batch()
    batch["attention_mask"] = torch.ones(1, 10)
    with pytest.raises(
        ValueError, match="'attention_mask' is \\[1, 10\\]: a packed batch's samples are its boundaries"
    ):
        from_packed_batch(batch)


def test_negative_token_id_is_an_error_naming_its_column():
    batch = bridge_batch()
    batch["tokens"] = torch.tensor([[11, 12, 13, 0, 21, -22, 0, 0, 0, 0]])
    with pytest.raises(
        ValueError, match="row 0 of 'tokens' has -22 at column 5, a real token: token ids must be >= 0"
    ):
        from_packed_batch(batch)


def test_position_ids_that_do_not_restart_are_an_error():
    batch = bridge_batch()
    batch["position_ids"] = torch.arange(10).view(1, 10)
    with pytest.raises(ValueError, match="row 0 of position_ids has 4 at column 4, where sample 1 starts"):
        from_packed_batch(batch)
