"""A fuzzer over malformed batches (hypothesis, derandomized so that CI is deterministic).

Every generated input either packs, and then every real token, label and loss weight comes back in place
through ``unpack_thd`` (checked against a plain per-row statement of the input's samples), or raises
``ValueError`` / ``TypeError``: never another exception, never a silent loss. Mutations that make a batch
malformed by the input contract must raise; the others must pack.
"""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from thdpack import (
    Alignment,
    PackedBatch,
    find_segments,
    from_packed_batch,
    pack_bshd,
    plan_layout,
    unpack_thd,
)
from thdpack.packing.layout import INT32_MAX

IGNORE = -100
FUZZ = settings(
    derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)

alignments = st.builds(
    Alignment,
    cp_size=st.sampled_from([1, 2]),
    tp_size=st.sampled_from([1, 2]),
    sequence_parallel=st.booleans(),
    mode=st.sampled_from(["distinct", "fold"]),
)


def outcome(fn):
    """``("ok", result)`` or ``("raised", exception)`` for ValueError / TypeError; any other exception fails."""
    try:
        return "ok", fn()
    except (ValueError, TypeError) as e:
        return "raised", e


# ---------------------------------------------------------------------------------------------------------
# pack_bshd


@st.composite
def bshd_batches(draw):
    """A well-formed batch, its samples as ``[(row, start, length)]`` (the reference), and how it was made."""
    B, S = draw(st.integers(1, 4)), draw(st.integers(1, 8))
    form = draw(st.sampled_from(["01_right", "01_left", "segment_ids", "position_ids", "4d"]))
    samples = []
    if form in ("01_right", "01_left"):
        for b in range(B):
            n = draw(st.integers(0, S))
            if n:
                samples.append((b, 0 if form == "01_right" else S - n, n))
    elif form == "segment_ids":
        for b in range(B):
            col = draw(st.integers(0, S - 1))
            while col < S and draw(st.booleans()):
                n = draw(st.integers(1, S - col))
                samples.append((b, col, n))
                col += n + draw(st.integers(0, 1))
    else:  # position ids or a 4D mask: every token real, samples back to back
        for b in range(B):
            col = 0
            while col < S:
                n = draw(st.integers(1, S - col))
                samples.append((b, col, n))
                col += n
    if not samples:
        samples.append((0, 0, 1))
        if form == "01_left":
            samples[0] = (0, S - 1, 1)
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    real = torch.zeros(B, S, dtype=torch.bool)
    ids = torch.zeros(B, S, dtype=torch.long)
    pos = torch.zeros(B, S, dtype=torch.long)
    for i, (b, s, n) in enumerate(samples):
        real[b, s : s + n] = True
        ids[b, s : s + n] = i + 1
        pos[b, s : s + n] = torch.arange(n)
    dtype = draw(st.sampled_from([torch.int64, torch.int32]))
    batch = {"tokens": torch.randint(1, 100, (B, S), generator=g).to(dtype)}
    if form in ("01_right", "01_left"):
        batch["attention_mask"] = real.to(draw(st.sampled_from([torch.bool, torch.int64, torch.float32])))
    elif form == "segment_ids":
        batch["attention_mask"] = ids
    elif form == "4d":
        same = ids[:, :, None] == ids[:, None, :]
        batch["attention_mask"] = (same & torch.ones(S, S, dtype=torch.bool).tril())[:, None]
    if form == "position_ids" or draw(st.booleans()):
        batch["position_ids"] = pos
    if draw(st.booleans()):
        labels = torch.randint(0, 100, (B, S), generator=g)
        labels[torch.rand(B, S, generator=g) < 0.2] = IGNORE
        labels[torch.rand(B, S, generator=g) < 0.1] = -1  # no target in another convention
        batch["labels"] = labels
    if draw(st.booleans()):
        batch["loss_mask"] = (torch.rand(B, S, generator=g) < 0.8).to(
            draw(st.sampled_from([torch.float32, torch.bool]))
        )
    if draw(st.booleans()):
        batch["weights"] = torch.rand(B, S, generator=g)
    return batch, samples, form


