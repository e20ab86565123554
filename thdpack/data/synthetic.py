"""``synthetic``: random tokens with lengths drawn from a lognormal law, for benchmarks (no learning signal).

Real corpora differ in their length mix, and packing pays by the pad a mix leaves: a chat-like mix (median ~700,
sigma 1.0, 32-8192 tokens) or a heavier tail (mean 1024, sigma 1.5, 128-8192) can be reproduced here without
data. Lengths are drawn once from ``seed`` and clipped to ``[min_length, max_length]``; sample ``i``'s tokens come
from a generator seeded with ``(seed, i)``, so the dataset is the same on every rank and every run.
"""

from __future__ import annotations

import math

import numpy as np

from .samples import Sample

__all__ = ["SyntheticDataset"]


class SyntheticDataset:
    """``num_samples`` samples of uniform random ids in ``[0, vocab_size)`` (``bos`` first when given).

    The lognormal is given by ``sigma`` and either its ``median`` (``exp(mu)``) or its ``mean``
    (``exp(mu + sigma**2 / 2)``).

    Attributes:
        lengths: int64 ``[num_samples]``.
    """

    def __init__(
        self,
        *,
        num_samples: int,
        vocab_size: int,
        sigma: float,
        median: float | None = None,
        mean: float | None = None,
        min_length: int = 1,
        max_length: int,
        seed: int = 0,
        bos_id: int | None = None,
    ):
        if (median is None) == (mean is None):
            raise ValueError("dataset.synthetic needs exactly one of 'median' and 'mean' (the lognormal's)")
        if not 1 <= min_length <= max_length:
            raise ValueError(
                f"dataset.synthetic: need 1 <= min_length ({min_length}) <= max_length ({max_length})"
            )
        if num_samples < 1 or sigma < 0:
            raise ValueError(f"dataset.synthetic: num_samples ({num_samples}) >= 1 and sigma ({sigma}) >= 0")
        mu = math.log(median) if median is not None else math.log(mean) - sigma**2 / 2
        rng = np.random.default_rng([seed, 0])
        drawn = rng.lognormal(mu, sigma, num_samples)
        self.lengths = np.clip(np.rint(drawn), min_length, max_length).astype(np.int64)
        self.vocab_size, self.seed, self.bos_id = vocab_size, seed, bos_id

    def __len__(self) -> int:
        return self.lengths.size

    def __getitem__(self, index: int) -> Sample:
        if not 0 <= index < len(self):
            raise IndexError(index)
        tokens = np.random.default_rng([self.seed, 1, index]).integers(
            0, self.vocab_size, self.lengths[index]
        )
        if self.bos_id is not None:
            tokens[0] = self.bos_id
        return Sample(tokens.astype(np.int64), None, f"synthetic#{index}")
