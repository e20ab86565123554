"""``megatron_indexed``: a Megatron ``.bin/.idx`` pair (what ``tools/preprocess_data.py`` writes), one document
a sample, read through megatron-core's ``IndexedDataset`` (imported lazily: importing megatron-core takes
seconds).

Tokens are used as stored: no bos/eos is added (``preprocess_data.py --append-eod`` writes the eod itself).
A document made of several sequences (sentence-split data) becomes one sample, its sequences concatenated.
"""

from __future__ import annotations

import numpy as np

from .samples import Sample

__all__ = ["MegatronIndexedDataset"]


class MegatronIndexedDataset:
    """``<prefix>.bin`` / ``<prefix>.idx`` as a sequence of :class:`Sample` (plain LM: ``target_mask`` None).

    Args:
        prefix: path without the ``.bin``/``.idx`` suffix.
        vocab_size: ids must lie in ``[0, vocab_size)``; checked per sample when it is read.

    Attributes:
        lengths: int64 ``[N]`` tokens per document (read from the index, no token read).
    """

    def __init__(self, prefix: str, vocab_size: int):
        try:
            from megatron.core.datasets.indexed_dataset import IndexedDataset
        except ImportError as e:  # pragma: no cover - megatron-core is a dependency
            raise ImportError(
                "dataset 'megatron_indexed' needs megatron-core: pip install 'megatron-core>=0.16'"
            ) from e
        self.prefix = str(prefix)
        if not IndexedDataset.exists(self.prefix):
            raise ValueError(f"dataset path '{self.prefix}': no {self.prefix}.bin and {self.prefix}.idx pair")
        self.vocab_size = vocab_size
        self._data = IndexedDataset(self.prefix)
        # document_indices[d] .. document_indices[d + 1] are the sequences of document d.
        self._docs = np.asarray(self._data.document_indices, dtype=np.int64)
        seq_lengths = np.asarray(self._data.sequence_lengths, dtype=np.int64)
        ends = np.concatenate([[0], np.cumsum(seq_lengths)])  # token offset of each sequence boundary
        self.lengths = ends[self._docs[1:]] - ends[self._docs[:-1]]

    def __len__(self) -> int:
        return len(self._docs) - 1

    def __getitem__(self, index: int) -> Sample:
        if not -len(self) <= index < len(self):
            raise IndexError(f"document {index} of {self.prefix} ({len(self)} documents)")
        index = index % len(self)
        where = f"{self.prefix}#{index}"
        first, last = self._docs[index], self._docs[index + 1]
        parts = [self._data[int(s)] for s in range(first, last)]
        tokens = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
        if len(tokens) == 0:
            raise ValueError(f"{where}: empty document: a sample needs at least one token")
        bad = np.flatnonzero((tokens < 0) | (tokens >= self.vocab_size))
        if bad.size:
            raise ValueError(
                f"{where}: token {bad[0]} is {tokens[bad[0]]}: ids must lie in [0, {self.vocab_size}) "
                "(was the data tokenized with another tokenizer?)"
            )
        return Sample(tokens, None, where)
