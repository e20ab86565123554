"""pack_bshd / unpack_thd / PackedBatch on small hand-written batches."""

import dataclasses

import numpy as np
import pytest
import torch

from thdpack import Alignment, PackedBatch, Segments, find_segments, pack_bshd, unpack_thd

IGNORE = -100


def design_example_batch():
    """docs/design.md's TE example ("logical vs physical boundaries"): samples a a a | b b | c c c c."""
    tokens = torch.tensor([[11, 12, 13, 0], [21, 22, 0, 0], [31, 32, 33, 34]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    return {"tokens": tokens, "attention_mask": mask}


def test_no_alignment_concatenates_real_tokens_only():
    p = pack_bshd(design_example_batch())
    assert p.tokens.tolist() == [[11, 12, 13, 21, 22, 31, 32, 33, 34]]
    assert p.cu_seqlens.tolist() == [0, 3, 5, 9]
    assert p.cu_seqlens_padded is p.cu_seqlens
    assert p.max_seqlen == 4 and isinstance(p.max_seqlen, int)
    assert not p.padding_mask.any()


def test_cp2_distinct_pads_each_sample_to_2cp():
    p = pack_bshd(design_example_batch(), alignment=Alignment(cp_size=2))
    assert p.tokens.tolist() == [[11, 12, 13, 0, 21, 22, 0, 0, 31, 32, 33, 34]]
    assert p.cu_seqlens.tolist() == [0, 3, 5, 9]
    assert p.cu_seqlens_padded.tolist() == [0, 4, 8, 12]
    assert p.cu_seqlens_padded is not p.cu_seqlens
    assert p.padding_mask.int().tolist() == [[0, 0, 0, 1, 0, 0, 1, 1, 0, 0, 0, 0]]
    assert p.rope_cu_seqlens is p.cu_seqlens_padded


@pytest.mark.parametrize("tail", [0, 4])  # with a trailing pad segment (tp=6 under SP: total 12) and without
def test_cp2_distinct_without_pad_between_samples_keeps_one_boundary_object(tail):
    # Every sample already a multiple of 2cp: distinct mode pads nothing between samples, so the logical and
    # physical boundaries are the same object (the TE fast-path rule).
    batch = {
        "tokens": torch.arange(1, 13).view(2, 6),
        "attention_mask": torch.tensor([[1] * 4 + [0] * 2, [1] * 4 + [0] * 2]),
    }
    alignment = Alignment(cp_size=2, tp_size=6 if tail else 1, sequence_parallel=bool(tail))
    p = pack_bshd(batch, alignment=alignment)
    assert p.cu_seqlens_padded.tolist() == [0, 4, 8] + ([8 + tail] if tail else [])
    assert p.cu_seqlens_padded is p.cu_seqlens


def test_cp2_fold_makes_pad_part_of_its_sample():
    p = pack_bshd(design_example_batch(), alignment=Alignment(cp_size=2, mode="fold"))
    assert p.cu_seqlens.tolist() == [0, 4, 8, 12]
    assert p.cu_seqlens_padded is p.cu_seqlens
    assert p.padding_mask.int().tolist() == [[0, 0, 0, 1, 0, 0, 1, 1, 0, 0, 0, 0]]


@pytest.mark.parametrize("mode", ["distinct", "fold"])
def test_host_arrays_are_the_tensors_memory(mode):
    # Host work reads Segments.arrays and PackLayout.arrays instead of converting tensors; what find_segments and
    # plan_layout prime must be the tensors' own memory, and a copy made another way (dataclasses.replace)
    # computes the same from its tensors.
    p = pack_bshd(design_example_batch(), alignment=Alignment(cp_size=2, mode=mode))
    layout = p.layout
    for made in (p.segments, dataclasses.replace(p.segments)):
        for array, tensor in zip(made.arrays, (made.row, made.start, made.length), strict=True):
            assert np.shares_memory(array, tensor.numpy()) and array.tolist() == tensor.tolist()
    for made in (layout, dataclasses.replace(layout)):
        padded, cu_padded, cu = made.arrays
        tensors = (made.padded_lengths, made.cu_seqlens_padded, made.cu_seqlens)
        for array, tensor in zip((padded, cu_padded, cu), tensors, strict=True):
            assert np.shares_memory(array, tensor.numpy()) and array.tolist() == tensor.tolist()
        assert (cu is cu_padded) == (made.cu_seqlens is made.cu_seqlens_padded) == (mode == "fold")


def test_boundary_arrays_are_int32_and_tokens_int64():
    p = pack_bshd(design_example_batch(), alignment=Alignment(cp_size=2))
    assert p.cu_seqlens.dtype == p.cu_seqlens_padded.dtype == torch.int32
    assert p.tokens.dtype == p.labels.dtype == p.position_ids.dtype == torch.int64
    assert p.loss_mask.dtype == torch.float32 and p.padding_mask.dtype == torch.bool


def test_sequence_parallel_total_goes_to_one_trailing_pad_segment():
    # 9 real tokens, tp=4 with SP: total must be a multiple of 4 -> 3 pad tokens in one trailing segment.
    p = pack_bshd(design_example_batch(), alignment=Alignment(tp_size=4, sequence_parallel=True))
    assert p.total_tokens == 12
    assert p.cu_seqlens_padded.tolist() == [0, 3, 5, 9, 12]
    # The trailing pad segment attends to itself, so no pad lies between samples: one object.
    assert p.cu_seqlens is p.cu_seqlens_padded
    assert p.padding_mask.int().tolist() == [[0] * 9 + [1] * 3]


def test_fp8_pads_the_total_to_16_per_rank():
    p = pack_bshd(design_example_batch(), alignment=Alignment(fp8=True))
    assert p.total_tokens == 16


def test_pad_total_to_gives_a_fixed_bucket():
    p = pack_bshd(design_example_batch(), alignment=Alignment(pad_total_to=32))
    assert p.total_tokens == 32 and p.tokens.shape == (1, 32)
    assert p.max_seqlen == 23  # the trailing pad segment is the longest physical segment


def test_pad_total_to_too_small_is_an_error():
    with pytest.raises(ValueError, match=r"needs 12 tokens but Alignment.pad_total_to=8"):
        pack_bshd(design_example_batch(), alignment=Alignment(cp_size=2, pad_total_to=8))


def test_pad_total_to_must_respect_alignment():
    with pytest.raises(ValueError, match="must be a multiple of 4"):
        Alignment(cp_size=2, pad_total_to=10)


@pytest.mark.parametrize("kwargs", [{"cp_size": 0}, {"tp_size": -1}, {"mode": "bogus"}])
def test_bad_alignment_is_an_error(kwargs):
    with pytest.raises(ValueError, match="Alignment"):
        Alignment(**kwargs)


def test_position_ids_restart_per_sample_and_pad_continues_counting():
    p = pack_bshd(design_example_batch(), alignment=Alignment(cp_size=2))
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3]]


