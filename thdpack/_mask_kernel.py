"""The Triton kernel behind :func:`thdpack.fused.fused_row_stats` (imported only when it is first used)."""

import triton
import triton.language as tl


@triton.jit(
    # No value or alignment specialization: thdpack._triton_launch keys the compiled kernel on types alone.
    do_not_specialize=["mask_ptr", "position_ids_ptr", "out_ptr", "B", "S"]
)
def row_stats_kernel(
    mask_ptr,
    position_ids_ptr,
    out_ptr,
    B,
    S,
    KIND: tl.constexpr,  # 0: bool (read as uint8), 1: integer, 2: floating point
    HAS_POSITIONS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program per row. out is int64 [7, B]: first real column (0 in a row without one), real tokens,
    # runs of real tokens, and 0/1 for "a position id is 0 inside a run", a negative, a > 1 and a
    # fractional (or NaN) value.
    b = tl.program_id(0).to(tl.int64)
    row = b * S
    cols = tl.arange(0, BLOCK).to(tl.int64)
    first = tl.full([BLOCK], S, dtype=tl.int64)
    count = tl.zeros([BLOCK], dtype=tl.int64)
    runs = tl.zeros([BLOCK], dtype=tl.int64)
    restart = tl.zeros([BLOCK], dtype=tl.int64)
    negative = tl.zeros([BLOCK], dtype=tl.int64)
    above_one = tl.zeros([BLOCK], dtype=tl.int64)
    fractional = tl.zeros([BLOCK], dtype=tl.int64)
    # A while loop, not range(0, S, BLOCK): Triton's interpreter (the CPU tests) cannot take a runtime bound
    # in range() with numpy >= 2.4.
    lo = tl.program_id(0).to(tl.int64) * 0
    while lo < S:
        j = lo + cols
        inside = j < S
        v = tl.load(mask_ptr + row + j, mask=inside, other=0)
        before = tl.load(mask_ptr + row + j - 1, mask=inside & (j > 0), other=0)
        if KIND == 2:
            v = v.to(tl.float64)
            # Fractional as torch's mask != mask.trunc(): NaN is, +-inf and integral values are not
            # (|v| >= 2**52 is integral in float64).
            whole = (tl.abs(v) >= 4503599627370496.0) | (v == v.to(tl.int64).to(tl.float64))
            fractional += (inside & ~whole).to(tl.int64)
        if KIND != 0:
            negative += (v < 0).to(tl.int64)
            above_one += (v > 1).to(tl.int64)
        real = inside & (v != 0)
        real_before = before != 0
        first = tl.minimum(first, tl.where(real, j, S))
        count += real.to(tl.int64)
        runs += (real & ~real_before).to(tl.int64)
        if HAS_POSITIONS:
            p = tl.load(position_ids_ptr + row + j, mask=real & real_before, other=1)
            restart += (real & real_before & (p == 0)).to(tl.int64)
        lo += BLOCK
    n = tl.sum(count, axis=0)
    first_col = tl.min(first, axis=0)
    tl.store(out_ptr + b, tl.where(n > 0, first_col, 0))
    tl.store(out_ptr + B + b, n)
    tl.store(out_ptr + 2 * B + b, tl.sum(runs, axis=0))
    tl.store(out_ptr + 3 * B + b, (tl.sum(restart, axis=0) > 0).to(tl.int64))
    tl.store(out_ptr + 4 * B + b, (tl.sum(negative, axis=0) > 0).to(tl.int64))
    tl.store(out_ptr + 5 * B + b, (tl.sum(above_one, axis=0) > 0).to(tl.int64))
    tl.store(out_ptr + 6 * B + b, (tl.sum(fractional, axis=0) > 0).to(tl.int64))
