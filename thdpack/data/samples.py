"""``Sample``: one training sequence as every dataset yields it, and length statistics over many of them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

__all__ = [
    "Sample",
    "SampleDataset",
    "format_length_stats",
    "known_lengths",
    "known_min_lengths",
    "length_stats",
]


@dataclass
class Sample:
    """One sequence, before padding.

    Attributes:
        tokens: int64 ``[L]``, ``L >= 1``.
        target_mask: bool ``[L]`` or None. ``target_mask[i]`` is True when token ``i`` is a target the loss
            predicts (from position ``i - 1``). ``target_mask[0]`` is never used: nothing precedes the first
            token. None means plain language modelling: every token but the first is a target.
        source: where the sample comes from, for errors and logs (``file:line``, ``prefix#document``).
        mrope_position_ids: int64 ``[3, L]`` or None: the model's own MRoPE ids of this sample (a
            vision-language sample: text and image tokens numbered by the checkpoint's rule); None = text ids.
        mm_token_type_ids: int8 ``[L]`` or None: 1 on image tokens (transformers' processor output name);
            image tokens are never targets and never cut (:meth:`truncated` refuses).
        media: arrays that are not token-aligned, by name (``pixel_values [P, D]``, ``image_grid_thw [I, 3]``):
            :func:`thdpack.data.collate` concatenates them over a micro-batch in row order.

    Worked example (byte tokenizer, SFT ``{"prompt": "Hi", "response": "Yo"}``)::

        tokens      = [bos, 'H', 'i', 'Y', 'o', eos]
        target_mask = [ F,   F,   F,   T,   T,   T ]     # the response and its eos are predicted

    :func:`thdpack.data.collate` turns it into Megatron's already-shifted labels (``labels[i]`` = the token
    that position ``i`` predicts)::

        labels      = [-100, -100, 'Y', 'o', eos, -100]
        loss_mask   = [ 0,    0,    1,   1,   1,   0  ]
    """

    tokens: np.ndarray
    target_mask: np.ndarray | None = None
    source: str = "?"
    mrope_position_ids: np.ndarray | None = None
    mm_token_type_ids: np.ndarray | None = None
    media: dict[str, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_targets(self) -> int:
        """Tokens the loss predicts."""
        if self.target_mask is None:
            return max(len(self.tokens) - 1, 0)
        return int(np.count_nonzero(self.target_mask[1:]))

    def truncated(self, length: int) -> Sample:
        """The first ``length`` tokens (and their target mask, MRoPE ids and token types).

        Raises ``ValueError`` naming the source when an image token lies at or after ``length``: an image is
        never cropped (its tokens and its patches must match).
        """
        types = self.mm_token_type_ids
        if types is not None and types[length:].any():
            raise ValueError(
                f"{self.source}: sample of {len(self.tokens)} tokens has image tokens at or after position "
                f"{length}: cutting it to {length} tokens would crop an image (raise seq_length, shrink the "
                "images, or use overlong='drop')"
            )

        def cut(a):
            return None if a is None else a[..., :length]

        return dataclasses.replace(
            self,
            tokens=self.tokens[:length],
            target_mask=cut(self.target_mask),
            mrope_position_ids=cut(self.mrope_position_ids),
            mm_token_type_ids=cut(types),
        )


class SampleDataset(Protocol):
    """What the loader takes: a deterministic sequence of :class:`Sample`. A dataset that knows its lengths
    without reading the samples may also expose ``lengths`` (int64 ``[N]``)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Sample: ...


class Subset:
    """Samples ``start`` to ``stop`` of ``dataset`` (e.g. a held-out tail for evaluation), as a dataset."""

    def __init__(self, dataset: SampleDataset, start: int, stop: int):
        if not 0 <= start <= stop <= len(dataset):
            raise ValueError(f"subset [{start}, {stop}) is outside a dataset of {len(dataset)} samples")
        self.dataset, self.start, self.stop = dataset, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, index: int) -> Sample:
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self.dataset[self.start + index]


def known_lengths(dataset: SampleDataset) -> np.ndarray | None:
    """int64 ``[N]`` sample lengths when the dataset knows them without reading its samples (a ``lengths``
    attribute, through :class:`Subset`), else None."""
    if isinstance(dataset, Subset):
        inner = known_lengths(dataset.dataset)
        return None if inner is None else inner[dataset.start : dataset.stop]
    lengths = getattr(dataset, "lengths", None)
    return None if lengths is None else np.asarray(lengths, dtype=np.int64)


def known_min_lengths(dataset: SampleDataset) -> np.ndarray | None:
    """int64 ``[N]``: per sample, the shortest prefix a truncation may keep (through its last image token), when
    the dataset knows it without reading its samples (a ``min_lengths`` attribute, through :class:`Subset`)."""
    if isinstance(dataset, Subset):
        inner = known_min_lengths(dataset.dataset)
        return None if inner is None else inner[dataset.start : dataset.stop]
    keep = getattr(dataset, "min_lengths", None)
    return None if keep is None else np.asarray(keep, dtype=np.int64)


def split_holdout(dataset: SampleDataset, holdout: int) -> tuple[SampleDataset, SampleDataset]:
    """``(train, held out)``: the last ``holdout`` samples are held out and never trained on."""
    if not 0 <= holdout < len(dataset):
        raise ValueError(
            f"cannot hold out {holdout} of {len(dataset)} samples for evaluation: lower trainer.eval_samples"
        )
    return Subset(dataset, 0, len(dataset) - holdout), Subset(dataset, len(dataset) - holdout, len(dataset))


QUANTILES = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)


def length_stats(lengths: Sequence[int] | np.ndarray) -> dict:
    """Counts per log2 bucket and quantiles of sample lengths.

    Returns:
        ``{"samples": N, "tokens": sum, "mean": float, "buckets": {lo: count}, "quantiles": {q: length}}``;
        bucket ``lo`` holds lengths in ``[lo, 2 * lo)`` (``lo`` a power of two; empty buckets omitted).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size == 0:
        return {"samples": 0, "tokens": 0, "mean": 0.0, "buckets": {}, "quantiles": {}}
    if lengths.min() < 1:
        raise ValueError("length_stats takes lengths >= 1")
    exponent = np.floor(np.log2(lengths)).astype(np.int64)
    counts = np.bincount(exponent)
    return {
        "samples": int(lengths.size),
        "tokens": int(lengths.sum()),
        "mean": float(lengths.mean()),
        "buckets": {1 << int(e): int(c) for e, c in enumerate(counts) if c},
        "quantiles": {
            q: int(v) for q, v in zip(QUANTILES, np.quantile(lengths, QUANTILES, method="lower"), strict=True)
        },
    }


def format_length_stats(stats: dict) -> str:
    """A small text table of :func:`length_stats`."""
    lines = [f"samples {stats['samples']}, tokens {stats['tokens']}, mean length {stats['mean']:.1f}"]
    width = max(stats["buckets"].values(), default=1)
    for lo, count in stats["buckets"].items():
        bar = "#" * max(1, round(40 * count / width))
        lines.append(f"  [{lo:>7}, {2 * lo:>7})  {count:>7}  {bar}")
    lines.append("  quantiles: " + ", ".join(f"p{round(q * 100)}={v}" for q, v in stats["quantiles"].items()))
    return "\n".join(lines)
