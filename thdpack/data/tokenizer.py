"""Tokenizers for the data pipeline: a byte-level one that needs nothing (the default) and HF ``tokenizer.json``.

A tokenizer here is anything with ``encode(str) -> int64 [L]``, ``decode(ids) -> str``, ``vocab_size``,
``pad_id``, ``bos_id``, ``eos_id`` and ``name`` (a string that identifies its vocabulary, used in cache keys).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

__all__ = ["ByteTokenizer", "HFTokenizer", "build_tokenizer"]


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then ``pad`` = 256, ``bos`` = 257, ``eos`` = 258 (``vocab_size`` 259).

    Works offline on any text; every string round-trips exactly (``decode(encode(s)) == s``).
    """

    name = "byte"
    vocab_size = 259
    pad_id = 256
    bos_id = 257
    eos_id = 258

    def encode(self, text: str) -> np.ndarray:
        """int64 ``[len(text.encode("utf-8"))]``; no bos/eos added."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids) -> str:
        """Bytes back to text; special ids are dropped, invalid UTF-8 becomes U+FFFD (``errors="replace"``)."""
        ids = np.asarray(ids).reshape(-1)
        return ids[ids < 256].astype(np.uint8).tobytes().decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizer.json``, loaded with the ``tokenizers`` library (imported here, lazily).

    Special ids are looked up by token string: ``eos`` is required; ``bos`` and ``pad`` fall back to ``eos``
    (GPT-2 style vocabularies have one ``<|endoftext|>`` for all three; pad never reaches the loss).
    """

    EOS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "<|im_end|>")
    BOS = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
    PAD = ("<pad>", "<|pad|>", "[PAD]", "<|finetune_right_pad_id|>")

    def __init__(self, path: str | Path):
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise ImportError(
                f"tokenizer '{path}' is a tokenizer.json and needs the tokenizers library: pip install tokenizers "
                "(or use tokenizer: byte, which needs nothing)"
            ) from e
        path = Path(path)
        self._tok = Tokenizer.from_file(str(path))
        self.name = "hf-" + hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        eos = self._find(self.EOS)
        if eos is None:
            raise ValueError(f"tokenizer '{path}' has none of the end-of-sequence tokens {list(self.EOS)}")
        self.eos_id = eos
        self.bos_id = self._find(self.BOS, default=eos)
        self.pad_id = self._find(self.PAD, default=eos)

    def _find(self, candidates, default=None):
        for token in candidates:
            i = self._tok.token_to_id(token)
            if i is not None:
                return i
        return default

    def encode(self, text: str) -> np.ndarray:
        """int64 ``[L]``; no special tokens added (the datasets add bos/eos themselves)."""
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def decode(self, ids) -> str:
        return self._tok.decode(np.asarray(ids).reshape(-1).tolist(), skip_special_tokens=True)


def build_tokenizer(spec: str | None = "byte") -> ByteTokenizer | HFTokenizer:
    """``"byte"`` (or None) gives :class:`ByteTokenizer`; a path to a ``tokenizer.json`` gives :class:`HFTokenizer`.

    ``"auto"`` is the byte tokenizer here: the training loop resolves it to ``model.pretrained``'s tokenizer first
    when that is set (:func:`thdpack.hf.tokenizer.resolve_tokenizer`, which also takes model directories)."""
    if spec is None or spec in ("byte", "auto"):
        return ByteTokenizer()
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"tokenizer '{spec}' is neither 'byte' nor an existing tokenizer.json file")
    return HFTokenizer(path)