def test_labels_derived_within_each_sample():
    p = pack_bshd(design_example_batch(), alignment=Alignment(cp_size=2))
    assert p.labels.tolist() == [[12, 13, IGNORE, IGNORE, 22, IGNORE, IGNORE, IGNORE, 32, 33, 34, IGNORE]]
    assert p.loss_mask.tolist() == [[1, 1, 0, 0, 1, 0, 0, 0, 1, 1, 1, 0]]


def test_given_labels_are_kept_and_pad_gets_ignore_index():
    batch = design_example_batch()
    batch["labels"] = torch.tensor([[12, 13, 99, 0], [22, 98, 0, 0], [32, 33, 34, 97]])
    p = pack_bshd(batch, alignment=Alignment(cp_size=2))
    assert p.labels.tolist() == [[12, 13, 99, IGNORE, 22, 98, IGNORE, IGNORE, 32, 33, 34, 97]]


def test_cross_sample_target_in_a_shared_row_is_masked():
    # Row 0 holds two samples (segment ids); the Megatron-shifted label of 'a2' is 'b1', the next sample's first
    # token: it must become ignore_index with loss mask 0 (torchtitan #4075, Unsloth #8959).
    tokens = torch.tensor([[1, 2, 5, 6, 7, 0]])
    labels = torch.tensor([[2, 5, 6, 7, 8, 0]])
    mask = torch.tensor([[1, 1, 2, 2, 2, 0]])
    p = pack_bshd({"tokens": tokens, "labels": labels, "attention_mask": mask})
    assert p.labels.tolist() == [[2, IGNORE, 6, 7, 8]]
    assert p.loss_mask.tolist() == [[1, 0, 1, 1, 1]]


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.uint8, torch.float32, torch.bfloat16])
def test_given_loss_mask_is_gathered_and_zeroed_on_pad(dtype):
    batch = design_example_batch()
    batch["labels"] = batch["tokens"].roll(-1, 1)
    batch["loss_mask"] = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 1, 1]]).to(dtype)
    p = pack_bshd(batch, alignment=Alignment(cp_size=2))
    assert p.loss_mask.dtype == torch.float32
    assert p.loss_mask.tolist() == [[0, 1, 1, 0, 1, 1, 0, 0, 0, 0, 1, 1]]


