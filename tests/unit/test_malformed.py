"""Malformed input, as issue 16 met it: every case ends in a ValueError or TypeError that names the key, the row
where there is one, and the rule; nothing is dropped without a word."""

from types import SimpleNamespace

import pytest
import torch

from thdpack import Alignment, find_segments, pack_bshd, plan_layout, unpack_thd
from thdpack.packing.layout import INT32_MAX

IGNORE = -100


def batch(**overrides):
    """Three right-padded rows of 4 columns: samples of 3, 2 and 4 tokens."""
    base = {
        "tokens": torch.tensor([[11, 12, 13, 0], [21, 22, 0, 0], [31, 32, 33, 34]]),
        "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]),
    }
    return base | overrides


# ---------------------------------------------------------------------------------------------------------
# pack_bshd: shapes


@pytest.mark.parametrize("shape", [(2, 4), (3, 3), (3, 5)])
def test_mask_of_another_shape_than_tokens_is_an_error(shape):
    # [2, 4] and [3, 3] were packed with a row or a column dropped; [3, 5] raised IndexError from deep inside.
    with pytest.raises(
        ValueError,
        match=rf"batch key 'attention_mask' is \[{shape[0]}, {shape[1]}\] but 'tokens' is \[3, 4\]: every \[B, S\] "
        "key must match tokens",
    ):
        pack_bshd(batch(attention_mask=torch.ones(shape, dtype=torch.long)))


def test_labels_of_another_shape_than_tokens_is_an_error():
    with pytest.raises(ValueError, match=r"batch key 'labels' is \[3, 3\] but 'tokens' is \[3, 4\]"):
        pack_bshd(batch(labels=torch.zeros(3, 3, dtype=torch.long)))


def test_mrope_ids_of_the_wrong_shape_are_an_error():
    with pytest.raises(ValueError, match=r"'mrope_position_ids' is \[3, 4\] .* must be \[3, 3, 4\]"):
        pack_bshd(batch(mrope_position_ids=torch.zeros(3, 4, dtype=torch.long)))


@pytest.mark.parametrize("shape", [(0, 4), (3, 0)])
def test_empty_batch_is_an_error(shape):
    # B = 0 raised "zero-size array to reduction operation maximum which has no identity".
    empty = {"tokens": torch.zeros(shape, dtype=torch.long), "attention_mask": torch.zeros(shape)}
    with pytest.raises(
        ValueError, match=r"batch key 'tokens' is \[\d, \d\]: it must be \[B, S\] with B >= 1"
    ):
        pack_bshd(empty)


def test_batch_without_a_real_token_is_an_error():
    with pytest.raises(ValueError, match="has no real token: every row is pad"):
        pack_bshd(batch(attention_mask=torch.zeros(3, 4, dtype=torch.long)))


# ---------------------------------------------------------------------------------------------------------
# pack_bshd: types and dtypes


def test_float_token_ids_are_an_error():
    with pytest.raises(
        TypeError, match="batch key 'tokens' is torch.float32: token ids must be an integer tensor"
    ):
        pack_bshd(batch(tokens=batch()["tokens"].float()))


def test_float_labels_are_an_error():
    with pytest.raises(TypeError, match="batch key 'labels' is torch.float32: it must be an integer tensor"):
        pack_bshd(batch(labels=torch.zeros(3, 4)))


def test_tokens_as_a_python_list_are_an_error():
    # Raised "AttributeError: 'list' object has no attribute 'dim'".
    with pytest.raises(TypeError, match="batch key 'tokens' is a list: pass a torch.Tensor"):
        pack_bshd(batch(tokens=[[1, 2, 3, 0]] * 3))


def test_mask_as_a_python_list_is_an_error():
    with pytest.raises(TypeError, match="batch key 'attention_mask' is a list: pass a torch.Tensor"):
        pack_bshd(batch(attention_mask=[[1, 1, 1, 0]] * 3))


def test_other_key_that_is_not_a_tensor_is_an_error():
    with pytest.raises(TypeError, match="batch key 'metadata' is a list: pack_bshd packs only tensors"):
        pack_bshd(batch(metadata=[{"id": 1}]))


def test_batch_that_is_not_a_mapping_is_an_error():
    with pytest.raises(TypeError, match="pack_bshd takes a mapping of tensors"):
        pack_bshd([batch()["tokens"]])


def test_a_key_set_to_none_is_absent():
    p = pack_bshd(batch(labels=None, position_ids=None))
    assert p.tokens.tolist() == [[11, 12, 13, 21, 22, 31, 32, 33, 34]]


def test_tokens_and_input_ids_as_one_tensor_are_accepted():
    b = batch()
    b["input_ids"] = b["tokens"]  # as Megatron-Bridge's collators send them
    assert pack_bshd(b).num_real_tokens == 9


def test_tokens_and_input_ids_as_two_tensors_are_an_error():
    with pytest.raises(ValueError, match="both 'tokens' and 'input_ids' as different tensors"):
        pack_bshd(batch(input_ids=batch()["tokens"].clone()))


