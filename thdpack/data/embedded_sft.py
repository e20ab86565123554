"""``embedded_sft``: chat pairs cut from the Python standard library's sources, for fine-tuning with no download.

Every function of the :mod:`thdpack.data.embedded` corpus files (the same file selection, read the same way) that
has a docstring and a body after it gives one pair, in file order then source order (top-level functions, and the
methods of top-level classes):

* user: ``Write the body of `{name}` from the Python standard library's {file}:`` then, after a blank line, the
  function's decorators, signature and docstring as they stand in the source (dedented to column 0);
* assistant: the statements after the docstring, dedented to column 0 (leading and trailing blank lines removed).

Functions whose body is only ``pass``, ``...`` or ``raise NotImplementedError(...)`` are left out (nothing to
learn). Tokens: exactly as a JSONL ``{"messages": [user, assistant]}`` row
(:func:`thdpack.data.jsonl.tokenize_record`): through the model's chat template with a Hugging Face model
directory's tokenizer, thdpack's ``<|role|>`` tags with the byte tokenizer; the loss is on the assistant turn.
``source`` is ``stdlib:<file>:<def line>``.

Built once (the pairs, tokenized) and cached under ``$THDPACK_CACHE`` like ``embedded``, keyed by the builder
version, the Python version, the tokenizer and every file's content.

Lengths on CPython 3.11.7 (``python benchmarks/embedded_sft_stats.py``; ``--tokenizer DIR`` for a model directory;
build times on a shared 2-core machine under load), byte tokenizer::

    samples 5692, tokens 4259652, mean length 748.4
      [    128,     256)      780  ##############
      [    256,     512)     2267  ########################################
      [    512,    1024)     1556  ###########################
      [   1024,    2048)      765  #############
      [   2048,    4096)      260  #####
      [   4096,    8192)       59  #
      [   8192,   16384)        5  #
      quantiles: p0=137, p10=242, p25=310, p50=476, p75=855, p90=1524, p99=4143, p100=12167
    targets: 2164891 tokens (51%); 452 files, built in 24 s

a 1,024-token byte-level BPE with the Qwen2.5 chat template (tests/hf_tokenizers.py, ``qwen2_5``)::

    samples 5692, tokens 2163272, mean length 380.1
      [     64,     128)       51  #
      [    128,     256)     2663  ########################################
      [    256,     512)     1938  #############################
      [    512,    1024)      762  ###########
      [   1024,    2048)      239  ####
      [   2048,    4096)       36  #
      [   4096,    8192)        3  #
      quantiles: p0=110, p10=160, p25=190, p50=265, p75=427, p90=721, p99=1813, p100=5018
    targets: 958567 tokens (44%); built in 70 s (the chat template renders twice a pair)
"""

from __future__ import annotations

import ast
import textwrap
import time

import numpy as np

from .cache import read_entry, write_entry
from .embedded import cache_entry, read_stdlib
from .jsonl_records import tokenize_record
from .samples import Sample, length_stats
from .tokenizer import ByteTokenizer

__all__ = ["EmbeddedSFTDataset", "function_pairs"]

# Bump when the pair rules change: it is part of the cache key.
BUILD_VERSION = "1"


def function_pairs(source: bytes, file: str) -> list[tuple[int, str, str]]:
    """``(def line, user text, assistant text)`` of each usable function of one module's source (``\\n`` line
    ends, as :func:`thdpack.data.embedded.read_stdlib` gives). Raises ``SyntaxError`` / ``ValueError`` when
    ``ast`` cannot parse it."""
    text = source.decode("utf-8", errors="replace")
    tree = ast.parse(text)
    lines = text.split("\n")
    functions = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            functions.append((node.name, node))
        elif isinstance(node, ast.ClassDef):
            functions += [
                (f"{node.name}.{item.name}", item)
                for item in node.body
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
            ]
    pairs = []
    for name, node in functions:
        doc = node.body[0]
        if not (
            isinstance(doc, ast.Expr)
            and isinstance(doc.value, ast.Constant)
            and isinstance(doc.value.value, str)
        ):
            continue
        if len(node.body) < 2 or _trivial(node.body[1:]):
            continue
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        header = textwrap.dedent("\n".join(lines[first - 1 : doc.end_lineno]))
        body = textwrap.dedent("\n".join(lines[doc.end_lineno : node.end_lineno])).strip("\n")
        if not body.strip():
            continue
        user = f"Write the body of `{name}` from the Python standard library's {file}:\n\n{header}"
        pairs.append((first, user, body))
    return pairs


