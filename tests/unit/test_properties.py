"""Property-based specification of the packer over random batches and alignments (hypothesis)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from thdpack import Alignment, cp_partition_indices, cp_unshard, find_segments, pack_bshd, unpack_thd

IGNORE = -100


@st.composite
def padded_batches(draw):
    """A [B, S] batch as segment ids: per row left pad, samples back to back or with gaps, right pad."""
    B = draw(st.integers(1, 5))
    rows, max_len = [], 1
    for _ in range(B):
        row = [0] * draw(st.integers(0, 3))
        for sample in range(draw(st.integers(0, 3))):
            if sample and draw(st.booleans()):
                row += [0] * draw(st.integers(1, 2))
            row += [sample + 1] * draw(st.integers(1, 9))
        row += [0] * draw(st.integers(0, 3))
        rows.append(row)
        max_len = max(max_len, len(row))
    if all(max(r, default=0) == 0 for r in rows):
        rows[0] = rows[0] + [1]
        max_len = max(max_len, len(rows[0]))
    ids = torch.tensor([r + [0] * (max_len - len(r)) for r in rows])
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 1000, ids.shape, generator=gen)
    return ids, tokens, gen


alignments = st.builds(
    Alignment,
    cp_size=st.sampled_from([1, 2, 4]),
    tp_size=st.sampled_from([1, 2, 4]),
    sequence_parallel=st.booleans(),
    fp8=st.booleans(),
    mode=st.sampled_from(["distinct", "fold"]),
)


def real_positions(p):
    return (~p.padding_mask[0]).nonzero().flatten()


@settings(max_examples=150, deadline=None)
@given(padded_batches(), alignments)
def test_unpack_of_pack_is_identity_on_real_positions(data, alignment):
    ids, tokens, gen = data
    weights = torch.rand(ids.shape, generator=gen)
    p = pack_bshd({"tokens": tokens, "attention_mask": ids, "weights": weights}, alignment=alignment)
    real = ids != 0
    assert torch.equal(unpack_thd(p.tokens, p)[real], tokens[real])
    assert torch.equal(unpack_thd(p.extra["weights"], p)[real], weights[real])
    assert torch.equal(unpack_thd(p.tokens, p, pad_value=-7)[~real], torch.full_like(tokens[~real], -7))


@settings(max_examples=150, deadline=None)
@given(padded_batches(), alignments)
def test_boundaries_and_alignment_rules(data, alignment):
    ids, tokens, _ = data
    p = pack_bshd({"tokens": tokens, "attention_mask": ids}, alignment=alignment)
    cu, cu_p = p.cu_seqlens, p.cu_seqlens_padded
    assert cu.dtype == cu_p.dtype == torch.int32
    assert (cu.diff() >= 0).all() and (cu_p.diff() >= 0).all()
    assert (cu.diff() <= cu_p.diff()).all(), "a logical sample never exceeds its physical slot"
    assert int(cu_p[-1]) == p.total_tokens == p.tokens.shape[1]
    assert p.max_seqlen == int(cu_p.diff().max())
    n = len(p.segments)
    assert (cu_p.diff()[:n] % alignment.sample_multiple == 0).all()
    assert p.total_tokens % alignment.total_multiple == 0
    # The TE fast-path rule: one object exactly when no pad lies between samples.
    assert (cu is cu_p) == torch.equal(cu, cu_p)
    if alignment.mode == "fold":
        assert cu is cu_p
    if not alignment.fp8:
        # Never more pad than Megatron-Bridge's per-sample lcm(2cp, cp*tp) rule.
        m = math.lcm(2 * alignment.cp_size, alignment.cp_size * alignment.tp_size)
        assert p.total_tokens <= int(((p.segments.length + m - 1) // m * m).sum())


@settings(max_examples=150, deadline=None)
@given(padded_batches(), alignments)
def test_positions_restart_and_padding_mask_marks_exactly_the_pad(data, alignment):
    ids, tokens, _ = data
    p = pack_bshd({"tokens": tokens, "attention_mask": ids}, alignment=alignment)
    cu_p = p.cu_seqlens_padded.long()
    seg = torch.repeat_interleave(torch.arange(cu_p.numel() - 1), cu_p.diff())
    assert torch.equal(p.position_ids[0], torch.arange(p.total_tokens) - cu_p[seg])
    lengths = torch.zeros(cu_p.numel() - 1, dtype=torch.long)
    lengths[: len(p.segments)] = p.segments.length
    expected_pad = p.position_ids[0] >= lengths[seg]
    assert torch.equal(p.padding_mask[0], expected_pad)
    assert int((~p.padding_mask).sum()) == p.num_real_tokens == int((ids != 0).sum())


@settings(max_examples=150, deadline=None)
@given(padded_batches(), alignments)
def test_loss_mask_is_zero_on_pad_and_on_cross_sample_targets(data, alignment):
    ids, tokens, _ = data
    labels = tokens.roll(-1, dims=1)  # Megatron convention: shifted within the row, across samples
    p = pack_bshd({"tokens": tokens, "labels": labels, "attention_mask": ids}, alignment=alignment)
    assert not p.loss_mask[p.padding_mask].any()
    assert (p.labels[p.padding_mask] == IGNORE).all()
    # A counted target is the row's given label, and never the first token of another sample in the row.
    counted = unpack_thd(p.loss_mask[0], p).bool()
    assert torch.equal(unpack_thd(p.labels[0], p)[counted], labels[counted])
    next_id = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
    assert not (counted & (next_id != 0) & (next_id != ids)).any(), "a target crosses into another sample"


def te_partition(cu, cp, rank):
    """TE's thd_get_partitioned_indices, stated in plain Python."""
    out = []
    for i in range(len(cu) - 1):
        chunk = (cu[i + 1] - cu[i]) // (2 * cp)
        out += range(cu[i] + rank * chunk, cu[i] + (rank + 1) * chunk)
        out += range(cu[i] + (2 * cp - 1 - rank) * chunk, cu[i] + (2 * cp - rank) * chunk)
    return out