def test_negative_pad_token_id_is_an_error():
    with pytest.raises(
        ValueError, match="pad_token_id=-1: pad is embedded like any token, so it must be >= 0"
    ):
        pack_bshd(batch(), pad_token_id=-1)


# ---------------------------------------------------------------------------------------------------------
# pack_bshd: devices, values


def test_labels_on_another_device_than_tokens_are_an_error():
    with pytest.raises(
        ValueError, match="batch key 'labels' is on meta but 'tokens' on cpu: token-aligned tensors"
    ):
        pack_bshd(batch(labels=torch.zeros(3, 4, dtype=torch.long, device="meta")))


def test_negative_token_id_on_a_real_position_is_an_error_naming_row_and_column():
    # Passed through; the embedding then failed on the GPU with a device assert, far from the cause.
    tokens = batch()["tokens"].clone()
    tokens[1, 1] = -5
    with pytest.raises(
        ValueError, match="row 1 of 'tokens' has -5 at column 1, a real token: token ids must be >= 0"
    ):
        pack_bshd(batch(tokens=tokens))


def test_negative_token_id_on_pad_is_replaced_by_the_pad_token():
    tokens = batch()["tokens"].clone()
    tokens[1, 3] = -5  # pad: never read
    assert pack_bshd(batch(tokens=tokens), alignment=Alignment(cp_size=2)).tokens.min() >= 0


def test_negative_label_is_no_target_and_stays_as_given():
    labels = torch.tensor([[12, 13, -1, IGNORE], [22, IGNORE, IGNORE, IGNORE], [32, 33, 34, IGNORE]])
    p = pack_bshd(batch(labels=labels))
    assert p.labels.tolist() == [[12, 13, -1, 22, IGNORE, 32, 33, 34, IGNORE]]
    assert p.loss_mask.tolist() == [[1, 1, 0, 1, 0, 1, 1, 1, 0]]


def test_already_packed_batch_is_sent_to_from_packed_batch():
    with pytest.raises(
        ValueError,
        match="'cu_seqlens' marks a batch that is already packed .*: adopt it with thdpack.from_packed_batch",
    ):
        pack_bshd(batch(cu_seqlens=torch.tensor([0, 3, 5, 9])))


# ---------------------------------------------------------------------------------------------------------
# pack_bshd: position ids next to a mask are used (they split samples) and checked (they restart at each one)


def test_position_ids_next_to_a_mask_that_agree_are_accepted():
    p = pack_bshd(batch(position_ids=torch.arange(4).expand(3, 4)))
    assert p.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]


def test_position_ids_next_to_a_mask_split_samples_where_they_restart():
    p = pack_bshd(batch(position_ids=torch.tensor([[0, 1, 0, 0], [0, 1, 0, 0], [0, 1, 0, 1]])))
    assert p.cu_seqlens.tolist() == [0, 2, 3, 5, 7, 9]


def test_position_ids_that_do_not_restart_at_a_segment_are_an_error():
    # Segment ids 1 1 2 2 say two samples; the ids 0 1 2 3 say one. Ignored without a word before.
    with pytest.raises(
        ValueError,
        match="row 0 of position_ids has 2 at column 2, where sample 1 starts: position ids must restart at 0",
    ):
        pack_bshd(
            {
                "tokens": torch.tensor([[1, 2, 3, 4]]),
                "attention_mask": torch.tensor([[1, 1, 2, 2]]),
                "position_ids": torch.tensor([[0, 1, 2, 3]]),
            }
        )


def test_position_ids_of_a_left_padded_row_counted_from_column_0_are_an_error():
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    with pytest.raises(ValueError, match="row 0 of position_ids has 1 at column 1, where sample 0 starts"):
        pack_bshd(
            {
                "tokens": torch.ones(2, 4, dtype=torch.long),
                "attention_mask": mask,
                "position_ids": torch.arange(4).expand(2, 4),
            }
        )


def test_position_ids_next_to_a_4d_mask_are_checked():
    attend = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)
    with pytest.raises(ValueError, match="row 0 of position_ids has 2 at column 2, where sample 1 starts"):
        pack_bshd(
            {
                "tokens": torch.tensor([[1, 2, 3, 4]]),
                "attention_mask": attend[None, None],
                "position_ids": torch.tensor([[0, 1, 2, 3]]),
            }
        )


def test_position_ids_next_to_given_segments_are_checked():
    b = batch()
    segments = find_segments(b.pop("attention_mask"))
    with pytest.raises(ValueError, match="row 2 of position_ids has 5 at column 0, where sample 2 starts"):
        pack_bshd(
            b | {"position_ids": torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3], [5, 6, 7, 8]])}, segments=segments
        )


# ---------------------------------------------------------------------------------------------------------
# plan_layout: sizes


def test_three_samples_of_2_to_the_30_overflow_int32_cu_seqlens():
    # Returned cu_seqlens = [0, 1073741824, -2147483648, ...]: int32 overflow, silent.
    with pytest.raises(
        ValueError,
        match="needs 3221225472 tokens .* cu_seqlens are int32, so a packed row holds at most 2147483647",
    ):
        plan_layout(torch.tensor([2**30] * 3), Alignment())


