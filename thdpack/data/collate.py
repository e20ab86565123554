"""``collate``: samples to one right-padded BSHD micro-batch (host tensors), the input ``pack_bshd`` packs."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from thdpack.packing.labels import IGNORE_INDEX, no_target

from .samples import Sample

__all__ = ["IGNORE_INDEX", "PAD_TO", "collate"]

PAD_TO = ("seq_length", "longest")


def collate(
    samples: Sequence[Sample],
    seq_length: int,
    pad_id: int,
    pad_to: str = "seq_length",
    mrope: bool = False,
) -> dict[str, torch.Tensor]:
    """Right-pad ``samples`` into one micro-batch.

    Args:
        samples: ``B >= 1`` samples, each ``1 <= L <= seq_length`` tokens (the loader applies the ``overlong``
            rule first).
        seq_length: the model's sequence length.
        pad_id: token written on pad.
        pad_to: ``"seq_length"`` (``S = seq_length``, fixed shapes) or ``"longest"`` (``S`` = the longest sample
            here: less pad to build and move; the packer drops pad either way).
        mrope: also return ``mrope_position_ids``.

    Returns:
        ``tokens`` int64 ``[B, S]`` (``pad_id`` on pad);
        ``labels`` int64 ``[B, S]``, shifted within each row: ``labels[b, i] = tokens[b, i + 1]`` when position
        ``i + 1`` is a real token and a target (``target_mask[i + 1]``), else ``IGNORE_INDEX``;
        ``loss_mask`` float32 ``[B, S]``, 1 where the label is a target (:func:`thdpack.packing.labels.no_target`);
        ``attention_mask`` int64 ``[B, S]``, 1 on real tokens (a prefix of each row), 0 on pad;
        ``seq_lengths`` int64 ``[B]``, the real tokens of each row (what the packer takes instead of decoding
        the mask);
        with ``mrope`` or any sample's own ``mrope_position_ids``: ``mrope_position_ids`` int64 ``[3, B, S]``,
        each row the sample's own ids, or text-only ids (every axis the position within the sample) for a sample
        without them; pad continues counting from the row's largest id + 1;
        with any sample's ``mm_token_type_ids``: ``vision_index`` int64 ``[B, S]``, on each image token 1 + its
        ordinal among the micro-batch's image tokens in row-major order (the row of the vision tower's output
        that replaces its embedding), 0 elsewhere;
        each ``media`` key of the samples (``pixel_values``, ``image_grid_thw``): the samples' arrays
        concatenated on dim 0 in row order, so image ``k`` of the micro-batch is the ``k``-th run of image
        tokens in row-major order.
    """
    if pad_to not in PAD_TO:
        raise ValueError(f"pad_to is '{pad_to}': it must be one of {list(PAD_TO)}")
    if not samples:
        raise ValueError("collate needs at least one sample")
    lengths = np.array([len(s.tokens) for s in samples], dtype=np.int64)
    for row, s in enumerate(samples):
        if s.tokens.ndim != 1 or not 1 <= len(s.tokens) <= seq_length:
            raise ValueError(
                f"row {row} ({s.source}) has shape {list(s.tokens.shape)}: a sample is 1 to seq_length "
                f"({seq_length}) tokens (apply the loader's 'overlong' rule first)"
            )
        if s.target_mask is not None and s.target_mask.shape != s.tokens.shape:
            raise ValueError(
                f"row {row} ({s.source}): target_mask {list(s.target_mask.shape)} does not match tokens "
                f"{list(s.tokens.shape)}"
            )
    B, S = len(samples), int(seq_length if pad_to == "seq_length" else lengths.max())
    tokens = np.full((B, S), pad_id, dtype=np.int64)
    labels = np.full((B, S), IGNORE_INDEX, dtype=np.int64)
    for row, s in enumerate(samples):
        L = len(s.tokens)
        tokens[row, :L] = s.tokens
        following = s.tokens[1:]
        labels[row, : L - 1] = (
            following if s.target_mask is None else np.where(s.target_mask[1:], following, IGNORE_INDEX)
        )
    batch = {
        "tokens": torch.from_numpy(tokens),
        "labels": torch.from_numpy(labels),
        "loss_mask": torch.from_numpy((~no_target(labels)).astype(np.float32)),
        "attention_mask": torch.from_numpy((np.arange(S) < lengths[:, None]).astype(np.int64)),
        "seq_lengths": torch.from_numpy(lengths),
    }
    if mrope or any(s.mrope_position_ids is not None for s in samples):
        batch["mrope_position_ids"] = torch.from_numpy(_mrope_rows(samples, S))
    if any(s.mm_token_type_ids is not None for s in samples):
        is_image = np.zeros((B, S), dtype=bool)
        for row, s in enumerate(samples):
            if s.mm_token_type_ids is not None:
                is_image[row, : len(s.tokens)] = s.mm_token_type_ids != 0
        batch["vision_index"] = torch.from_numpy(
            np.where(is_image, np.cumsum(is_image.ravel()).reshape(B, S), 0)
        )
    for key in sorted({k for s in samples for k in (s.media or {})}):
        arrays = [s.media[key] for s in samples if s.media and key in s.media]
        filled = [a for a in arrays if a.size] or arrays[:1]
        batch[key] = torch.from_numpy(np.ascontiguousarray(np.concatenate(filled, axis=0)))
    return batch


def _mrope_rows(samples: Sequence[Sample], S: int) -> np.ndarray:
    """int64 ``[3, B, S]``: each sample's MRoPE ids (text ids when it has none), pad counting on from max + 1."""
    out = np.empty((3, len(samples), S), dtype=np.int64)
    for row, s in enumerate(samples):
        L = len(s.tokens)
        ids = s.mrope_position_ids
        if ids is None:
            out[:, row] = np.arange(S)
            continue
        if ids.shape != (3, L):
            raise ValueError(
                f"row {row} ({s.source}): mrope_position_ids {list(ids.shape)} do not match its {L} tokens: "
                "[3, L] expected"
            )
        out[:, row, :L] = ids
        out[:, row, L:] = (int(ids.max()) + 1 if L else 0) + np.arange(S - L)
    return out
