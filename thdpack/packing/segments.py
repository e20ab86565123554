"""Find the real samples of a padded batch.

Every input form listed in docs/design.md is reduced to two boolean ``[B, S]`` host tensors, ``real`` (a real
token) and ``begins`` (a real token that starts a sample); a sample runs from a ``begins`` position to just
before the next ``begins`` or non-real position. Everything here is vectorized over the batch: the only Python
loops are on the error path, to name the first offending row and column.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from . import paths
from .validate import check_segment_inputs

__all__ = ["Segments", "find_segments"]


@dataclass(frozen=True)
class Segments:
    """The real samples of a ``[B, S]`` batch, one entry per sample, row-major (by row, then by start).

    Sample ``i`` is ``tokens[row[i], start[i] : start[i] + length[i]]``.

    Attributes:
        row: int64 host tensor ``[N]``.
        start: int64 host tensor ``[N]``.
        length: int64 host tensor ``[N]``, every entry >= 1.
    """

    row: torch.Tensor
    start: torch.Tensor
    length: torch.Tensor

    @classmethod
    def from_numpy(cls, row: np.ndarray, start: np.ndarray, length: np.ndarray) -> Segments:
        """Segments over int64 numpy arrays ``[N]`` (the tensors share their memory)."""
        return cls(row=torch.from_numpy(row), start=torch.from_numpy(start), length=torch.from_numpy(length))

    @functools.cached_property
    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(row, start, length)`` as numpy arrays sharing the tensors' memory: host work reads these (numpy's
        per-call overhead is lower than torch's at these sizes, and each tensor conversion costs about as much
        as a small numpy operation)."""
        return self.row.numpy(), self.start.numpy(), self.length.numpy()

    def __len__(self) -> int:
        return self.row.numel()

    @property
    def num_tokens(self) -> int:
        """Number of real tokens over all samples."""
        return int(self.length.sum())

    def check(self, batch_shape: tuple[int, int]) -> None:
        """Raise ``ValueError`` unless these segments are valid for a ``[B, S]`` batch.

        Valid means: host int64 tensors of one shape, every sample inside the batch, length >= 1, row-major order
        and no two samples overlapping.
        """
        B, S = batch_shape
        for name in ("row", "start", "length"):
            t = getattr(self, name)
            if not t.is_cpu or t.dtype != torch.int64 or t.dim() != 1:
                raise ValueError(
                    f"Segments.{name} must be a 1-D int64 host tensor, got {t.dtype} on {t.device}"
                )
        if not (self.row.shape == self.start.shape == self.length.shape):
            raise ValueError("Segments.row, .start and .length must have the same length")
        if len(self) == 0:
            raise ValueError("Segments holds no sample: a batch needs at least one real token")
        row, start, length = self.arrays
        # One pass of cheap reductions decides the common case. With every start in [0, S) (start >= 0,
        # length >= 1, start + length <= S), each sample ending no later than the next one's flat start makes
        # the flat starts increase strictly, so the rows never decrease and the first and last bound them all.
        flat = row * S + start
        end = flat + length
        if (
            row[0] >= 0
            and row[-1] < B
            and start.min() >= 0
            and length.min() >= 1
            and (start + length).max() <= S
            and (flat[1:] >= end[:-1]).all()
        ):
            return
        self._raise_first_invalid(B, S)

    def _raise_first_invalid(self, B: int, S: int) -> None:
        """Name the first sample that breaks a rule of :meth:`check` (error path only)."""
        row, start, length = self.arrays
        end = start + length
        bad = (row < 0) | (row >= B) | (start < 0) | (length < 1) | (end > S)
        if bad.any():
            i = int(bad.argmax())
            raise ValueError(
                f"sample {i} (row {row[i]}, start {start[i]}, length {length[i]}) does not fit a batch of shape "
                f"[{B}, {S}]: needs 0 <= row < {B}, start >= 0, length >= 1 and start + length <= {S}"
            )
        bad = row[1:] * S + start[1:] < row[:-1] * S + end[:-1]
        i = int(bad.argmax()) + 1
        raise ValueError(
            f"sample {i} (row {row[i]}, start {start[i]}) overlaps or precedes sample {i - 1}: segments must "
            "be row-major and disjoint"
        )


