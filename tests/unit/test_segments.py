"""find_segments: every input form listed in docs/design.md, and every error."""

import pytest
import torch

from thdpack import Segments, find_segments


def as_tuples(segs: Segments) -> list[tuple[int, int, int]]:
    return list(zip(segs.row.tolist(), segs.start.tolist(), segs.length.tolist(), strict=True))


@pytest.mark.parametrize("dtype", [torch.bool, torch.int64, torch.int32, torch.float32, torch.bfloat16])
def test_right_padded_01_mask_any_dtype(dtype):
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]]).to(dtype)
    assert as_tuples(find_segments(mask)) == [(0, 0, 3), (1, 0, 1)]


def test_left_padded_01_mask():
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert as_tuples(find_segments(mask)) == [(0, 2, 2), (1, 0, 4)]


def test_segments_are_int64_host_tensors():
    segs = find_segments(torch.tensor([[1, 1, 0]]))
    for t in (segs.row, segs.start, segs.length):
        assert t.dtype == torch.int64 and t.device.type == "cpu"


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool, torch.float32])
def test_strided_mask_gives_the_same_samples(dtype):
    # A view with steps and a transposed view: the mask statistics must not assume a contiguous tensor.
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]).to(dtype)
    wide = torch.zeros(3, 12, dtype=dtype)
    wide[:, ::2] = mask
    expected = as_tuples(find_segments(mask))
    assert expected == [(0, 0, 3), (1, 2, 4), (2, 0, 6)]
    assert as_tuples(find_segments(wide[:, ::2])) == expected
    assert as_tuples(find_segments(mask.t().contiguous().t())) == expected


def test_all_pad_row_is_skipped():
    mask = torch.tensor([[0, 0, 0], [1, 1, 0]])
    assert as_tuples(find_segments(mask)) == [(1, 0, 2)]


def test_batch_without_real_token_is_an_error():
    with pytest.raises(ValueError, match="no real token"):
        find_segments(torch.zeros(2, 3, dtype=torch.bool))


def test_hole_in_01_mask_names_row_and_column():
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 0, 1]])
    with pytest.raises(
        ValueError, match=r"row 2 of attention_mask has a hole at column 1: a 0/1 mask must be contiguous"
    ):
        find_segments(mask)


def test_segment_ids_give_several_samples_per_row():
    mask = torch.tensor([[1, 1, 2, 2, 2, 0], [3, 3, 3, 3, 0, 0]])
    assert as_tuples(find_segments(mask)) == [(0, 0, 2), (0, 2, 3), (1, 0, 4)]


def test_segment_ids_with_pad_between_samples():
    mask = torch.tensor([[1, 1, 0, 2, 2, 0]])
    assert as_tuples(find_segments(mask)) == [(0, 0, 2), (0, 3, 2)]


def test_segment_id_split_in_two_runs_is_an_error():
    mask = torch.tensor([[1, 1, 2, 2, 1, 0]])
    with pytest.raises(ValueError, match=r"row 0 of attention_mask has segment id 1 again at column 4"):
        find_segments(mask)


def test_negative_mask_value_is_an_error():
    with pytest.raises(ValueError, match=r"row 1 of attention_mask has value -1 at column 2"):
        find_segments(torch.tensor([[1, 1, 0], [1, 1, -1]]))


def test_fractional_mask_value_is_an_error():
    with pytest.raises(ValueError, match=r"row 0 of attention_mask has value 0.5 at column 1"):
        find_segments(torch.tensor([[1.0, 0.5, 0.0]]))


INTEGER_MASK_CASES = [
    ([[1, 1, 1, 0], [1, 0, 0, 0]], [(0, 0, 3), (1, 0, 1)]),
    ([[0, 0, 1, 1], [1, 1, 1, 1]], [(0, 2, 2), (1, 0, 4)]),
    ([[1, 1, 2, 2], [3, 0, 0, 0]], [(0, 0, 2), (0, 2, 2), (1, 0, 1)]),
    ([[1, 1, 0], [1, 1, -1]], "row 1 of attention_mask has value -1 at column 2"),
    ([[1, 0, 1], [1, 1, 0]], "row 0 of attention_mask has a hole at column 1"),
]


@pytest.mark.parametrize(
    "rows, expected, dtype",
    [
        (rows, expected, dtype)
        for rows, expected in INTEGER_MASK_CASES
        for dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
        if not (dtype == torch.uint8 and min(min(row) for row in rows) < 0)  # uint8 holds no negative value
    ],
)
def test_integer_mask_checked_alike_in_every_integer_dtype(rows, expected, dtype):
    # Every integer width and signedness numpy reads: the same samples, or the same error.
    mask = torch.tensor(rows, dtype=dtype)
    if isinstance(expected, str):
        with pytest.raises(ValueError, match=expected):
            find_segments(mask)
    else:
        assert as_tuples(find_segments(mask)) == expected


def block_causal(seg_ids: list[int]) -> torch.Tensor:
    s = torch.tensor(seg_ids)
    n = len(seg_ids)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    return (s[:, None] == s[None, :]) & (s[None, :] > 0) & causal