def test_a_row_of_exactly_int32_max_tokens_is_planned():
    layout = plan_layout(torch.tensor([2**30, 2**30 - 1]), Alignment())
    assert layout.cu_seqlens.tolist() == [0, 2**30, INT32_MAX]


def test_alignment_padding_past_int32_is_an_error():
    with pytest.raises(ValueError, match="cu_seqlens are int32"):
        plan_layout(torch.tensor([INT32_MAX - 1]), Alignment(cp_size=2))


def test_sample_of_length_zero_is_an_error():
    with pytest.raises(ValueError, match="sample 1 has length 0: every sample needs at least one real token"):
        plan_layout(torch.tensor([3, 0, 2]), Alignment())


def test_float_lengths_are_an_error():
    with pytest.raises(TypeError, match="plan_layout's lengths is torch.float32"):
        plan_layout(torch.tensor([3.0, 2.0]), Alignment())


def test_no_sample_is_an_error():
    with pytest.raises(ValueError, match=r"plan_layout's lengths is \[0\]: it must be \[N\] with N >= 1"):
        plan_layout(torch.zeros(0, dtype=torch.long), Alignment())


def test_bucket_above_int32_is_an_error():
    with pytest.raises(ValueError, match="pad_total_to=4294967296 is above 2147483647"):
        Alignment(pad_total_to=2**32)


# ---------------------------------------------------------------------------------------------------------
# find_segments, unpack_thd


def test_complex_mask_is_an_error():
    with pytest.raises(
        TypeError, match="attention_mask is torch.complex64: a mask holds bool, integer or floating"
    ):
        find_segments(torch.ones(2, 3, dtype=torch.complex64))


def test_float_position_ids_are_an_error():
    with pytest.raises(
        TypeError, match="position_ids is torch.float32: position ids must be an integer tensor"
    ):
        find_segments(position_ids=torch.zeros(2, 3))


def test_empty_mask_is_an_error():
    with pytest.raises(ValueError, match=r"attention_mask has shape \[0, 3\]: an empty batch has no sample"):
        find_segments(torch.ones(0, 3))


def test_segment_ids_too_large_for_int64_are_an_error():
    with pytest.raises(ValueError, match="row 0 of attention_mask has value 1e\\+30 at column 1"):
        find_segments(torch.tensor([[1.0, 1e30]], dtype=torch.float64))


def test_unpack_of_something_else_than_a_tensor_is_an_error():
    p = pack_bshd(batch())
    with pytest.raises(TypeError, match="unpack_thd's x is a list"):
        unpack_thd(p.tokens.tolist(), p)
    with pytest.raises(TypeError, match="unpack_thd's packed is a dict"):
        unpack_thd(p.tokens, {})
    with pytest.raises(ValueError, match="unpack_thd got a 0-d tensor"):
        unpack_thd(torch.tensor(1), p)


# ---------------------------------------------------------------------------------------------------------
# get_batch (one process: the parallel state of a single rank)


@pytest.fixture
def single_rank(monkeypatch):
    from megatron.core import parallel_state as ps

    for name, value in [
        ("get_tensor_model_parallel_rank", 0),
        ("get_tensor_model_parallel_world_size", 1),
        ("get_context_parallel_world_size", 1),
        ("get_context_parallel_rank", 0),
        ("is_pipeline_first_stage", True),
        ("is_pipeline_last_stage", True),
    ]:
        monkeypatch.setattr(ps, name, lambda *a, _v=value, **k: _v)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    return SimpleNamespace(
        context_parallel_size=1,
        tensor_model_parallel_size=1,
        sequence_parallel=False,
        fp8=None,
        num_moe_experts=None,
    )


@pytest.mark.parametrize("pack", [True, False])
def test_get_batch_names_a_malformed_key(single_rank, pack):
    from thdpack.megatron.batch import BatchConfig, get_batch

    bad = batch(attention_mask=torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"batch key 'attention_mask' is \[2, 4\] but 'tokens' is \[3, 4\]"):
        get_batch(iter([bad]), single_rank, BatchConfig(pack_sequences_in_batch=pack))


def test_get_batch_refuses_something_else_than_a_mapping(single_rank):
    from thdpack.megatron.batch import BatchConfig, get_batch

    with pytest.raises(TypeError, match="the data iterator yielded a tuple"):
        get_batch(iter([(1, 2)]), single_rank, BatchConfig())


def test_padded_baseline_refuses_segment_ids(single_rank):
    from thdpack.megatron.batch import BatchConfig, get_batch

    ids = batch(attention_mask=torch.tensor([[1, 1, 2, 0], [1, 1, 0, 0], [1, 1, 1, 1]]))
    with pytest.raises(ValueError, match="the padded BSHD baseline takes a 0/1 mask"):
        get_batch(iter([ids]), single_rank, BatchConfig(pack_sequences_in_batch=False))


def test_get_batch_packs_a_well_formed_batch(single_rank):
    from thdpack.megatron.batch import BatchConfig, get_batch

    inputs = get_batch(iter([batch()]), single_rank, BatchConfig())
    assert inputs.tokens.tolist() == [[11, 12, 13, 21, 22, 31, 32, 33, 34]]