MUTATIONS = {
    # name: (expected, where it applies)
    "none": "pack",
    "shape": "raise",
    "float_tokens": "raise",
    "float_labels": "raise",
    "list_value": "raise",
    "empty": "raise",
    "negative_real_token": "raise",
    "negative_pad_token": "pack",
    "position_not_restarting": "raise",
    "key_set_to_none": "pack",
    "packed_key": "raise",
    "all_pad": "raise",
    "negative_mask_value": "raise",
    "hole": "raise",
    "two_token_tensors": "raise",
    "non_tensor_extra": "raise",
}


def mutate(batch, samples, form, name, draw):
    """Apply one mutation; returns the (possibly new) samples reference."""
    B, S = batch["tokens"].shape
    real = torch.zeros(B, S, dtype=torch.bool)
    for b, s, n in samples:
        real[b, s : s + n] = True
    if name == "shape":
        key = draw(st.sampled_from([k for k in batch if k != "tokens"] or ["tokens"]))
        t = batch[key]
        dim = draw(st.integers(0, t.dim() - 1))
        grow = draw(st.booleans()) or t.shape[dim] == 1
        if grow:
            extra = list(t.shape)
            extra[dim] = 1
            batch[key] = torch.cat([t, torch.zeros(extra, dtype=t.dtype)], dim=dim)
        else:
            batch[key] = t.narrow(dim, 0, t.shape[dim] - 1)
    elif name == "float_tokens":
        batch["tokens"] = batch["tokens"].float()
    elif name == "float_labels":
        batch["labels"] = torch.zeros(B, S)
    elif name == "list_value":
        key = draw(st.sampled_from(sorted(batch)))
        batch[key] = batch[key].tolist()
    elif name == "empty":
        dim = draw(st.integers(0, 1))
        for key, t in list(batch.items()):
            index = [slice(None)] * t.dim()
            index[dim if key != "attention_mask" or t.dim() == 2 else (0 if dim == 0 else 3)] = slice(0, 0)
            batch[key] = t[tuple(index)]
    elif name == "negative_real_token":
        b, s, n = draw(st.sampled_from(samples))
        batch["tokens"][b, s + draw(st.integers(0, n - 1))] = -draw(st.integers(1, 5))
    elif name == "negative_pad_token":
        pads = (~real).nonzero().tolist()
        if not pads:
            return samples, "pack"
        b, j = draw(st.sampled_from(pads))
        batch["tokens"][b, j] = -3
    elif name == "position_not_restarting":
        # A sample counts from k > 0. Without a mask the ids define the samples, so the sample mutated is a row's
        # first (a later one could read as the continuation of the one before it).
        b, s, n = draw(st.sampled_from([x for x in samples if form != "position_ids" or x[1] == 0]))
        pos = torch.zeros(B, S, dtype=torch.long)
        for bb, ss, nn in samples:
            pos[bb, ss : ss + nn] = torch.arange(nn)
        pos[b, s : s + n] += draw(st.integers(1, 3))
        batch["position_ids"] = pos
    elif name == "key_set_to_none":
        batch[draw(st.sampled_from(["labels", "loss_mask", "weights"]))] = None
    elif name == "packed_key":
        batch[draw(st.sampled_from(["cu_seqlens", "cu_seqlens_q", "max_seqlen"]))] = torch.tensor([0, 1])
    elif name == "all_pad":
        if form == "position_ids":
            batch["attention_mask"] = torch.zeros(B, S, dtype=torch.long)
            batch.pop("position_ids")
        elif form == "4d":
            batch["attention_mask"] = torch.zeros(B, 1, S, S, dtype=torch.bool)
        else:
            batch["attention_mask"] = torch.zeros(B, S, dtype=batch["attention_mask"].dtype)
        batch.pop("position_ids", None)
    elif name == "negative_mask_value":
        if form in ("4d", "position_ids"):
            batch["attention_mask"] = torch.ones(B, S, dtype=torch.long)
            batch.pop("position_ids", None)
        mask = batch["attention_mask"].clone().long()
        mask[draw(st.integers(0, B - 1)), draw(st.integers(0, S - 1))] = -1
        batch["attention_mask"] = mask
    elif name == "hole":
        runs = [(b, s, n) for b, s, n in samples if n >= 3]
        if form not in ("01_right", "01_left") or not runs:
            return samples, "either"
        b, s, n = draw(st.sampled_from(runs))
        mask = batch["attention_mask"].clone()
        mask[b, s + draw(st.integers(1, n - 2))] = 0
        batch["attention_mask"] = mask
    elif name == "two_token_tensors":
        batch["input_ids"] = batch["tokens"].clone()
    elif name == "non_tensor_extra":
        batch["metadata"] = [{"row": b} for b in range(B)]
    return samples, MUTATIONS[name]