@settings(max_examples=150, deadline=None)
@given(padded_batches(), st.sampled_from([2, 4]), st.sampled_from(["distinct", "fold"]))
def test_cp_shards_partition_the_row_by_te_rule(data, cp, mode):
    ids, tokens, _ = data
    p = pack_bshd({"tokens": tokens, "attention_mask": ids}, alignment=Alignment(cp_size=cp, mode=mode))
    cu = p.cu_seqlens_padded.tolist()
    shards = [cp_partition_indices(p.cu_seqlens_padded, cp, r) for r in range(cp)]
    for r, idx in enumerate(shards):
        assert idx.tolist() == te_partition(cu, cp, r)
        assert torch.equal(p.shard_for_cp(cp, r).tokens[0], p.tokens[0][idx])
    assert sorted(torch.cat(shards).tolist()) == list(range(p.total_tokens))
    assert torch.equal(
        cp_unshard([p.shard_for_cp(cp, r).tokens for r in range(cp)], p.cu_seqlens_padded), p.tokens
    )


@settings(max_examples=100, deadline=None)
@given(padded_batches(), alignments)
def test_mrope_ids_are_gathered_per_sample(data, alignment):
    ids, tokens, gen = data
    mrope = torch.randint(0, 50, (3, *ids.shape), generator=gen)
    p = pack_bshd({"tokens": tokens, "attention_mask": ids, "mrope_position_ids": mrope}, alignment=alignment)
    real = ids != 0
    for axis in range(3):
        assert torch.equal(unpack_thd(p.mrope_position_ids[axis, 0], p)[real], mrope[axis][real])


@settings(max_examples=100, deadline=None)
@given(padded_batches())
def test_every_mask_form_finds_the_same_samples(data):
    ids, _, _ = data
    segs = find_segments(ids)
    rebuilt = torch.zeros_like(ids)
    for row, start, length in zip(segs.row.tolist(), segs.start.tolist(), segs.length.tolist(), strict=True):
        rebuilt[row, start : start + length] = ids[row, start]
    assert torch.equal(rebuilt, ids), "samples cover exactly the non-zero ids, one run each"
    S = ids.shape[1]
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    block = (ids[:, :, None] == ids[:, None, :]) & (ids[:, None, :] != 0) & causal
    for form in (
        find_segments(block[:, None]),
        find_segments(torch.where(block, 0.0, float("-inf"))[:, None]),
    ):
        assert torch.equal(form.row, segs.row) and torch.equal(form.start, segs.start)
        assert torch.equal(form.length, segs.length)


