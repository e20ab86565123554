"""Specification of the byte-level tokenizer and ``build_tokenizer``."""

import importlib.util

import numpy as np
import pytest

from thdpack.data import ByteTokenizer, build_tokenizer


@pytest.mark.parametrize("text", ["", "hello", "naïve café", "日本語 ✓ 🚀", "tab\tnew\nline\x00nul"])
def test_byte_tokenizer_round_trips_any_text(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids.dtype == np.int64
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_byte_ids_are_the_utf8_bytes_and_specials_follow():
    tok = ByteTokenizer()
    assert tok.encode("Aé").tolist() == [65, 0xC3, 0xA9]
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (256, 257, 258, 259)


def test_decode_drops_specials_and_replaces_invalid_utf8():
    tok = ByteTokenizer()
    assert tok.decode([tok.bos_id, 104, 105, tok.eos_id, tok.pad_id]) == "hi"
    assert tok.decode([0xC3]) == "\ufffd"  # half a character


def test_build_tokenizer_byte_is_the_default():
    assert isinstance(build_tokenizer(), ByteTokenizer)
    assert isinstance(build_tokenizer("byte"), ByteTokenizer)


def test_build_tokenizer_names_a_missing_file(tmp_path):
    with pytest.raises(ValueError, match="nope.json"):
        build_tokenizer(str(tmp_path / "nope.json"))


@pytest.mark.skipif(importlib.util.find_spec("tokenizers") is not None, reason="tokenizers is installed")
def test_tokenizer_json_without_the_library_says_what_to_install(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text("{}")
    with pytest.raises(ImportError, match="pip install tokenizers"):
        build_tokenizer(str(path))