def find_segments(
    attention_mask: torch.Tensor | None = None,
    *,
    position_ids: torch.Tensor | None = None,
    input_ids: torch.Tensor | None = None,
    pad_token_id: int | None = None,
) -> Segments:
    """Find the real samples of a padded batch.

    Args:
        attention_mask: one of
            - ``[B, S]`` 0/1 mask (bool, int or float), right or left padding; the real tokens of a row must be
              contiguous;
            - ``[B, S]`` segment ids (any value > 1 present): ``1,1,2,2,2,0`` is two samples and one pad; each id
              must form one contiguous run within its row, 0 is pad;
            - ``[B, 1, S, S]`` block-diagonal causal mask, bool (True = attend) or additive float (0 = attend,
              -inf or <= -1e4 = blocked). Real tokens are those that attend to themselves.
        position_ids: ``[B, S]`` int. Without a mask: every token is real and a sample starts wherever the id is
            0 (ids must count up by 1 within a sample). With a 2D mask: splits the mask's real runs where the id
            restarts at 0 (HF ``DataCollatorWithFlattening`` style).
        input_ids: ``[B, S]`` int, used with ``pad_token_id`` when there is neither mask nor position ids:
            only the *trailing* run of ``pad_token_id`` in each row is pad (an inner pad id is taken as a real
            token; this form is wrong when the pad id is also a real token at a row's end, e.g. EOS-as-pad).
        pad_token_id: see ``input_ids``.

    Returns:
        ``Segments(row, start, length)``, int64 host tensors ``[N]``, row-major. Rows without a real token are
        skipped.

    Raises:
        TypeError: an argument that is not a tensor, a mask that is not bool, integer or floating, position ids
            or input ids that are not integer, a ``pad_token_id`` that is not an int.
        ValueError: naming the row, column and rule, for holes in a 0/1 mask, split segment ids, a 4D mask that
            is not block-diagonal causal, negative or non-integer values, shape mismatches, an empty batch
            (``B = 0`` or ``S = 0``), or a batch with no real token at all.

    With a 4D mask, position ids are not read (the mask alone says where samples start; only their shape is
    checked): :func:`thdpack.pack_bshd` checks them against the samples.

    A mask on the GPU costs one device-to-host copy (for a 0/1 mask, of a ``[2B + 5]`` table of per-row
    statistics), and so do position ids on the GPU next to a host mask (of the columns the restart check reads);
    pass host tensors, which data loaders deliver, to cost none.
    """
    check_segment_inputs(attention_mask, position_ids, input_ids, pad_token_id)
    return segments_of(attention_mask, position_ids, input_ids, pad_token_id)


def segments_of(
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    input_ids: torch.Tensor | None = None,
    pad_token_id: int | None = None,
) -> Segments:
    """:func:`find_segments` after its entrance checks (for callers that ran them already, e.g. ``pack_bshd``)."""
    if attention_mask is not None:
        if attention_mask.dim() == 4:
            if position_ids is not None:
                _check_shape(
                    "position_ids", position_ids, (attention_mask.shape[0], attention_mask.shape[-1])
                )
            real, begins = _from_4d_mask(attention_mask)
        elif attention_mask.dim() == 2:
            if position_ids is not None:
                _check_shape("position_ids", position_ids, tuple(attention_mask.shape))
            runs = _row_runs(attention_mask, position_ids)
            if runs is not None and runs[2]:
                # The ids restart only at column 0, where a run starts anyway: nothing to split.
                position_ids = None
            if runs is not None and position_ids is None:
                first, length, _ = runs
                keep = np.flatnonzero(length)  # the rows with a real token
                if keep.size < length.size:
                    if keep.size == 0:
                        raise ValueError(
                            f"the batch of shape {list(attention_mask.shape)} has no real token: every row is pad"
                        )
                    first, length = first[keep], length[keep]
                return Segments.from_numpy(keep, first, length)
            if runs is None:  # segment ids
                ids = _host(attention_mask)
                real, begins = _from_segment_ids(ids, ids != 0)
            else:
                first, length = (torch.from_numpy(v) for v in runs[:2])
                col = torch.arange(attention_mask.shape[1])
                real = (col >= first[:, None]) & (col < (first + length)[:, None])
                begins = real & (col == first[:, None])
            if position_ids is not None:
                begins = begins | (real & (_host(position_ids) == 0))
        else:
            raise ValueError(
                f"attention_mask has shape {list(attention_mask.shape)}: expected [B, S] (0/1 or segment ids) or "
                "[B, 1, S, S] (block-diagonal causal)"
            )
    elif position_ids is not None:
        real, begins = _from_position_ids(position_ids)
    elif input_ids is not None and pad_token_id is not None:
        real, begins = _from_trailing_pad(input_ids, pad_token_id)
    else:
        raise ValueError(
            "find_segments needs attention_mask, position_ids, or input_ids together with pad_token_id"
        )
    return _segments_from_runs(real, begins)