def reference_runs(row: list[int]) -> list[tuple[int, int]]:
    """(start, length) of each run of non-zero values in a row, by a plain loop."""
    runs = []
    for j, v in enumerate(row):
        if v and (j == 0 or not row[j - 1]):
            runs.append([j, 0])
        if v:
            runs[-1][1] += 1
    return [tuple(r) for r in runs]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.lists(st.booleans(), min_size=1, max_size=12), min_size=1, max_size=4).filter(
        lambda rows: len({len(r) for r in rows}) == 1
    ),
    st.sampled_from([torch.bool, torch.int64, torch.int32, torch.uint8, torch.float32, torch.bfloat16]),
    st.booleans(),
)
def test_01_mask_segments_or_hole_error_match_a_plain_loop(rows, dtype, with_position_ids):
    """Any 0/1 bit pattern: one sample per row's run, or a hole error naming the first row with two runs."""
    mask = torch.tensor(rows).to(dtype)
    pos = torch.arange(mask.shape[1]).expand_as(mask).contiguous() if with_position_ids else None
    runs = [reference_runs(r) for r in rows]
    holed = [b for b, r in enumerate(runs) if len(r) > 1]
    if holed:
        gap = runs[holed[0]][0][0] + runs[holed[0]][0][1]
        with pytest.raises(ValueError, match=f"row {holed[0]} of attention_mask has a hole at column {gap}:"):
            find_segments(mask, position_ids=pos)
    elif not any(runs):
        with pytest.raises(ValueError, match="no real token"):
            find_segments(mask, position_ids=pos)
    else:
        segments = find_segments(mask, position_ids=pos)
        expected = [(b, *r[0]) for b, r in enumerate(runs) if r]
        got = list(zip(segments.row.tolist(), segments.start.tolist(), segments.length.tolist(), strict=True))
        assert got == expected


# ---------------------------------------------------------------- attention parity


def causal_attention(q, k, v, allowed):
    scores = (q @ k.T) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def thd_attention(x_q, x_kv, q_pos, p):
    """Block-diagonal causal attention on the THD row: queries at global positions ``q_pos`` attend the keys of
    their own segment at or before them, within the segment's attention length (real tokens in distinct mode,
    the whole slot in fold mode)."""
    cu_p = p.cu_seqlens_padded.long()
    attn_len = p.cu_seqlens.long().diff()
    seg = torch.repeat_interleave(torch.arange(cu_p.numel() - 1), cu_p.diff())
    k_pos = torch.arange(p.total_tokens)
    visible = (k_pos - cu_p[seg]) < attn_len[seg]
    allowed = (seg[q_pos][:, None] == seg[None, :]) & (k_pos[None, :] <= q_pos[:, None]) & visible[None, :]
    allowed |= (~visible[q_pos])[:, None] & (
        k_pos[None, :] == q_pos[:, None]
    )  # pad queries: keep softmax finite
    return causal_attention(x_q, x_kv, x_kv, allowed)


@settings(max_examples=60, deadline=None)
@given(padded_batches(), st.sampled_from([1, 2, 4]), st.sampled_from(["distinct", "fold"]))
def test_block_diagonal_attention_on_thd_equals_per_sample_attention(data, cp, mode):
    ids, tokens, gen = data
    B, S = ids.shape
    x = torch.randn(B, S, 8, generator=gen, dtype=torch.float64)
    batch = {"tokens": tokens, "attention_mask": ids, "source": torch.arange(B * S).view(B, S)}
    p = pack_bshd(batch, alignment=Alignment(cp_size=cp, mode=mode))
    x_thd = x.view(B * S, 8)[p.extra["source"][0]]

    # Reference: each sample alone, unpadded, causal.
    expected = torch.zeros(B, S, 8, dtype=torch.float64)
    for row, start, length in zip(
        p.segments.row.tolist(), p.segments.start.tolist(), p.segments.length.tolist(), strict=True
    ):
        xs = x[row, start : start + length]
        expected[row, start : start + length] = causal_attention(
            xs, xs, xs, torch.ones(length, length).tril().bool()
        )

    # Packed, each CP rank attending its own queries against the full row by global position, then reassembled.
    shards = []
    for rank in range(cp):
        q_pos = cp_partition_indices(p.cu_seqlens_padded, cp, rank)
        shards.append(thd_attention(x_thd[q_pos], x_thd, q_pos, p))
    out = unpack_thd(cp_unshard(shards, p.cu_seqlens_padded, dim=0), p)
    real = ids != 0
    torch.testing.assert_close(out[real], expected[real], rtol=1e-12, atol=1e-12)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(-1, 3), st.integers(-2, 6), st.integers(-1, 5)), min_size=1, max_size=5),
    st.integers(1, 3),
    st.integers(1, 6),
)
def test_segments_check_accepts_exactly_what_a_plain_loop_accepts(samples, B, S):
    """Segments.check's vectorized fast path against the rule written out sample by sample."""
    from thdpack import Segments

    def valid() -> bool:
        prev_end = None
        for row, start, length in samples:
            if not (0 <= row < B and start >= 0 and length >= 1 and start + length <= S):
                return False
            if prev_end is not None and row * S + start < prev_end:
                return False
            prev_end = row * S + start + length
        return True

    rows, starts, lengths = (torch.tensor(list(column)) for column in zip(*samples, strict=True))
    segments = Segments(row=rows, start=starts, length=lengths)
    if valid():
        segments.check((B, S))
    else:
        with pytest.raises(ValueError, match="does not fit a batch|overlaps or precedes"):
            segments.check((B, S))


