"""Megatron-Bridge's offline packed batch of several rows (``GPTSFTPackedDataset.collate_fn`` of
``src/megatron/bridge/data/packing/gpt_sft.py`` over a data-parallel rank's global batch) as the one row
:func:`thdpack.packing.adopt.from_packed_batch` adopts.

Bridge collates every row a rank gets into ``[B, T]`` tensors and ``cu_seqlens_q`` ``[B, K]``, a row with fewer
samples filled by repeating its last boundary (its test ``test_collate_fn_supports_different_sequence_counts``:
``[[0, 3, 6, 7], [0, 7, 7, 7]]``). A row shorter than ``T`` ends in a fill (EOS tokens), a slot of its own or the
tail of its last declared sequence, True in ``padding_mask`` (or, without it, after the row's ``token_count``).
Side by side in one row, a row's fill lies between samples: it joins its row's last sample as pad after the
sample's real tokens (physical slot longer than the logical one), marked in ``padding_mask``.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

__all__ = ["rows_as_one"]

_DROPPED = ("max_seqlen_q", "max_seqlen_kv", "token_count", "metadata", "attention_mask", "cu_seqlens_kv")


def rows_as_one(batch: Mapping) -> dict:
    """``batch`` (Bridge's offline form, ``B > 1`` rows of ``T`` tokens) as one row of ``B * T`` tokens in the same
    form: ``cu_seqlens_q`` ``[1, K']`` holding each row's samples in turn, every ``[B, T]`` tensor flattened, the
    padding mask given or built from ``token_count``; ``max_seqlen_*`` dropped (a merged slot is longer)."""
    fields = {k: v for k, v in batch.items() if v is not None}
    tokens = fields["tokens"] if "tokens" in fields else fields["input_ids"]
    rows, width = tokens.shape
    bounds = _host(fields["cu_seqlens_q"], "cu_seqlens_q").reshape(rows, -1)
    kv = fields.get("cu_seqlens_kv")
    if kv is not None and not np.array_equal(_host(kv, "cu_seqlens_kv").reshape(rows, -1), bounds):
        raise ValueError(
            "batch keys 'cu_seqlens_kv' and 'cu_seqlens_q' differ: a packed row attends causally"
        )
    pad = fields.get("padding_mask")
    if pad is not None:
        pad = _host(pad, "padding_mask").reshape(rows, width).astype(bool)
    else:
        count = fields.get("token_count")
        count = count.reshape(-1).tolist() if isinstance(count, torch.Tensor) else count
        if not isinstance(count, list | tuple) or len(count) != rows:
            raise ValueError(
                f"a packed batch of {rows} rows needs 'padding_mask' [B, T] or 'token_count' (one per row) to tell "
                "each row's fill"
            )
        pad = np.arange(width)[None, :] >= np.asarray(count, dtype=np.int64)[:, None]
    joined = [0]
    for r in range(rows):
        row = np.unique(bounds[r])  # the repeats that fill a row are zero-length slots
        if row[0] != 0 or row[-1] > width:
            raise ValueError(
                f"row {r} of cu_seqlens_q is {bounds[r].tolist()}: it must run from 0 to at most {width}"
            )
        if row[-1] < width:
            row = np.append(row, width)  # tokens after the last boundary: the row's fill
        if r < rows - 1:
            while len(row) > 2 and pad[r, row[-2] : row[-1]].all():
                row = np.delete(row, -2)  # an all-fill slot joins the sample before it
        joined += (row[1:] + r * width).tolist()
    out = {k: v for k, v in fields.items() if k not in _DROPPED and k != "padding_mask"}
    for key, value in out.items():
        if isinstance(value, torch.Tensor) and tuple(value.shape) == (rows, width):
            out[key] = value.reshape(1, rows * width)
    out["cu_seqlens_q"] = torch.tensor([joined], dtype=torch.int32)
    out["padding_mask"] = torch.from_numpy(pad.reshape(1, rows * width))
    return out


def _host(value, key: str) -> np.ndarray:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"batch key '{key}' is a {type(value).__name__}: a tensor is needed")
    if not value.is_cpu:
        raise ValueError(f"batch key '{key}' is on {value.device}: from_packed_batch reads it on the host")
    return value.numpy()