def test_4d_bool_block_diagonal_causal_mask():
    mask = torch.stack([block_causal([1, 1, 2, 2, 2, 0]), block_causal([1, 1, 1, 0, 0, 0])])[:, None]
    assert as_tuples(find_segments(mask)) == [(0, 0, 2), (0, 2, 3), (1, 0, 3)]


def test_4d_additive_mask_with_neg_inf_and_finfo_min():
    allowed = block_causal([1, 2, 2, 0])
    for blocked in (float("-inf"), torch.finfo(torch.float32).min):
        mask = torch.where(allowed, 0.0, blocked)[None, None]
        assert as_tuples(find_segments(mask)) == [(0, 0, 1), (0, 1, 2)]


def test_4d_mask_token_that_does_not_attend_itself_is_pad():
    mask = block_causal([1, 1, 0, 2])
    assert not mask[2].any()
    assert as_tuples(find_segments(mask[None, None])) == [(0, 0, 2), (0, 3, 1)]


def test_4d_mask_that_is_not_causal_is_an_error():
    mask = block_causal([1, 1, 1])
    mask[0, 2] = True
    with pytest.raises(
        ValueError,
        match=r"row 0 of the 4D attention_mask is not block-diagonal causal: query 0 attends key 2",
    ):
        find_segments(mask[None, None])


def test_4d_mask_crossing_samples_is_an_error():
    mask = block_causal([1, 1, 2, 2])
    mask[3, 0] = True
    with pytest.raises(ValueError, match=r"query 3 attends key 0"):
        find_segments(mask[None, None])


def test_4d_mask_with_several_heads_is_an_error():
    with pytest.raises(ValueError, match=r"must be \[B, 1, S, S\]"):
        find_segments(torch.ones(1, 2, 3, 3, dtype=torch.bool))


def test_4d_additive_mask_with_small_negative_is_an_error():
    mask = torch.where(block_causal([1, 1]), 0.0, -1.0)[None, None]
    with pytest.raises(ValueError, match=r"row 0 of the 4D attention_mask has value -1.0 at query 0, key 1"):
        find_segments(mask)


def test_position_ids_restarting_at_zero_without_mask():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])
    assert as_tuples(find_segments(position_ids=pos)) == [(0, 0, 3), (0, 3, 2), (0, 5, 1), (1, 0, 6)]


def test_position_ids_split_the_real_run_of_a_mask():
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    pos = torch.tensor([[0, 1, 0, 1, 0]])
    assert as_tuples(find_segments(mask, position_ids=pos)) == [(0, 0, 2), (0, 2, 2)]


def test_position_ids_that_skip_are_an_error():
    with pytest.raises(ValueError, match=r"row 0 of position_ids starts a run from 1 to 3 at column 2"):
        find_segments(position_ids=torch.tensor([[0, 1, 3]]))


def test_position_ids_not_starting_at_zero_are_an_error():
    with pytest.raises(ValueError, match=r"row 1 of position_ids starts a run with 2 at column 0"):
        find_segments(position_ids=torch.tensor([[0, 1, 2], [2, 3, 4]]))


def test_negative_position_ids_are_an_error():
    with pytest.raises(ValueError, match=r"row 0 of position_ids has negative id -1 at column 1"):
        find_segments(position_ids=torch.tensor([[0, -1, 0]]))


def test_position_ids_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match=r"position_ids has shape \[1, 3\] but the batch is \[1, 4\]"):
        find_segments(torch.ones(1, 4), position_ids=torch.zeros(1, 3, dtype=torch.long))


def test_trailing_pad_token_ids_only():
    ids = torch.tensor([[5, 0, 7, 0, 0], [0, 0, 0, 0, 0], [1, 2, 3, 4, 5]])
    # The inner 0 of row 0 is a real token: only the trailing run of pad ids is pad.
    assert as_tuples(find_segments(input_ids=ids, pad_token_id=0)) == [(0, 0, 3), (2, 0, 5)]


def test_no_input_is_an_error():
    with pytest.raises(
        ValueError, match="needs attention_mask, position_ids, or input_ids together with pad_token_id"
    ):
        find_segments()


def test_three_dimensional_mask_is_an_error():
    with pytest.raises(ValueError, match=r"expected \[B, S\]"):
        find_segments(torch.ones(1, 2, 3))


def test_segments_check_rejects_sample_outside_batch():
    segs = Segments(row=torch.tensor([0]), start=torch.tensor([2]), length=torch.tensor([3]))
    with pytest.raises(
        ValueError, match=r"sample 0 \(row 0, start 2, length 3\) does not fit a batch of shape \[1, 4\]"
    ):
        segs.check((1, 4))


def test_segments_check_rejects_overlap():
    segs = Segments(row=torch.tensor([0, 0]), start=torch.tensor([0, 1]), length=torch.tensor([2, 1]))
    with pytest.raises(ValueError, match="overlaps"):
        segs.check((1, 4))