# ---------------------------------------------------------------- the GPU code paths, run on the CPU


@settings(max_examples=60, deadline=None)
@given(padded_batches(), alignments, st.booleans())
def test_device_token_plan_equals_host_token_plan(data, alignment, derive_labels):
    from thdpack.packing import assemble as pack_module
    from thdpack.packing.layout import plan_layout

    ids, _, _ = data
    segments = find_segments(ids)
    layout = plan_layout(segments.length, alignment)
    table = pack_module._segment_table(segments, layout, ids.shape[1], derive_labels)
    host = pack_module._expand_on_host(table)
    device, cu_padded, cu = pack_module._expand_on_device(table, layout, torch.device("cpu"))
    for h, d in zip(host, device, strict=True):  # numpy arrays on the host, tensors on a device
        assert torch.equal(torch.as_tensor(h), d)
    assert torch.equal(cu_padded, layout.cu_seqlens_padded) and torch.equal(cu, layout.cu_seqlens)
    assert cu_padded.dtype == cu.dtype == torch.int32
    assert (cu is cu_padded) == (layout.cu_seqlens is layout.cu_seqlens_padded)


@settings(max_examples=60, deadline=None)
@given(padded_batches(), alignments, st.booleans(), st.booleans())
def test_device_torch_path_equals_host_path(data, alignment, with_labels, with_loss_mask):
    """The torch path a GPU batch takes, run on CPU tensors: the same outputs."""
    from thdpack.packing import assemble as pack_module
    from thdpack.packing.layout import plan_layout

    ids, tokens, gen = data
    labels = (
        torch.randint(0, 50, tokens.shape, generator=gen).masked_fill_(ids == 0, -100)
        if with_labels
        else None
    )
    loss_mask = torch.rand(tokens.shape, generator=gen) if with_loss_mask else None
    segments = find_segments(ids)
    layout = plan_layout(segments.length, alignment)
    table = pack_module._segment_table(segments, layout, ids.shape[1], labels is None)
    host_plan = pack_module._expand_on_host(table)
    device_plan, cu_padded, _ = pack_module._expand_on_device(table, layout, torch.device("cpu"))
    host = pack_module._gather_outputs(host_plan, tokens, labels, loss_mask, 7, -100)
    device = pack_module._gather_outputs(device_plan, tokens, labels, loss_mask, 7, -100)
    for h, d in zip(host, device, strict=True):
        assert h.dtype == d.dtype and torch.equal(h, d)
    assert torch.equal(torch.from_numpy(host_plan.gather), device_plan.gather)
    assert torch.equal(torch.from_numpy(host_plan.pad_index), device_plan.pad_index)
    assert torch.equal(cu_padded, layout.cu_seqlens_padded)


@settings(max_examples=60, deadline=None)
@given(
    padded_batches(),
    st.sampled_from([torch.bool, torch.int64, torch.float32]),
    st.booleans(),
    st.sampled_from(["0/1", "segment ids", "negated"]),
)
def test_device_mask_statistics_equal_host_statistics(data, dtype, with_position_ids, values):
    from thdpack.packing.segments import _row_stats_device, _row_stats_host

    ids, _, _ = data
    mask = {"0/1": ids != 0, "segment ids": ids, "negated": -ids}[values]
    mask = mask.to(dtype) if dtype != torch.bool or values == "0/1" else (ids != 0)
    pos = torch.arange(ids.shape[1]).expand_as(ids) % 5 if with_position_ids else None
    host = _row_stats_host(mask, pos)
    device = _row_stats_device(mask, pos)
    if host[0] is None:  # not a 0/1 mask: both say why
        assert device[0] is None and device[1] is None and host[4:] == device[4:] and any(host[4:])
        return
    # holes and the value flags agree
    assert host[2] == device[2] and host[4:] == device[4:]
    if host[2]:  # with a hole the error path takes over; first, length and restarts are not defined then
        return
    assert (host[0] == device[0]).all() and (host[1] == device[1]).all()
    # The host's restart flag may be conservative (a zero id on pad inside the checked columns), the device's
    # is exact: it may only say "restart" where the host does too.
    assert host[3] or not device[3]