def test_loss_mask_is_zero_where_given_labels_are_ignore_index():
    batch = design_example_batch()
    batch["labels"] = torch.tensor([[IGNORE, 13, 14, 0], [22, 23, 0, 0], [32, 33, 34, IGNORE]])
    p = pack_bshd(batch)
    assert p.loss_mask.tolist() == [[0, 1, 1, 1, 1, 1, 1, 1, 0]]


def test_extra_bsh_tensors_are_gathered_like_tokens():
    batch = design_example_batch()
    batch["weights"] = torch.arange(12.0).view(3, 4)
    p = pack_bshd(batch, alignment=Alignment(cp_size=2))
    assert p.extra["weights"].tolist() == [[0, 1, 2, 0, 4, 5, 0, 0, 8, 9, 10, 11]]


@pytest.mark.parametrize("view", ["strided", "transposed"])
def test_non_contiguous_inputs_are_read_in_row_major_order(view):
    batch = design_example_batch()
    batch["labels"] = batch["tokens"] + 100
    batch["loss_mask"] = torch.arange(12.0).view(3, 4)
    batch["weights"] = torch.arange(12.0).view(3, 4).to(torch.bfloat16)  # gathered by torch, not numpy

    def non_contiguous(t):
        if view == "strided":
            wide = torch.zeros(t.shape[0], 2 * t.shape[1], dtype=t.dtype)
            wide[:, ::2] = t
            return wide[:, ::2]
        return t.t().contiguous().t()

    given = {k: non_contiguous(v) for k, v in batch.items()}
    assert not any(t.is_contiguous() for t in given.values())
    expected = pack_bshd(batch, alignment=Alignment(cp_size=2))
    got = pack_bshd(given, alignment=Alignment(cp_size=2))
    for name, t in expected.token_tensors().items():
        assert torch.equal(got.token_tensors()[name], t), name


def test_input_ids_is_accepted_for_tokens():
    batch = design_example_batch()
    batch["input_ids"] = batch.pop("tokens")
    assert pack_bshd(batch).tokens.tolist() == [[11, 12, 13, 21, 22, 31, 32, 33, 34]]