def _host(t: torch.Tensor) -> torch.Tensor:
    # One device-to-host copy at most per input tensor; a host tensor is returned as is.
    return t if t.is_cpu else t.cpu()


def _check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if t.shape != tuple(shape):  # torch.Size is a tuple
        raise ValueError(f"{name} has shape {list(t.shape)} but the batch is {list(shape)}")


def _shift_right(x: torch.Tensor, fill: bool | int) -> torch.Tensor:
    """``x[:, j-1]`` at column ``j`` (``fill`` at column 0)."""
    out = torch.empty_like(x)
    out[:, 0] = fill
    out[:, 1:] = x[:, :-1]
    return out


def _check_integral_nonnegative(name: str, m: torch.Tensor) -> None:
    bad = m < 0
    if m.is_floating_point():
        # Values from 2^62 on would not convert to int64 exactly (and no batch has that many samples).
        bad = bad | (m != m.round()) | ~torch.isfinite(m) | (m >= 2.0**62)
    if bool(bad.any()):
        b, j = (int(v) for v in bad.nonzero()[0])
        raise ValueError(
            f"row {b} of {name} has value {m[b, j].item()} at column {j}: a 2D mask holds 0/1 or segment ids "
            "(non-negative integers, 0 = pad)"
        )


def _row_runs(
    mask: torch.Tensor, position_ids: torch.Tensor | None = None
) -> tuple[np.ndarray, np.ndarray, bool] | None:
    """``(first column, length, no_restart)`` for a 0/1 mask: each row's real run (int64 numpy ``[B]``) and
    whether ``position_ids`` (if given) surely do not restart at 0 inside a real run (then the mask alone
    decides the samples). None when the mask holds segment ids. Raises on negative or fractional values
    and on holes.
    """
    row_stats = _row_stats_host if paths.numpy_path(mask) else _row_stats_device
    first, length, holes, restarts, negative, above_one, fractional = row_stats(mask, position_ids)
    if negative or fractional:
        _check_integral_nonnegative("attention_mask", _host(mask))
    if above_one:
        return None
    if holes:
        # Error path only: the first row whose real tokens form more than one run (a mask on the GPU is copied to
        # the host once).
        real = _host(mask) != 0
        runs = (real[:, 1:] & ~real[:, :-1]).sum(1) + real[:, 0]
        b = int((runs > 1).int().argmax())
        hole = _first_hole(real[b])
        raise ValueError(
            f"row {b} of attention_mask has a hole at column {hole}: a 0/1 mask must be contiguous (use segment "
            "ids 1,2,3 for several samples per row)"
        )
    return first, length, not restarts


def _first_hole(row: torch.Tensor) -> int | None:
    """First column of a 0 between two real tokens of a 1-D mask row, or None."""
    cols = (row != 0).nonzero().flatten()
    gaps = (cols.diff() > 1).nonzero()
    return int(cols[int(gaps[0])]) + 1 if gaps.numel() else None


# Both statistics functions return ``(first, length, holes, restarts, negative, above_one, fractional)``:
# each row's first real column and real-token count (int64 numpy ``[B]``; None when a flag says the mask is
# not 0/1), whether some row's real tokens are not contiguous, whether the position ids may restart at 0
# inside a real run, and whether the mask has negative, > 1 or fractional values. With holes, first, length and
# restarts are undefined: the caller raises.


def _row_stats_host(mask: torch.Tensor, position_ids: torch.Tensor | None) -> tuple:
    # The passes over the [B, S] mask are numpy's, on one thread (see the note below _row_stats_host; torch only
    # converts a bfloat16 mask).
    negative = above_one = fractional = False
    if mask.dtype == torch.bool:
        r = mask.numpy()
    else:
        m = (mask.float() if mask.dtype == torch.bfloat16 else mask).numpy()  # bfloat16: exact in float32
        r = m != 0
        if m.size:
            with np.errstate(invalid="ignore"):  # NaN compares False here, and is caught as not finite
                negative, above_one = bool(m.min() < 0), bool(m.max() > 1)
            if mask.is_floating_point():
                fractional = not bool(np.isfinite(m).all()) or bool((m != np.round(m)).any())
    if negative or above_one or fractional:
        return None, None, False, False, negative, above_one, fractional
    length = np.count_nonzero(r, axis=1).astype(np.int64, copy=False)
    first = r.argmax(axis=1)  # find_segments' entrance refused empty batches
    runs = np.count_nonzero(r[:, 1:] & ~r[:, :-1], axis=1) + r[:, 0]
    holes = bool((runs > 1).any())
    restarts = False
    if position_ids is not None and not holes and length.size:
        # The columns some run covers beyond its first.
        restarts = _may_restart(position_ids, int(first.min()) + 1, int((first + length).max()))
    return first, length, holes, restarts, False, False, False


