"""``jsonl``: one JSON object per line, read lazily (an index of line offsets is built once, a line is parsed
when its sample is asked for, so a line that is or goes bad raises when it is reached, naming file and line).

Line kinds (exactly one of these keys per line; other keys are ignored):

* ``{"text": str}``: LM, ``bos + text + eos``, every token but the first a target.
* ``{"input_ids": [int, ...]}``: LM on the ids as given (no bos/eos added); at least 2 ids.
* ``{"prompt": str, "response": str}``: SFT, ``bos + prompt + response + eos``; targets are the response
  tokens and the eos.
* ``{"messages": [{"role": str, "content": str}, ...]}``: chat, ``bos`` then per turn
  ``encode("<|{role}|>\\n" ) + encode(content) + eos``; targets are the assistant turns' content and eos (the
  role tag is not). Roles are free strings; only ``"assistant"`` is trained on.

Pieces are encoded separately (prompt and response, tag and content), so a subword tokenizer never merges a
prompt token with a response token, and the target boundary stays exact.

Bad data raises ``ValueError("<file>:<line>: <what>: <rule>")``: malformed JSON, not an object, none or
several of the known keys, wrong types, an empty sample (no token, or no target token), ids that are not
integers or lie outside ``[0, vocab_size)``. Blank lines hold no sample and are skipped (they keep their
line numbers: every error names the line as an editor counts it).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .samples import Sample

__all__ = ["JsonlDataset"]

KINDS = ("text", "input_ids", "prompt", "messages")


class JsonlDataset:
    """A JSONL file as a sequence of :class:`Sample`.

    Args:
        path: the file.
        tokenizer: see :mod:`thdpack.data.tokenizer`.
    """

    def __init__(self, path: str | Path, tokenizer):
        self.path = Path(path)
        self.tokenizer = tokenizer
        data = np.fromfile(self.path, dtype=np.uint8)
        newline = np.flatnonzero(data == 10)
        starts = np.concatenate([[0], newline + 1])
        ends = np.concatenate([newline, [len(data)]])
        # Blank lines (empty, or a lone \r) hold no sample; checked by length so the index stays vectorized.
        first_byte = np.append(data, np.uint8(10))[starts]  # a sentinel: starts may equal len(data)
        blank = (ends - starts == 0) | ((ends - starts == 1) & (first_byte == 13))
        keep = ~blank
        self._start, self._end = starts[keep], ends[keep]
        self._line = np.flatnonzero(keep) + 1  # 1-based line numbers, as an editor shows them
        self._file = None

    def __len__(self) -> int:
        return len(self._start)

    def __getstate__(self):  # an open file does not pickle (DataLoader workers): reopen lazily
        return {**self.__dict__, "_file": None}

    def __getitem__(self, index: int) -> Sample:
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample {index} of {self.path} ({len(self)} samples)")
        index = index % len(self)
        where = f"{self.path}:{self._line[index]}"
        if self._file is None:
            self._file = open(self.path, "rb")  # noqa: SIM115 - kept open across reads, closed with the object
        self._file.seek(int(self._start[index]))
        raw = self._file.read(int(self._end[index] - self._start[index]))
        try:
            record = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{where}: malformed JSON ({e}): each line must be one JSON object") from None
        tokens, targets = parse_record(record, self.tokenizer, where)
        return Sample(tokens, targets, where)

    def __del__(self):
        if getattr(self, "_file", None) is not None:
            self._file.close()


def parse_record(record, tokenizer, where: str) -> tuple[np.ndarray, np.ndarray | None]:
    """``(tokens int64 [L], target_mask bool [L] or None)`` of one decoded JSON line; ``where`` = ``file:line``."""
    if not isinstance(record, dict):
        raise ValueError(
            f"{where}: a JSON {type(record).__name__}, not an object: each line must be an object"
        )
    kinds = [k for k in KINDS if k in record]
    if len(kinds) != 1:
        found = "none" if not kinds else " and ".join(repr(k) for k in kinds)
        raise ValueError(
            f"{where}: {found} of the keys {list(KINDS)}: each line needs exactly one "
            "('prompt' goes with 'response')"
        )
    kind = kinds[0]
    bos = np.array([tokenizer.bos_id], np.int64)
    eos = np.array([tokenizer.eos_id], np.int64)
    if kind == "text":
        text = _string(record, "text", where)
        if not text:
            raise ValueError(f"{where}: 'text' is empty: an LM sample needs at least one token")
        return np.concatenate([bos, tokenizer.encode(text), eos]), None
    if kind == "input_ids":
        return _ids(record["input_ids"], tokenizer.vocab_size, where), None
    if kind == "prompt":
        prompt, response = _string(record, "prompt", where), _string(record, "response", where)
        if not response:
            raise ValueError(f"{where}: 'response' is empty: an SFT sample needs at least one target token")
        pieces = [
            (bos, False),
            (tokenizer.encode(prompt), False),
            (tokenizer.encode(response), True),
            (eos, True),
        ]
        return _join(pieces)
    return _messages(record["messages"], tokenizer, bos, eos, where)


def _messages(messages, tokenizer, bos, eos, where):
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{'role': str, 'content': str}}")
    pieces = [(bos, False)]
    for turn, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"{where}: messages[{turn}] must be an object with a string 'role'")
        content = _string(message, "content", where, f"messages[{turn}].content")
        trained = message["role"] == "assistant"
        pieces += [
            (tokenizer.encode(f"<|{message['role']}|>\n"), False),
            (tokenizer.encode(content), trained),
            (eos, trained),
        ]
    tokens, targets = _join(pieces)
    if not targets[1:].any():
        raise ValueError(
            f"{where}: no assistant message: a chat sample needs at least one target token (loss is on "
            "the assistant turns only)"
        )
    return tokens, targets


def _join(pieces):
    tokens = np.concatenate([p for p, _ in pieces])
    targets = np.concatenate([np.full(len(p), t, dtype=bool) for p, t in pieces])
    return tokens, targets


def _string(record: dict, key: str, where: str, name: str | None = None) -> str:
    value = record.get(key)
    if not isinstance(value, str):
        got = "missing" if key not in record else f"a {type(value).__name__}"
        raise ValueError(f"{where}: '{name or key}' is {got}: it must be a string")
    return value


def _ids(value, vocab_size: int, where: str) -> np.ndarray:
    rule = f"'input_ids' must be a list of at least 2 integers in [0, {vocab_size})"
    if not isinstance(value, list):
        raise ValueError(f"{where}: 'input_ids' is a {type(value).__name__}: {rule}")
    if len(value) < 2:
        raise ValueError(f"{where}: 'input_ids' has {len(value)} id(s), no target token: {rule}")
    try:
        ids = np.asarray(value)
    except (ValueError, OverflowError):  # nested lists, huge ints
        ids = np.asarray(value, dtype=object)
    if ids.ndim != 1 or ids.dtype.kind not in "iu":  # floats, strings, null, booleans (JSON true/false)
        raise ValueError(f"{where}: 'input_ids' holds non-integer values: {rule}")
    bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    if bad.size:
        raise ValueError(f"{where}: input_ids[{bad[0]}] = {ids[bad[0]]} is out of range: {rule}")
    return ids.astype(np.int64)
