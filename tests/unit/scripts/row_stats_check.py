"""Compare thdpack.fused.fused_row_stats with a plain statement of each statistic, and find_segments through
it with find_segments on the host (run by test_fused.py).

Run in its own process so that TRITON_INTERPRET=1 (set by the caller on a machine without CUDA) is seen
before Triton is first imported. Prints one line per failure and "ROW STATS OK <n>" at the end.
"""

import sys

import numpy as np
import torch

import thdpack.segments as seg
from thdpack import find_segments
from thdpack.fused import fused_row_stats

# Every dtype thdpack.fused.fused_row_stats_available accepts.
DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
]
FORMS = ["right", "left", "hole", "segment ids", "negative", "fraction", "nan", "inf", "empty row", "full"]


def random_mask(g: torch.Generator, form: str, dtype: torch.dtype) -> torch.Tensor:
    B = int(torch.randint(1, 6, (), generator=g))
    # Widths around the kernel's block of 1024 columns, and small ones.
    S = (
        int(torch.randint(1, 40, (), generator=g))
        if torch.rand((), generator=g) < 0.5
        else 1000 + int(torch.randint(0, 60, (), generator=g))
    )
    lengths = torch.randint(0, S + 1, (B,), generator=g)
    col = torch.arange(S)
    mask = (col < lengths[:, None]).long()
    if form == "left":
        mask = mask.flip(1)
    elif form == "full":
        mask = torch.ones(B, S, dtype=torch.long)
    elif form == "empty row":
        mask[int(torch.randint(0, B, (), generator=g))] = 0
    elif form == "hole" and S >= 3:
        b = int(torch.randint(0, B, (), generator=g))
        mask[b] = 1
        mask[b, int(torch.randint(1, S - 1, (), generator=g))] = 0
    elif form == "segment ids":
        mask = mask * torch.where(col < S // 2, 1, 2)
    elif form == "negative":
        mask[0, int(torch.randint(0, S, (), generator=g))] = -1
    if dtype == torch.bool:
        return mask != 0
    mask = mask.to(dtype)
    spot = (0, int(torch.randint(0, S, (), generator=g)))
    if form == "fraction" and dtype.is_floating_point:
        mask[spot] = 0.5
    elif form == "nan" and dtype.is_floating_point:
        mask[spot] = float("nan")
    elif form == "inf" and dtype.is_floating_point:
        mask[spot] = float("inf")
    return mask


def expected_stats(mask: torch.Tensor, pos: torch.Tensor | None) -> np.ndarray:
    """The seven rows of fused_row_stats, stated row by row in plain Python."""
    B, S = mask.shape
    out = np.zeros((7, B), dtype=np.int64)
    values = mask.double().tolist() if mask.is_floating_point() else mask.long().tolist()
    for b, row in enumerate(values):
        real = [v != 0 for v in row]  # NaN != 0
        cols = [j for j in range(S) if real[j]]
        out[0, b] = cols[0] if cols else 0
        out[1, b] = len(cols)
        out[2, b] = sum(real[j] and (j == 0 or not real[j - 1]) for j in range(S))
        if pos is not None:
            out[3, b] = any(real[j] and real[j - 1] and int(pos[b, j]) == 0 for j in range(1, S))
        if mask.dtype != torch.bool:
            out[4, b] = any(v < 0 for v in row)
            out[5, b] = any(v > 1 for v in row)
            out[6, b] = mask.is_floating_point() and any(v != v or v != float(np.trunc(v)) for v in row)
    return out


def segments_or_error(mask: torch.Tensor, pos: torch.Tensor | None = None):
    """find_segments' samples as lists, or its error message (also used by tests/unit/test_pack_gpu.py)."""
    try:
        s = find_segments(mask, position_ids=pos)
        return s.row.tolist(), s.start.tolist(), s.length.tolist()
    except ValueError as e:
        return str(e)


def main(n: int) -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    failures = 0
    for case in range(n):
        form, dtype = FORMS[case % len(FORMS)], DTYPES[case // len(FORMS) % len(DTYPES)]
        mask = random_mask(g, form, dtype)
        pos = None
        if case % 3 == 0:
            B, S = mask.shape
            pos = torch.arange(S).repeat(B, 1)
            if case % 2 == 0 and S > 4:  # a restart inside some rows
                pos[:, S // 2 :] -= S // 2
        got = fused_row_stats(mask.to(device), None if pos is None else pos.to(device)).cpu().numpy()
        want = expected_stats(mask, pos)
        # find_segments through the kernel (the CUDA path's statistics) against the host path.
        on_host = segments_or_error(mask, pos)
        host_stats = seg._row_stats_host
        seg._row_stats_host = lambda m, p: seg._row_stats_fused(
            m.to(device), None if p is None else p.to(device)
        )
        try:
            through_kernel = segments_or_error(mask, pos)
        finally:
            seg._row_stats_host = host_stats
        if not np.array_equal(got, want) or through_kernel != on_host:
            failures += 1
            print(f"case {case}: {form} {dtype} {list(mask.shape)} pos={pos is not None}")
            print(f"  stats {got.tolist()} expected {want.tolist()}")
            print(f"  find_segments {through_kernel} host {on_host}")
    print(f"ROW STATS {'OK' if not failures else 'FAILED'} {n - failures}/{n}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else len(FORMS) * len(DTYPES)))
