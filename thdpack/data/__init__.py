"""The data pipeline of the training product: datasets of :class:`Sample`, a collator that right-pads them into
BSHD micro-batches with 2D attention masks (what :func:`thdpack.pack_bshd` packs), and :class:`TrainData`, the
deterministic, data-parallel sharded, resumable loader the training loop calls.

Datasets (imported lazily by :func:`build_train_data`): :class:`~thdpack.data.embedded.EmbeddedDataset` (the
Python stdlib's sources, no download), :class:`~thdpack.data.embedded_sft.EmbeddedSFTDataset` (chat pairs from
them), :class:`~thdpack.data.jsonl.JsonlDataset` (checked in one pass at start-up),
:class:`~thdpack.data.indexed.MegatronIndexedDataset`.
"""

from .budget import DEFAULT_COST_WEIGHTS, plan_microbatches, sample_cost
from .collate import IGNORE_INDEX, collate
from .loader import TrainData, build_dataset, build_train_data
from .samples import Sample, format_length_stats, length_stats
from .tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer

__all__ = [
    "DEFAULT_COST_WEIGHTS",
    "IGNORE_INDEX",
    "ByteTokenizer",
    "HFTokenizer",
    "Sample",
    "TrainData",
    "build_dataset",
    "build_tokenizer",
    "build_train_data",
    "collate",
    "format_length_stats",
    "length_stats",
    "plan_microbatches",
    "sample_cost",
]
