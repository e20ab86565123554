"""The Triton kernel behind :func:`thdpack.fused.fused_pack` (imported only when it is first used)."""

import triton
import triton.language as tl


@triton.jit(
    # No value or alignment specialization: thdpack._triton_launch keys the compiled kernel on types alone.
    do_not_specialize=[
        "tokens_ptr",
        "labels_ptr",
        "loss_mask_ptr",
        "table_ptr",
        "out_tokens_ptr",
        "out_long_ptr",
        "out_loss_mask_ptr",
        "out_pad_ptr",
        "T",
        "M",
        "pad_token_id",
        "ignore_index",
    ]
)
def pack_kernel(
    tokens_ptr,
    labels_ptr,
    loss_mask_ptr,
    table_ptr,
    out_tokens_ptr,
    out_long_ptr,
    out_loss_mask_ptr,
    out_pad_ptr,
    T,
    M,
    pad_token_id,
    ignore_index,
    STEPS: tl.constexpr,
    DERIVE: tl.constexpr,
    HAS_LOSS_MASK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    p = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = p < T
    # The per-segment table: int64 rows seg_start, shift, real_end, end_flag of M entries each, read from the
    # start of the uploaded buffer (whatever its element type).
    table = table_ptr.to(tl.pointer_type(tl.int64))
    # The segment of p: the last one whose start is <= p (starts ascend from 0).
    lo = tl.zeros([BLOCK], dtype=tl.int64)
    hi = tl.full([BLOCK], M, dtype=tl.int64)
    for _ in tl.static_range(STEPS):
        mid = (lo + hi) // 2
        go = tl.load(table + mid, mask=valid & (mid < M), other=T) <= p
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    start = tl.load(table + lo, mask=valid, other=0)
    shift = tl.load(table + M + lo, mask=valid, other=0)
    real_end = tl.load(table + 2 * M + lo, mask=valid, other=0)
    end_flag = tl.load(table + 3 * M + lo, mask=valid, other=0)

    is_pad = p >= real_end
    real = valid & (p < real_end)
    src = tl.where(is_pad, 0, p + shift)
    token = tl.load(tokens_ptr + src, mask=real, other=0)
    token = tl.where(is_pad, pad_token_id, token)
    # No target: pad, and a sample's last token when labels are derived or would cross into the next
    # sample of the same source row (end_flag).
    no_target = is_pad | ((p == real_end - 1) & (end_flag != 0))
    if DERIVE:
        label = tl.load(tokens_ptr + src + 1, mask=valid & ~no_target, other=0)
    else:
        label = tl.load(labels_ptr + src, mask=valid & ~no_target, other=0)
    label = tl.where(no_target, ignore_index, label.to(tl.int64))
    if HAS_LOSS_MASK:
        weight = tl.load(loss_mask_ptr + src, mask=real, other=0).to(tl.float32)
    else:
        weight = tl.full([BLOCK], 1.0, dtype=tl.float32)
    # A negative label is no target whatever its value (ignore_index, or -1 from another convention).
    weight = tl.where((label == ignore_index) | (label < 0), 0.0, weight)

    # out_long holds three [T] rows: labels, position ids, gather index.
    tl.store(out_tokens_ptr + p, token, mask=valid)
    tl.store(out_long_ptr + p, label, mask=valid)
    tl.store(out_long_ptr + T + p, p - start, mask=valid)
    tl.store(out_long_ptr + 2 * T + p, src, mask=valid)
    tl.store(out_loss_mask_ptr + p, weight, mask=valid)
    tl.store(out_pad_ptr + p, is_pad, mask=valid)
