"""Specification of the ``megatron_indexed`` dataset, on a tiny ``.bin/.idx`` written by megatron-core."""

import numpy as np
import pytest
import torch

from thdpack.data.indexed import MegatronIndexedDataset


def build(prefix, documents, dtype=np.uint16):
    """Write ``documents`` (each a list of sequences, each a list of ids) with megatron-core's builder."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for sequences in documents:
        flat = [t for seq in sequences for t in seq]
        builder.add_document(torch.tensor(flat), [len(seq) for seq in sequences])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def test_round_trip_one_document_a_sample(tmp_path):
    prefix = build(tmp_path / "corpus", [[[1, 2, 3]], [[4, 5]], [[6, 7, 8, 9]]])
    data = MegatronIndexedDataset(prefix, vocab_size=259)
    assert len(data) == 3
    assert [data[i].tokens.tolist() for i in range(3)] == [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    assert data[1].tokens.dtype == np.int64 and data[1].target_mask is None
    assert data.lengths.tolist() == [3, 2, 4]


def test_a_document_of_several_sequences_is_one_sample(tmp_path):
    prefix = build(tmp_path / "c", [[[1, 2], [3]], [[4]]])
    data = MegatronIndexedDataset(prefix, vocab_size=10)
    assert data[0].tokens.tolist() == [1, 2, 3]
    assert data.lengths.tolist() == [3, 1]


def test_int32_storage_reads_back_as_int64(tmp_path):
    prefix = build(tmp_path / "c", [[[70000, 1]]], dtype=np.int32)
    assert MegatronIndexedDataset(prefix, vocab_size=100000)[0].tokens.tolist() == [70000, 1]


def test_source_names_prefix_and_document(tmp_path):
    prefix = build(tmp_path / "c", [[[1, 2]], [[3, 4]]])
    assert MegatronIndexedDataset(prefix, vocab_size=10)[1].source == f"{prefix}#1"


def test_ids_beyond_the_vocabulary_raise_naming_the_document(tmp_path):
    prefix = build(tmp_path / "c", [[[1, 2]], [[3, 300]]])
    data = MegatronIndexedDataset(prefix, vocab_size=259)
    data[0]
    with pytest.raises(ValueError, match=r"c#1: token 1 is 300: ids must lie in \[0, 259\)"):
        data[1]


def test_a_missing_prefix_is_named(tmp_path):
    with pytest.raises(ValueError, match="nothing"):
        MegatronIndexedDataset(str(tmp_path / "nothing"), vocab_size=10)