def _trivial(statements: list[ast.stmt]) -> bool:
    if len(statements) != 1:
        return False
    s = statements[0]
    if isinstance(s, ast.Pass):
        return True
    if isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant) and s.value.value is Ellipsis:
        return True
    if isinstance(s, ast.Raise) and s.exc is not None:
        exc = s.exc.func if isinstance(s.exc, ast.Call) else s.exc
        return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"
    return False


class EmbeddedSFTDataset:
    """The stdlib's functions as SFT chat pairs (see the module docstring); a sequence of :class:`Sample`.

    Args:
        tokenizer: default :class:`~thdpack.data.tokenizer.ByteTokenizer`.
        max_files: only the first ``max_files`` corpus files (fast tests); None = all.
        cache_dir: default :func:`~thdpack.data.cache.cache_root`.
        rebuild: build even when a cache entry exists.

    Attributes:
        lengths: int64 ``[N]`` tokens per pair.
        files, skipped_files, build_seconds, load_seconds: as :class:`~thdpack.data.embedded.EmbeddedDataset`.
    """

    def __init__(
        self, tokenizer=None, *, max_files: int | None = None, cache_dir=None, rebuild: bool = False
    ):
        start = time.perf_counter()
        self.tokenizer = tokenizer or ByteTokenizer()
        self.files, sources = read_stdlib(max_files)
        self.cache_path = cache_entry(
            cache_dir, "embedded-sft", BUILD_VERSION, self.tokenizer, self.files, sources
        )
        self.build_seconds = 0.0
        if rebuild or not (self.cache_path / "done").exists():
            self.build_seconds = self._build(sources)
        self._load()
        self.load_seconds = time.perf_counter() - start

    def _build(self, sources: list[bytes]) -> float:
        start = time.perf_counter()
        tokens, masks, lengths, pair_file, pair_line, skipped = [], [], [], [], [], []
        for index, (name, data) in enumerate(zip(self.files, sources, strict=True)):
            try:
                pairs = function_pairs(data, name)
            except (SyntaxError, ValueError):
                skipped.append(name)
                continue
            for line, user, assistant in pairs:
                messages = [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
                ids, mask = tokenize_record(
                    {"messages": messages}, "messages", self.tokenizer, f"stdlib:{name}:{line}"
                )
                tokens.append(ids)
                masks.append(mask)
                lengths.append(len(ids))
                pair_file.append(index)
                pair_line.append(line)
        dtype = np.uint16 if self.tokenizer.vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32
        arrays = {
            "tokens": np.concatenate(tokens).astype(dtype) if tokens else np.zeros(0, dtype),
            "targets": np.concatenate(masks) if masks else np.zeros(0, bool),
            "offsets": np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64),
            "pair_file": np.asarray(pair_file, np.int32),
            "pair_line": np.asarray(pair_line, np.int32),
        }
        write_entry(self.cache_path, arrays, {"files": self.files, "skipped_files": skipped})
        return time.perf_counter() - start

    def _load(self) -> None:
        arrays, meta = read_entry(self.cache_path, mapped=("tokens", "targets"))
        self._tokens, self._targets, self._offsets = arrays["tokens"], arrays["targets"], arrays["offsets"]
        self._pair_file, self._pair_line = arrays["pair_file"], arrays["pair_line"]
        self.skipped_files = meta["skipped_files"]
        self.lengths = np.diff(self._offsets)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> Sample:
        if not -len(self) <= index < len(self):
            raise IndexError(f"pair {index} of the embedded SFT corpus ({len(self)} pairs)")
        index = index % len(self)
        begin, end = self._offsets[index], self._offsets[index + 1]
        return Sample(
            tokens=np.asarray(self._tokens[begin:end], dtype=np.int64),
            target_mask=np.asarray(self._targets[begin:end], dtype=bool),
            source=f"stdlib:{self.files[self._pair_file[index]]}:{self._pair_line[index]}",
        )

    def length_stats(self) -> dict:
        """:func:`~thdpack.data.samples.length_stats` of the pair lengths."""
        return length_stats(self.lengths)