def expected_labels(batch, samples, B, S):
    """The label each real token must carry after packing (None where no check applies)."""
    tokens = batch["tokens"].long()
    labels = batch.get("labels")
    want = torch.full((B, S), IGNORE, dtype=torch.long)
    by_row = {}
    for b, s, n in samples:
        by_row.setdefault(b, []).append((s, n))
    for b, runs in by_row.items():
        runs.sort()
        for k, (s, n) in enumerate(runs):
            if labels is None:
                want[b, s : s + n - 1] = tokens[b, s + 1 : s + n]
            else:
                want[b, s : s + n] = labels[b, s : s + n]
                if k + 1 < len(runs):  # labels shifted over the row: the last token's label crosses
                    want[b, s + n - 1] = IGNORE
    return want


def check_round_trip(p: PackedBatch, batch, samples):
    B, S = batch["tokens"].shape
    real = torch.zeros(B, S, dtype=torch.bool)
    for b, s, n in samples:
        real[b, s : s + n] = True
    assert p.num_real_tokens == int(real.sum()) == int((~p.padding_mask).sum())
    assert sorted(
        zip(p.segments.row.tolist(), p.segments.start.tolist(), p.segments.length.tolist(), strict=True)
    ) == sorted(samples)
    assert torch.equal(unpack_thd(p.tokens, p)[real], batch["tokens"].long()[real])
    want = expected_labels(batch, samples, B, S)
    got = unpack_thd(p.labels, p, pad_value=IGNORE)
    assert torch.equal(got[real], want[real])
    counted = (want >= 0) & real
    weight = batch.get("loss_mask")
    weight = torch.ones(B, S) if weight is None else weight.float()
    assert torch.equal(unpack_thd(p.loss_mask, p)[real], (weight * counted)[real])
    if batch.get("weights") is not None:
        assert torch.equal(unpack_thd(p.extra["weights"], p)[real], batch["weights"][real])


@pytest.mark.parametrize("name", sorted(MUTATIONS))
@settings(FUZZ, max_examples=60)
@given(data=st.data(), made=bshd_batches(), alignment=alignments)
def test_pack_bshd_packs_and_round_trips_or_raises(name, data, made, alignment):
    batch, samples, form = made
    samples, expected = mutate(batch, samples, form, name, data.draw)
    kind, result = outcome(lambda: pack_bshd(batch, alignment=alignment))
    if expected == "raise":
        assert kind == "raised", f"{name} packed silently"
    elif expected == "pack":
        assert kind == "ok", f"{name}: {result!r}"
    if kind == "ok":
        check_round_trip(result, batch, samples)


# ---------------------------------------------------------------------------------------------------------
# from_packed_batch