# Why numpy, on one thread, and not torch's intra-op pool, for the passes over a host mask: the pool is a few
# percent faster only when it has every core to itself. On a 16-core GPU VM host, right after GPU work,
# find_segments took 0.34-2.2 ms (medians of 300 calls; p90 up to 9 ms) with a pool of 16 threads and 0.57-0.78 ms
# with one (benchmarks/results/gpu_mask_stats_2026-11-22.md, section 4). On this project's 2-core CPU with one core
# busy, pack_bshd took 2.2-5.1 ms at 64x8192 with torch's bool copy on 2 threads against 1.6-1.7 ms with numpy's;
# idle, numpy's cost 0-6% more (section 5 there). torchrun sets OMP_NUM_THREADS=1.


def _may_restart(position_ids: torch.Tensor, lo: int, hi: int) -> bool:
    """Whether some position id in columns ``[lo, hi)`` may be 0: there a real run may hold several samples.
    A zero id on pad among these columns also says "may", and so does a negative id (the check is ``min <= 0``);
    the exact path then decides, and splits runs at zeros only."""
    if hi <= lo:
        return False
    # From a GPU, only these columns come to the host.
    ids = position_ids.numpy()[:, lo:hi] if position_ids.is_cpu else position_ids[:, lo:hi].cpu().numpy()
    return int(ids.min()) <= 0  # one numpy pass; min <= 0 stands for "a zero"


def _row_stats_device(mask: torch.Tensor, position_ids: torch.Tensor | None) -> tuple:
    # Reduced on the GPU; one copy of a [2B + 5] table comes back.
    B = mask.shape[0]
    zero = torch.zeros((), dtype=torch.int64, device=mask.device)
    if mask.dtype == torch.bool:
        real, negative, above_one, fractional = mask, zero, zero, zero
    else:
        lo, hi = torch.aminmax(mask)
        negative, above_one = (lo < 0).long(), (hi > 1).long()
        fractional = (mask != mask.trunc()).any().long() if mask.is_floating_point() else zero
        real = mask != 0
    u = real.view(torch.uint8)
    holes = ((u[:, 1:] > u[:, :-1]).sum(1) + u[:, 0] > 1).any().long()
    if position_ids is None:
        restarts = zero
    else:
        restarts = ((position_ids[:, 1:] == 0) & real[:, 1:] & real[:, :-1]).any().long().to(mask.device)
    scalars = torch.stack([holes, restarts, negative, above_one, fractional])
    table = torch.cat([u.argmax(dim=1), u.sum(dim=1), scalars]).cpu()
    holes, restarts, negative, above_one, fractional = (bool(v) for v in table[2 * B :].tolist())
    if negative or above_one or fractional:
        return None, None, False, False, negative, above_one, fractional
    return table[:B].numpy(), table[B : 2 * B].numpy(), holes, restarts, False, False, False


