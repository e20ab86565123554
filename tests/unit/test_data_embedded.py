"""Specification of the ``embedded`` corpus (the stdlib's sources cut into documents), built once per session
into a temporary cache."""

import sysconfig
from pathlib import Path

import numpy as np
import pytest

from thdpack.data import ByteTokenizer
from thdpack.data.embedded import EXCLUDED_DIRS, EmbeddedDataset, cut_documents, main

STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("thdpack-cache")


@pytest.fixture(scope="session")
def corpus(cache_dir):
    return EmbeddedDataset(cache_dir=cache_dir)


def test_the_whole_corpus_builds_from_an_empty_cache(corpus):
    assert corpus.build_seconds > 0  # the fixture's cache was empty
    assert len(corpus) > 3000 and corpus.num_tokens > 5_000_000
    assert corpus.skipped_files == []


def test_a_cached_load_builds_nothing_and_returns_the_same_documents(corpus, cache_dir):
    again = EmbeddedDataset(cache_dir=cache_dir)
    assert again.build_seconds == 0.0
    assert again.cache_path == corpus.cache_path
    for i in (0, len(corpus) // 2, len(corpus) - 1):
        assert np.array_equal(again[i].tokens, corpus[i].tokens)
        assert again[i].source == corpus[i].source


def test_every_document_is_bos_source_lines_eos_from_the_named_line(corpus):
    tok = ByteTokenizer()
    lines_of = {}
    for i in range(len(corpus)):
        s = corpus[i]
        assert s.tokens.dtype == np.int64 and s.target_mask is None
        assert s.tokens[0] == tok.bos_id and s.tokens[-1] == tok.eos_id
        _, file, line = s.source.split(":")
        if file not in lines_of:
            lines_of[file] = (STDLIB / file).read_text(encoding="utf-8").split("\n")
        first_line = lines_of[file][int(line) - 1]
        body = tok.decode(s.tokens[1:-1])
        assert body.split("\n")[0] == first_line, s.source
        assert first_line.startswith(("def ", "async def ", "class ", '"', "'", "r'", 'r"', "@")), s.source


def test_lengths_vary_like_real_data(corpus):
    q = np.quantile(corpus.lengths, [0.5, 0.99])
    assert corpus.lengths.min() < 64
    assert q[1] > 10 * q[0]  # heavy tail: whole classes are documents
    assert corpus.lengths.max() > 32768


def test_length_stats_cover_every_document(corpus):
    stats = corpus.length_stats()
    assert sum(stats["buckets"].values()) == len(corpus)
    assert stats["tokens"] == corpus.num_tokens


def test_test_suites_and_generated_files_are_left_out(corpus):
    for file in corpus.files:
        assert not set(Path(file).parts[:-1]) & EXCLUDED_DIRS, file
        assert not Path(file).name.startswith("_sysconfigdata"), file
    assert corpus.files == sorted(corpus.files)


def test_max_files_takes_a_prefix_of_the_sorted_files(corpus, cache_dir):
    small = EmbeddedDataset(max_files=5, cache_dir=cache_dir)
    assert small.files == corpus.files[:5]
    assert np.array_equal(small[0].tokens, corpus[0].tokens)
    assert small.cache_path != corpus.cache_path


def test_cut_documents_takes_the_docstring_and_each_top_level_def_or_class():
    source = b'''"""Doc."""
import os

X = 1


@decorator
def f():
    """f's doc."""
    return 1


class C:
    def m(self):
        pass

if __name__ == "__main__":
    f()
'''
    docs = cut_documents(source)
    texts = [source[a:b].decode() for a, b, _ in docs]
    assert texts == [
        '"""Doc."""\n',
        '@decorator\ndef f():\n    """f\'s doc."""\n    return 1\n',
        "class C:\n    def m(self):\n        pass\n",
    ]
    assert [line for _, _, line in docs] == [1, 7, 13]


def test_a_module_without_trailing_newline_keeps_its_last_line():
    source = b"def f():\n    return 1"
    assert cut_documents(source) == [(0, len(source), 1)]


def test_module_main_prints_the_length_histogram(cache_dir, monkeypatch, capsys):
    monkeypatch.setenv("THDPACK_CACHE", str(cache_dir))
    main([])
    out = capsys.readouterr().out
    assert "cached load in" in out
    assert "quantiles: p0=" in out
    assert "built in" not in out  # the session's corpus was already cached
