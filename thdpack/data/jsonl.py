"""``jsonl``: one JSON object per line, checked in one pass when the dataset is built (every bad line reported
with file:line before training starts; see :mod:`thdpack.data.jsonl_index`), then read lazily (a line is parsed
and tokenized when its sample is asked for).

Line kinds (exactly one of these keys per line; other keys are ignored):

* ``{"text": str}``: LM, every token but the first a target. Tokens: ``bos + text + eos`` with a tokenizer that
  has no special-token rule of its own (byte, ``tokenizer.json``); with a Hugging Face model directory's tokenizer,
  whatever its ``add_special_tokens`` adds (Llama 3: BOS; Qwen: nothing).
* ``{"input_ids": [int, ...]}``: LM on the ids as given (no bos/eos added); at least 2 ids, each in
  ``[0, vocab_size)``.
* ``{"prompt": str, "response": str}``: SFT, the loss on the response. With a chat template: the same as
  ``messages`` ``[user: prompt, assistant: response]``. Without: ``bos + prompt + response + eos``, targets the
  response tokens and the eos.
* ``{"messages": [{"role": str, "content": str}, ...]}``: chat, the loss on the assistant turns only. With a chat
  template (a Hugging Face model directory's tokenizer): the model's own template, spans as
  :meth:`thdpack.hf.tokenizer.PretrainedTokenizer.render_chat` documents. Without: ``bos`` then per turn
  ``encode("<|{role}|>\\n") + encode(content) + eos``, targets the assistant turns' content and eos (the role tag
  is not). Roles are free strings; only ``"assistant"`` is trained on.

Pieces are encoded separately (prompt and response, tag and content, prompt and assistant span), so a subword
tokenizer never merges a prompt token with a target token, and the target boundary stays exact.

Bad data raises ``ValueError("<file>:<line>: <what>: <rule>")``: malformed JSON, not an object, none or
several of the known keys, wrong types, an empty sample (no token, or no target token), ids that are not
integers or lie outside ``[0, vocab_size)``. Blank lines hold no sample and are skipped (they keep their
line numbers: every error names the line as an editor counts it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .jsonl_records import check_record, parse_record, tokenize_record
from .samples import Sample

__all__ = ["JsonlDataset", "check_record", "parse_record", "tokenize_record"]


class JsonlDataset:
    """A JSONL file as a sequence of :class:`Sample`.

    Args:
        path: the file.
        tokenizer: see :mod:`thdpack.data.tokenizer` and :mod:`thdpack.hf.tokenizer`.
        validate: ``"parse"`` (every line parsed and checked), ``"tokenize"`` (also tokenized: sample lengths
            known up front) or ``"auto"``; see :func:`~thdpack.data.jsonl_index.index_jsonl`.
        max_errors: bad lines quoted in the error (all are counted).
        bad_lines: ``"error"`` (a bad line stops the start) or ``"skip"`` (left out, counted in :attr:`summary`).
        cache_dir: where the index is cached (default :func:`~thdpack.data.cache.cache_root`); False: no cache.

    A file of other rows subclasses it with its own :meth:`line_rules` (the start-up pass's check and length) and
    :meth:`sample` (a decoded line to a :class:`Sample`); :meth:`record` reads a line.

    Attributes:
        lengths: int64 ``[N]`` tokens per sample when the pass tokenized, else None.
        index: the :class:`~thdpack.data.jsonl_index.JsonlIndex` (``tokenized``, ``seconds``, ``cached``).
    """

    def __init__(
        self,
        path: str | Path,
        tokenizer,
        *,
        validate: str = "auto",
        max_errors: int = 20,
        cache_dir=None,
        bad_lines: str = "error",
    ):
        from .jsonl_index import index_jsonl

        self.path = Path(path)
        self.tokenizer = tokenizer
        self.index = index_jsonl(
            self.path,
            tokenizer,
            validate=validate,
            max_errors=max_errors,
            cache_dir=cache_dir,
            rules=self.line_rules(),
            bad_lines=bad_lines,
        )
        self._start, self._end, self._line = self.index.starts, self.index.ends, self.index.lines
        self.lengths = self.index.lengths
        self._file = None

    def __len__(self) -> int:
        return len(self._start)

    @property
    def summary(self) -> str:
        """What the start-up pass did, for the log."""
        index = self.index
        what = "parsed, checked and tokenized" if index.tokenized else "parsed and checked (not tokenized)"
        if index.cached:
            return (
                f"{self.path}: {len(self)} samples, every line {what} at an earlier start (index loaded from "
                f"{index.cache_path} in {index.seconds:.2f} s)"
            )
        line = f"{self.path}: {len(self)} samples, every line {what} in {index.seconds:.2f} s"
        if index.skipped:
            line += (
                f"; {len(index.skipped)} bad line(s) left out (dataset.bad_lines=skip), the first: "
                + "; ".join(index.skipped[:3])
            )
        return line

    def __getstate__(self):  # an open file does not pickle (DataLoader workers): reopen lazily
        return {**self.__dict__, "_file": None}

    def line_rules(self):
        """What a line is, for the start-up pass: :func:`~thdpack.data.jsonl_index.text_rules`."""
        from .jsonl_index import text_rules

        return text_rules(self.tokenizer)

    def __getitem__(self, index: int) -> Sample:
        return self.sample(*self.record(index))

    def sample(self, record, where: str) -> Sample:
        """The :class:`Sample` of a decoded line (``where``: its ``file:line``)."""
        tokens, targets = parse_record(record, self.tokenizer, where)
        return Sample(tokens, targets, where)

    def record(self, index: int) -> tuple[Any, str]:
        """``(the decoded JSON of sample index's line, "file:line")``."""
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
        return record, where

    def __del__(self):
        if getattr(self, "_file", None) is not None:
            self._file.close()
