"""Specification of ``embedded_sft``: stdlib functions as chat pairs (signature and docstring -> body), the loss on
the body, tokenized as a JSONL messages row would be; deterministic and cached."""

import os

import numpy as np
import pytest

from thdpack.data import ByteTokenizer
from thdpack.data.embedded_sft import EmbeddedSFTDataset, function_pairs

SOURCE = b'''"""Module docstring."""
import os


def plain(x):
    """Return x doubled."""
    # a comment that belongs to the body
    return 2 * x


def undocumented(x):
    return x


@decorate
def decorated(
    a,
    b,
):
    """Add.

    Two lines.
    """

    return a + b


def stub():
    """Subclasses do this."""
    raise NotImplementedError


def dots():
    """Nothing."""
    ...


class Box:
    """A box."""

    def get(self):
        """The content."""
        if self.full:
            return self.item
        return None
'''


def test_each_documented_function_and_method_gives_one_pair_in_source_order():
    pairs = function_pairs(SOURCE, "mod.py")
    assert [line for line, _, _ in pairs] == [5, 15, 41]


def test_the_user_turn_is_the_signature_and_docstring_as_written():
    _, user, _ = function_pairs(SOURCE, "mod.py")[1]
    assert user == (
        "Write the body of `decorated` from the Python standard library's mod.py:\n\n"
        '@decorate\ndef decorated(\n    a,\n    b,\n):\n    """Add.\n\n    Two lines.\n    """'
    )


def test_the_assistant_turn_is_the_body_dedented_without_blank_edges():
    pairs = function_pairs(SOURCE, "mod.py")
    assert pairs[0][2] == "# a comment that belongs to the body\nreturn 2 * x"
    assert pairs[1][2] == "return a + b"


def test_methods_are_named_by_their_class_and_dedented():
    _, user, body = function_pairs(SOURCE, "mod.py")[2]
    assert "`Box.get`" in user and user.endswith('def get(self):\n    """The content."""')
    assert body == "if self.full:\n    return self.item\nreturn None"


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("sft-cache")


@pytest.fixture(scope="module")
def small(cache_dir):
    return EmbeddedSFTDataset(max_files=8, cache_dir=cache_dir)


def test_byte_pairs_use_role_tags_and_target_the_body_and_eos(small):
    tok = ByteTokenizer()
    sample = small[0]
    assert sample.source.startswith("stdlib:") and sample.tokens[0] == tok.bos_id
    targets = sample.tokens[sample.target_mask]
    assert targets[-1] == tok.eos_id
    prompt = tok.decode(sample.tokens[~sample.target_mask])
    assert prompt.startswith("<|user|>\nWrite the body of `") and prompt.endswith("<|assistant|>\n")
    assert len(small) == len(small.lengths) and small.lengths.tolist()[:3] == [
        len(small[i]) for i in range(3)
    ]


def test_a_second_build_loads_the_cache_and_gives_the_same_pairs(small, cache_dir):
    again = EmbeddedSFTDataset(max_files=8, cache_dir=cache_dir)
    assert again.build_seconds == 0.0
    assert np.array_equal(again.lengths, small.lengths)
    assert [again[i].source for i in range(5)] == [small[i].source for i in range(5)]


def test_pairs_through_a_chat_template_target_the_body_and_end_of_turn(tmp_path, cache_dir):
    pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tests.hf_tokenizers import write_tokenizer
    from thdpack.hf.tokenizer import PretrainedTokenizer

    tok = PretrainedTokenizer(write_tokenizer(tmp_path / "qwen", "qwen2_5").path)
    data = EmbeddedSFTDataset(tok, max_files=1, cache_dir=cache_dir)
    byte = EmbeddedSFTDataset(max_files=1, cache_dir=cache_dir)
    assert len(data) == len(byte) > 0
    sample = data[0]
    body = ByteTokenizer().decode(byte[0].tokens[byte[0].target_mask])
    assert tok.hf.decode(sample.tokens[sample.target_mask].tolist()) == body + "<|im_end|>"