def test_mrope_ids_are_gathered_per_sample():
    batch = design_example_batch()
    t = torch.tensor([[0, 1, 1, 9], [0, 1, 9, 9], [0, 0, 1, 2]])
    batch["mrope_position_ids"] = torch.stack([t, t + 10, t + 20])
    p = pack_bshd(batch, alignment=Alignment(cp_size=2))
    assert p.mrope_position_ids.shape == (3, 1, 12)
    # real tokens keep their ids; alignment pad takes the packed 1-D position on all axes
    assert p.mrope_position_ids[0, 0].tolist() == [0, 1, 1, 3, 0, 1, 2, 3, 0, 0, 1, 2]
    assert p.mrope_position_ids[1, 0].tolist() == [10, 11, 11, 3, 10, 11, 2, 3, 10, 10, 11, 12]


def test_wrong_shaped_key_is_an_error_naming_it():
    batch = design_example_batch()
    batch["images"] = torch.zeros(3, 4, 5)
    with pytest.raises(
        ValueError,
        match=r"batch key 'images' is \[3, 4, 5\] but 'tokens' is \[3, 4\]: pack_bshd gathers every other",
    ):
        pack_bshd(batch)


def test_missing_mask_is_an_error():
    with pytest.raises(ValueError, match="needs 'attention_mask' or 'position_ids'"):
        pack_bshd({"tokens": torch.ones(2, 3, dtype=torch.long)})


def test_both_tokens_and_input_ids_is_an_error():
    with pytest.raises(ValueError, match="both 'tokens' and 'input_ids'"):
        pack_bshd(
            {"tokens": torch.ones(1, 2), "input_ids": torch.ones(1, 2), "attention_mask": torch.ones(1, 2)}
        )


def test_given_segments_skip_mask_reading():
    batch = design_example_batch()
    segs = find_segments(batch.pop("attention_mask"))
    assert pack_bshd(batch, segments=segs).tokens.tolist() == [[11, 12, 13, 21, 22, 31, 32, 33, 34]]


def test_given_segments_that_do_not_fit_are_an_error():
    segs = Segments(row=torch.tensor([5]), start=torch.tensor([0]), length=torch.tensor([1]))
    with pytest.raises(ValueError, match="does not fit a batch of shape"):
        pack_bshd({"tokens": torch.ones(3, 4, dtype=torch.long)}, segments=segs)


def test_unpack_restores_real_positions_and_fills_pad():
    batch = design_example_batch()
    p = pack_bshd(batch, alignment=Alignment(cp_size=2))
    out = unpack_thd(p.tokens, p, pad_value=-1)
    assert out.tolist() == [[11, 12, 13, -1], [21, 22, -1, -1], [31, 32, 33, 34]]


def test_unpack_accepts_flat_tensors_with_feature_dims():
    p = pack_bshd(design_example_batch())
    x = torch.arange(9 * 2.0).view(9, 2)
    out = unpack_thd(x, p)
    assert out.shape == (3, 4, 2)
    assert out[1, 1].tolist() == [8.0, 9.0] and out[1, 2].tolist() == [0.0, 0.0]


def test_unpack_of_a_wrong_length_is_an_error():
    p = pack_bshd(design_example_batch())
    with pytest.raises(ValueError, match=r"expected \[1, 9, ...\] or \[9, ...\]"):
        unpack_thd(torch.zeros(1, 8), p)


def test_unpack_of_a_cp_shard_is_an_error():
    p = pack_bshd(design_example_batch(), alignment=Alignment(cp_size=2)).shard_for_cp(2, 0)
    with pytest.raises(ValueError, match="cp_unshard"):
        unpack_thd(p.tokens, p)


def test_shard_for_cp_slices_tokens_not_boundaries():
    p = pack_bshd(design_example_batch(), alignment=Alignment(cp_size=2))
    s0, s1 = p.shard_for_cp(2, 0), p.shard_for_cp(2, 1)
    # samples of 4 tokens, 4 chunks of 1: rank 0 keeps chunks 0 and 3, rank 1 chunks 1 and 2
    assert s0.tokens.tolist() == [[11, 0, 21, 0, 31, 34]]
    assert s1.tokens.tolist() == [[12, 13, 22, 0, 32, 33]]
    assert s0.cu_seqlens_padded is p.cu_seqlens_padded and s0.max_seqlen == p.max_seqlen
    assert s0.position_ids.tolist() == [[0, 3, 0, 3, 0, 3]]
    assert (s0.cp_size, s0.cp_rank) == (2, 0)