def _from_segment_ids(ids: torch.Tensor, real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _check_integral_nonnegative("attention_mask", ids)
    ids = ids.long()
    begins = real & ((ids != _shift_right(ids, -1)) | ~_shift_right(real, False))
    rows, cols = begins.nonzero(as_tuple=True)
    # The ids renumbered 0..K-1 first, so that row * K + id cannot overflow int64 whatever the ids' values.
    values, renumbered = torch.unique(ids[rows, cols], return_inverse=True)
    key = rows * values.numel() + renumbered
    _, inverse, counts = torch.unique(key, return_inverse=True, return_counts=True)
    if bool((counts > 1).any()):
        first_repeated = key[int((counts[inverse] > 1).nonzero()[0])]
        dup = int((key == first_repeated).nonzero()[1])  # the second run of that id
        b, j = int(rows[dup]), int(cols[dup])
        raise ValueError(
            f"row {b} of attention_mask has segment id {int(ids[b, j])} again at column {j}: each segment id must "
            "be one contiguous run within its row"
        )
    return real, begins


def _from_4d_mask(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    B, H, Sq, Sk = mask.shape
    if H != 1 or Sq != Sk:
        raise ValueError(f"a 4D attention_mask must be [B, 1, S, S], got {list(mask.shape)}")
    m = _host(mask)[:, 0]
    if m.dtype == torch.bool:
        attend = m
    elif m.is_floating_point():
        bad = (m != 0) & ~(m <= -1e4)
        if bool(bad.any()):
            b, i, j = (int(v) for v in bad.nonzero()[0])
            raise ValueError(
                f"row {b} of the 4D attention_mask has value {m[b, i, j].item()} at query {i}, key {j}: an additive "
                "mask holds 0 (attend) or -inf / <= -1e4 (blocked)"
            )
        attend = m == 0
    else:
        raise TypeError(
            f"attention_mask is a 4D {m.dtype} mask: a 4D mask must be bool (True = attend) or additive float"
        )
    real = attend.diagonal(dim1=1, dim2=2).clone()
    to_prev = torch.zeros_like(real)
    to_prev[:, 1:] = attend.diagonal(offset=-1, dim1=1, dim2=2)
    begins = real & ~(to_prev & _shift_right(real, False))
    seg = torch.cumsum(begins, dim=1) * real
    col = torch.arange(Sq)
    expected = (seg[:, :, None] == seg[:, None, :]) & (col[None, :] <= col[:, None]) & real[:, None, :]
    bad = (attend != expected) & real[:, :, None]
    if bool(bad.any()):
        b, i, j = (int(v) for v in bad.nonzero()[0])
        what = "attends" if bool(attend[b, i, j]) else "does not attend"
        raise ValueError(
            f"row {b} of the 4D attention_mask is not block-diagonal causal: query {i} {what} key {j} (a query "
            "must attend exactly to the keys of its own sample at or before it)"
        )
    return real, begins


def _from_position_ids(position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if position_ids.dim() != 2:
        raise ValueError(f"position_ids must be [B, S], got {list(position_ids.shape)}")
    p = _host(position_ids)
    if p.is_floating_point():
        raise ValueError(f"position_ids must be an integer tensor, got {p.dtype}")
    if bool((p < 0).any()):
        b, j = (int(v) for v in (p < 0).nonzero()[0])
        raise ValueError(f"row {b} of position_ids has negative id {int(p[b, j])} at column {j}")
    begins = p == 0
    step_ok = begins | (p == _shift_right(p, -1) + 1)
    step_ok[:, 0] = begins[:, 0]
    if not bool(step_ok.all()):
        b, j = (int(v) for v in (~step_ok).nonzero()[0])
        prev = f"from {int(p[b, j - 1])} to {int(p[b, j])}" if j else f"with {int(p[b, j])}"
        raise ValueError(
            f"row {b} of position_ids starts a run {prev} at column {j}: without a mask, position ids must "
            "restart at 0 at each sample and count up by 1 within it"
        )
    return torch.ones_like(begins), begins


def _from_trailing_pad(input_ids: torch.Tensor, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, S], got {list(input_ids.shape)}")
    ids = _host(input_ids)
    B, S = ids.shape
    nonpad = ids != pad_token_id
    # Length = index of the last non-pad token + 1 (0 for an all-pad row).
    last = S - nonpad.flip(1).int().argmax(dim=1)
    length = torch.where(nonpad.any(dim=1), last, 0)
    col = torch.arange(S)
    real = col < length[:, None]
    begins = real & (col == 0)
    return real, begins


def _segments_from_runs(real: torch.Tensor, begins: torch.Tensor) -> Segments:
    B, S = real.shape
    begins = begins | (real & ~_shift_right(real, False))
    nxt_real = torch.zeros_like(real)
    nxt_real[:, :-1] = real[:, 1:]
    nxt_begins = torch.zeros_like(begins)
    nxt_begins[:, :-1] = begins[:, 1:]
    ends = real & (~nxt_real | nxt_begins)
    starts_flat = begins.flatten().nonzero().flatten()
    ends_flat = ends.flatten().nonzero().flatten()
    if starts_flat.numel() == 0:
        raise ValueError(f"the batch of shape [{B}, {S}] has no real token: every row is pad")
    row = starts_flat // S
    start = starts_flat % S
    return Segments(row=row, start=start, length=ends_flat - starts_flat + 1)