@st.composite
def packed_batches(draw):
    """A packed row in one of the adopted forms, and its real tokens as ``[(start, length)]``."""
    form = draw(
        st.sampled_from(["nemo", "bridge_legacy", "bridge_legacy_unpadded", "bridge_offline", "in_batch"])
    )
    multiple = draw(st.sampled_from([1, 2, 4])) if form != "bridge_legacy_unpadded" else 1
    n = draw(st.integers(1, 4))
    lengths = [draw(st.integers(1, 6)) for _ in range(n)]
    slots = [-(-x // multiple) * multiple for x in lengths]
    fill = draw(st.integers(0, 5))
    T = sum(slots) + fill
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    tokens = torch.full((1, T), 2)
    labels = torch.full((1, T), 2)
    loss_mask = torch.zeros(1, T, dtype=torch.long)
    position_ids = torch.zeros(1, T, dtype=torch.long)
    pad = torch.ones(1, T, dtype=torch.bool)
    real, start = [], 0
    for length, slot in zip(lengths, slots, strict=True):
        tokens[0, start : start + length] = torch.randint(3, 100, (length,), generator=g)
        labels[0, start : start + length] = torch.randint(3, 100, (length,), generator=g)
        loss_mask[0, start : start + length] = (torch.rand(length, generator=g) < 0.8).long()
        position_ids[0, start : start + slot] = torch.arange(slot)
        pad[0, start : start + length] = False
        real.append((start, length))
        start += slot
    physical = np.cumsum([0, *slots]).tolist()
    logical = np.cumsum([0, *lengths]).tolist()
    if fill:
        physical.append(T)
        logical.append(logical[-1])
    batch = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}
    sentinels = draw(st.integers(1, 2))
    repeats = draw(st.integers(0, 2))
    if form in ("nemo", "bridge_legacy", "bridge_legacy_unpadded"):
        phys = physical + [physical[-1]] * repeats + [-1] * sentinels
        batch["cu_seqlens"] = torch.tensor([phys], dtype=torch.int32)
        if draw(st.booleans()):
            batch["cu_seqlens_argmin"] = torch.tensor([[len(physical) + repeats]])
        batch["max_seqlen"] = torch.tensor(
            [[max(physical[i + 1] - physical[i] for i in range(len(physical) - 1))]]
        )
        if form == "bridge_legacy_unpadded":
            batch["token_count"] = [sum(slots)]
        else:
            batch["cu_seqlens_unpadded"] = torch.tensor([logical + [-1] * sentinels], dtype=torch.int32)
            if draw(st.booleans()):
                batch["cu_seqlens_unpadded_argmin"] = torch.tensor([[len(logical)]])
        batch["attention_mask"] = torch.tensor([1]) if form == "nemo" else None
    else:
        one_array = multiple == 1 and draw(st.booleans())
        rep = [physical[-1]] * repeats
        if one_array:  # Bridge offline without pad_seq_to_mult: the fill is a slot, padding_mask tells
            batch["cu_seqlens_q"] = torch.tensor([physical + rep], dtype=torch.int32)
            batch["padding_mask"] = pad
        else:
            batch["cu_seqlens_q"] = torch.tensor([logical + [logical[-1]] * repeats], dtype=torch.int32)
            batch["cu_seqlens_q_padded"] = torch.tensor([physical + rep], dtype=torch.int32)
            batch["cu_seqlens_kv_padded"] = batch["cu_seqlens_q_padded"]
            if draw(st.booleans()):
                batch["padding_mask"] = pad
        batch["cu_seqlens_kv"] = batch["cu_seqlens_q"]
        if form == "in_batch":
            for key in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
                if key in batch:
                    batch[key] = batch[key][0]
            batch["input_ids"] = batch["tokens"]
            batch["total_tokens"] = T
    return batch, real, form


PACKED_MUTATIONS = {
    "none": "pack",
    "end_past_row": "raise",
    "decreasing": "raise",
    "argmin_off": "raise",
    "sample_outgrows_slot": "raise",
    "padding_mask_flipped": "raise",
    "loss_on_pad": "pack",  # zeroed where the boundaries say pad (Megatron-LM's rule)
    "float_labels": "raise",
    "two_rows": "raise",
    "mixed_names": "raise",
    "negative_real_token": "raise",
    "boundaries_as_list": "raise",
    "no_boundaries": "raise",
    "float_boundaries": "raise",
    "total_tokens_off": "raise",
    "value_after_sentinel": "either",
}


def mutate_packed(batch, real, form, name, draw):
    """Apply one mutation; returns ``(expected, real)``, ``real`` None where the given padding mask decides."""
    T = batch["tokens"].shape[1]
    legacy = "cu_seqlens" in batch
    phys_key = (
        "cu_seqlens"
        if legacy
        else "cu_seqlens_q_padded"
        if "cu_seqlens_q_padded" in batch
        else "cu_seqlens_q"
    )
    log_key = (
        "cu_seqlens_unpadded" if legacy else "cu_seqlens_q" if phys_key == "cu_seqlens_q_padded" else None
    )
    has_logical = log_key is not None and log_key in batch
    valid = int((batch[phys_key] >= 0).sum())
    if name in ("end_past_row", "decreasing", "float_boundaries", "boundaries_as_list"):
        for kv in ("cu_seqlens_kv", "cu_seqlens_kv_padded"):  # the rule under test, not kv = q
            batch.pop(kv, None)
    if name == "end_past_row":
        cu = batch[phys_key].clone()
        cu.view(-1)[valid - 1] = T + draw(st.integers(1, 3))
        batch[phys_key] = cu
    elif name == "decreasing":
        cu = batch[phys_key].clone()
        if valid >= 3:
            cu.view(-1)[1] = cu.view(-1)[2] + 1
        else:
            cu.view(-1)[0] = 1  # does not start at 0
        batch[phys_key] = cu
    elif name == "argmin_off":
        if "cu_seqlens" not in batch:
            return "either", real
        batch["cu_seqlens_argmin"] = torch.tensor([[valid - 1]])
    elif name == "sample_outgrows_slot":
        if not has_logical:
            return "either", real
        cu = batch[log_key].clone()
        cu.view(-1)[1] = batch[phys_key].view(-1)[1] + 1
        batch[log_key] = cu
        batch.pop("cu_seqlens_kv", None)
    elif name == "padding_mask_flipped":
        mask = torch.ones(1, T, dtype=torch.bool)
        for s, n in real:
            mask[0, s : s + n] = False
        j = draw(st.integers(0, T - 1))
        mask[0, j] = ~mask[0, j]
        batch["padding_mask"] = mask
        # With logical boundaries the mask must agree with them; without, it says which tokens are real.
        return ("raise", real) if has_logical else ("either", None)
    elif name == "loss_on_pad":
        batch["loss_mask"] = torch.ones(1, T, dtype=torch.long)
    elif name == "float_labels":
        batch["labels"] = batch["labels"].float()
    elif name == "two_rows":
        batch["tokens"] = torch.cat([batch["tokens"], batch["tokens"]])
        batch.pop("input_ids", None)
    elif name == "mixed_names":
        batch["cu_seqlens_q" if legacy else "cu_seqlens"] = torch.tensor([0, T])
    elif name == "negative_real_token":
        s, n = draw(st.sampled_from(real))
        tokens = batch["tokens"].clone()
        tokens[0, s + draw(st.integers(0, n - 1))] = -7
        batch["tokens"] = tokens
        batch.pop("input_ids", None)
    elif name == "boundaries_as_list":
        batch[phys_key] = batch[phys_key].tolist()
    elif name == "no_boundaries":
        for key in [k for k in batch if k.startswith(("cu_seqlens", "max_seqlen"))]:
            batch.pop(key)
    elif name == "float_boundaries":
        batch[phys_key] = batch[phys_key].float()
    elif name == "total_tokens_off":
        batch["total_tokens"] = T + 1
    elif name == "value_after_sentinel":
        if "cu_seqlens" not in batch:
            return "either", real
        cu = batch["cu_seqlens"].clone()
        cu[0, -1] = T  # the last sentinel becomes a boundary: after another sentinel, if there was one
        batch["cu_seqlens"] = cu
        batch.pop("cu_seqlens_argmin", None)
        return ("raise" if int((cu < 0).sum()) else "either"), real
    return PACKED_MUTATIONS[name], real


@pytest.mark.parametrize("name", sorted(PACKED_MUTATIONS))
@settings(FUZZ, max_examples=60)
@given(data=st.data(), made=packed_batches())
def test_from_packed_batch_adopts_and_round_trips_or_raises(name, data, made):
    batch, real, form = made
    expected, real = mutate_packed(batch, real, form, name, data.draw)
    kind, p = outcome(lambda: from_packed_batch(batch))
    if expected == "raise":
        assert kind == "raised", f"{form}/{name} adopted silently"
    elif expected == "pack":
        assert kind == "ok", f"{form}/{name}: {p!r}"
    if kind != "ok":
        return
    T = batch["tokens"].shape[1]
    if real is None:  # the given padding mask says which tokens are real
        want_real = ~batch["padding_mask"][0]
    else:
        want_real = torch.zeros(T, dtype=torch.bool)
        for s, n in real:
            want_real[s : s + n] = True
        assert p.segments.start.tolist() == [s for s, _ in real]
        assert p.segments.length.tolist() == [n for _, n in real]
    assert torch.equal(~p.padding_mask[0], want_real), f"{form}/{name}: real tokens moved or lost"
    for key in ("tokens", "labels"):
        back = unpack_thd(getattr(p, key), p)[0]
        assert torch.equal(back[want_real], batch[key][0].long()[want_real]), f"{form}/{name}: {key}"
    lm = batch["loss_mask"][0].float() * (batch["labels"][0] >= 0)
    assert torch.equal(unpack_thd(p.loss_mask, p)[0][want_real], lm[want_real])
    assert not p.loss_mask[p.padding_mask].any(), f"{form}/{name}: loss counted on pad"


# ---------------------------------------------------------------------------------------------------------
# plan_layout, find_segments, unpack_thd


@settings(FUZZ, max_examples=200)
@given(
    st.lists(st.one_of(st.integers(-2, 8), st.sampled_from([2**30, 2**31 - 1, 2**31, 2**40])), max_size=4),
    st.sampled_from([torch.int64, torch.int32, torch.float32]),
    alignments,
)
def test_plan_layout_boundaries_never_wrap(values, dtype, alignment):
    lengths = torch.tensor(values, dtype=torch.int64).to(dtype) if values else torch.zeros(0, dtype=dtype)
    kind, layout = outcome(lambda: plan_layout(lengths, alignment))
    v = lengths.to(torch.int64).tolist() if dtype != torch.float32 else values
    bad = dtype == torch.float32 or not v or min(v) < 1
    if kind == "raised":
        if not bad:  # then the only rule left is the int32 size of the row
            m = alignment.sample_multiple
            assert sum(-(-x // m) * m for x in v) > INT32_MAX - alignment.total_multiple, layout
        return
    assert not bad
    exact = np.cumsum([0, *layout.padded_lengths.tolist()])
    assert layout.cu_seqlens_padded.tolist() == exact.tolist() and exact[-1] <= INT32_MAX


@settings(FUZZ, max_examples=200)
@given(
    st.integers(0, 3),
    st.integers(0, 5),
    st.sampled_from(
        [torch.bool, torch.uint8, torch.int32, torch.int64, torch.float32, torch.bfloat16, torch.complex64]
    ),
    st.sampled_from(["2d", "4d", "1d", "positions"]),
    st.lists(st.sampled_from([0, 0, 1, 1, 2, 3, -1, 0.5, float("nan"), float("inf"), 1e30]), min_size=1),
)
def test_find_segments_returns_valid_samples_or_raises(B, S, dtype, shape, values):
    n = {"2d": B * S, "4d": B * S * S, "1d": S, "positions": B * S}[shape]
    flat = (values * (n // len(values) + 1))[:n]
    t = torch.tensor(flat, dtype=torch.float64)
    if not dtype.is_floating_point and dtype != torch.complex64:
        t = torch.nan_to_num(t, nan=0.0, posinf=5.0).clamp(-2, 5).round()
    t = t.to(dtype).reshape({"2d": (B, S), "4d": (B, 1, S, S), "1d": (S,), "positions": (B, S)}[shape])
    if shape == "4d" and dtype not in (torch.bool, torch.float32, torch.bfloat16):
        t = t != 0
    call = (lambda: find_segments(position_ids=t)) if shape == "positions" else (lambda: find_segments(t))
    kind, segments = outcome(call)
    if kind == "ok":
        segments.check((B, S))


@settings(FUZZ, max_examples=50)
@given(st.sampled_from([(), (9,), (1, 9), (9, 2), (8,), (1, 8, 3), (2, 9)]), st.booleans())
def test_unpack_thd_returns_the_batch_shape_or_raises(shape, as_list):
    p = pack_bshd(
        {
            "tokens": torch.arange(12).view(3, 4),
            "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1] * 4]),
        }
    )
    x = torch.zeros(shape)
    kind, out = outcome(lambda: unpack_thd(x.tolist() if as_list else x, p))
    if kind == "ok":
        assert out.shape[:2] == (3, 4)
    else:
        assert as_list or shape not in [(9,), (1, 9), (9, 2)], out