def test_shard_for_cp_without_cp_alignment_is_an_error():
    p = pack_bshd(design_example_batch())
    with pytest.raises(ValueError, match=r"not a multiple of 2\*cp = 4: pack with Alignment\(cp_size=2\)"):
        p.shard_for_cp(2, 0)


def test_to_keeps_the_same_object_rule():
    p = pack_bshd(design_example_batch())
    q = p.to("cpu")
    assert q.cu_seqlens_padded is q.cu_seqlens
    assert isinstance(q, PackedBatch)


def test_packed_seq_params_follow_the_te_fast_path_rule():
    from thdpack.megatron.packed_seq_params import thd_packed_seq_params

    fast = thd_packed_seq_params(pack_bshd(design_example_batch()))
    assert fast.qkv_format == "thd"
    assert fast.cu_seqlens_q_padded is fast.cu_seqlens_q and fast.cu_seqlens_kv is fast.cu_seqlens_q
    assert fast.max_seqlen_q == 4 and isinstance(fast.max_seqlen_q, int)
    distinct = thd_packed_seq_params(pack_bshd(design_example_batch(), alignment=Alignment(cp_size=2)))
    assert distinct.cu_seqlens_q.tolist() == [0, 3, 5, 9]
    assert distinct.cu_seqlens_q_padded.tolist() == [0, 4, 8, 12]


@pytest.mark.parametrize("alignment", [Alignment(), Alignment(cp_size=2)])
def test_packed_seq_params_declare_host_copies_of_the_boundaries(alignment):
    # Megatron's PackedSeqParams plus two declared host fields (for the torch attention's per-sample loop):
    # the host copies are the layout's, and are one object exactly when the device boundaries are.
    from megatron.core.packed_seq_params import PackedSeqParams

    from thdpack.megatron.packed_seq_params import THDPackedSeqParams, thd_packed_seq_params

    p = pack_bshd(design_example_batch(), alignment=alignment)
    params = thd_packed_seq_params(p)
    assert isinstance(params, THDPackedSeqParams) and isinstance(params, PackedSeqParams)
    assert params.cu_seqlens_q_host is p.layout.cu_seqlens
    assert params.cu_seqlens_q_padded_host is p.layout.cu_seqlens_padded
    assert (params.cu_seqlens_q_host is params.cu_seqlens_q_padded_host) == (
        params.cu_seqlens_q is params.cu_seqlens_q_padded
    )
    assert "cu_seqlens_q_host" not in vars(PackedSeqParams())  # Megatron's own class is untouched


def test_bridge_per_sample_rule_never_pads_less_than_ours():
    # 5 samples of 3 tokens, cp=2, tp=4 with SP: ours pads each to 4 and the total to 8; Bridge pads each to
    # lcm(2cp, cp*tp) = 8.
    batch = {"tokens": torch.ones(5, 3, dtype=torch.long), "attention_mask": torch.ones(5, 3)}
    p = pack_bshd(batch, alignment=Alignment(cp_size=2, tp_size=4, sequence_parallel=True))
    assert p.total_tokens == 24
    assert p.total_tokens < 5 * 8


def test_extra_tensors_follow_cp_sharding_and_moves_even_with_a_field_name():
    batch = design_example_batch()
    batch["padding_mask"] = torch.arange(12).view(3, 4)  # a user key that shares a PackedBatch field name
    p = pack_bshd(batch, alignment=Alignment(cp_size=2))
    s0 = p.shard_for_cp(2, 0).to("cpu")
    assert s0.extra["padding_mask"].tolist() == [[0, 0, 4, 0, 8, 11]]
    assert s0.padding_mask.tolist() == [[False, True, False, True, False, False]]
