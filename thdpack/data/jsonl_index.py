"""The one pass over a JSONL file that runs when the dataset is built: every line parsed and checked (and, when
asked, tokenized) before training starts, every bad line reported with file:line, the result cached.

What the pass does, per non-blank line: ``json.loads``, then the rows' check (:class:`LineRules`; for
:mod:`thdpack.data.jsonl`'s rows, :func:`~thdpack.data.jsonl_records.check_record`: the keys, their types, the ids' range);
with ``tokenize`` also their tokenization (:func:`~thdpack.data.jsonl_records.tokenize_record`, the chat template too),
which gives every sample's length and catches what only tokenizing can (a template that cannot render a row, a
text of one token). Image chat rows (:mod:`thdpack.data.vlm`) bring their own rules. Bad lines are collected, not raised one by one: the error quotes the first
``max_errors`` (each ``file:line: what: rule``) and counts them all.

``validate``:

* ``"parse"``: no tokenizing. The cheap pass, for files of millions of lines.
* ``"tokenize"``: lengths known up front (the overlong count at start-up; budgets).
* ``"auto"`` (default): ``tokenize`` for files of at most :data:`AUTO_TOKENIZE_LINES` lines (at most
  :data:`AUTO_TOKENIZE_CHAT_LINES` when rows go through a chat template; the rules'
  ``auto_tokenize_lines``), else ``parse``.

Measured (``python benchmarks/jsonl_validation.py`` and a bare ``json.loads`` loop over the same lines; generated
chat-like rows, 1.1 KB on average) on this repository's shared 2-core CPU machine while other jobs kept its load
average at 12-30 (absolute rates depend on that load: rerun the script on the machine that trains). Over 1,000,000 lines
(1.1 GB) the parse pass took 100-116 s (8.6-10 K lines/s), 1.4-1.65x a bare ``json.loads`` of every line (70.5-71 s
in alternation with it); a first run under heavier load took 198 s. Tokenizing as well took 524 s with the byte
tokenizer (1.9 K lines/s, 2.6x that run's parse pass), and 275 s for 20,000 lines through the Qwen2.5 chat
template (73 lines/s: the template is rendered in Jinja once per assistant turn plus once, 0.4-1.1 ms a render
under a lighter load). A cached start took 0.1-0.2 s. Hence ``auto``: parsing is what a start can afford for any
file; tokenizing only where the file is small enough, and it is cached once done.

The cache: ``<cache_dir>/jsonl/<file name>-<hash of its absolute path>.npz`` holding the line offsets, the line
numbers, the lengths (when tokenized) and a key of the file's size, modification time and a hash of its first and
last MiB, the tokenizer's ``name``, the rules' ``name`` and :data:`INDEX_VERSION`. A start whose key matches loads it instead of reading
the file; a file that has bad lines is not cached (fixing it changes its modification time anyway).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .cache import cache_root
from .jsonl_records import check_record, tokenize_record

__all__ = [
    "AUTO_TOKENIZE_CHAT_LINES",
    "AUTO_TOKENIZE_LINES",
    "INDEX_VERSION",
    "VALIDATE",
    "JsonlIndex",
    "LineRules",
    "index_jsonl",
    "text_rules",
]

VALIDATE = ("auto", "parse", "tokenize")
BAD_LINES = ("error", "skip")
AUTO_TOKENIZE_LINES = 100_000
AUTO_TOKENIZE_CHAT_LINES = 10_000
# Bump when the checks or the stored arrays change: it is part of the cache key.
INDEX_VERSION = "2"


@dataclass
class JsonlIndex:
    """What the pass learned about a file.

    Attributes:
        starts, ends: int64 ``[N]`` byte offsets of each sample's line (blank lines hold no sample).
        lines: int64 ``[N]`` 1-based line numbers, as an editor counts them.
        lengths: int64 ``[N]`` tokens per sample, or None when the pass did not tokenize.
        seconds: the pass's (or the cached load's) wall time; cached: loaded from the cache.
        cache_path: the cache file (None without a cache).
    """

    starts: np.ndarray
    ends: np.ndarray
    lines: np.ndarray
    lengths: np.ndarray | None
    seconds: float
    cached: bool
    cache_path: Path | None
    skipped: list[str] = dataclasses.field(
        default_factory=list
    )  # bad_lines="skip": each left-out line's error
    keep: np.ndarray | None = None  # LineRules.keep: int64 [N], the shortest prefix a truncation may keep

    @property
    def tokenized(self) -> bool:
        return self.lengths is not None


@dataclass(frozen=True)
class LineRules:
    """What one kind of row is, for the start-up pass.

    Attributes:
        name: the rows' name, part of the cache key (an index built under other rules is not reused).
        check: ``(record, where) -> kind``: a decoded line's kind, after checking it without tokenizing; raises
            ``ValueError`` naming ``where`` (``file:line``) and the rule.
        length: ``(record, kind, where) -> int``: the sample's token count (the tokenizing pass); raises as
            ``check`` does. With ``keep`` set, ``(length, shortest prefix a truncation may keep)``.
        auto_tokenize_lines: ``validate="auto"`` tokenizes files of at most this many lines.
        keep: for rows a truncation must not cut anywhere (images): ``(record, where) -> int``, at least the
            shortest prefix a truncation may keep, without tokenizing (the parse pass); None: any cut is fine.
        files: ``(record, where) -> [Path]``: other files a line reads (images); a cached index is used only while
            each is as the pass saw it (size and modification time).
    """

    name: str
    check: Callable[[Any, str], str]
    length: Callable[[Any, str, str], Any]
    auto_tokenize_lines: int
    keep: Callable[[Any, str], int] | None = None
    files: Callable[[Any, str], list] | None = None


def text_rules(tokenizer) -> LineRules:
    """The rules of :mod:`thdpack.data.jsonl`'s rows (``text``, ``input_ids``, ``prompt``, ``messages``)."""
    vocab_size = tokenizer.vocab_size
    chat = getattr(tokenizer, "has_chat_template", False)
    roles = getattr(tokenizer, "chat_roles", None)
    return LineRules(
        name="text",
        check=lambda record, where: check_record(record, vocab_size, where, roles),
        length=lambda record, kind, where: len(tokenize_record(record, kind, tokenizer, where)[0]),
        auto_tokenize_lines=AUTO_TOKENIZE_CHAT_LINES if chat else AUTO_TOKENIZE_LINES,
    )


def line_offsets(data: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(starts, ends, line numbers)`` of the non-blank lines of a file's bytes (uint8 ``[B]``)."""
    newline = np.flatnonzero(data == 10)
    starts = np.concatenate([[0], newline + 1]).astype(np.int64)
    ends = np.concatenate([newline, [len(data)]]).astype(np.int64)
    # Blank lines (empty, or a lone \r) hold no sample; checked by length so the index stays vectorized.
    first_byte = np.append(data, np.uint8(10))[starts]  # a sentinel: starts may equal len(data)
    blank = (ends - starts == 0) | ((ends - starts == 1) & (first_byte == 13))
    keep = ~blank
    return starts[keep], ends[keep], np.flatnonzero(keep).astype(np.int64) + 1


def index_jsonl(
    path: str | Path,
    tokenizer,
    *,
    validate: str = "auto",
    max_errors: int = 20,
    cache_dir=None,
    rules: LineRules | None = None,
    bad_lines: str = "error",
) -> JsonlIndex:
    """Check every line of ``path`` (see the module docstring); raise one ``ValueError`` that names every bad
    line's file:line (the first ``max_errors``) and their count, or with ``bad_lines="skip"`` leave them out of the
    index (``JsonlIndex.skipped`` holds their errors). ``cache_dir``: default
    :func:`~thdpack.data.cache.cache_root`; False: neither read nor write a cache. ``rules``: what a line is
    (default :func:`text_rules` of ``tokenizer``)."""
    rules = rules or text_rules(tokenizer)
    start = time.perf_counter()
    path = Path(path)
    if validate not in VALIDATE:
        raise ValueError(f"dataset.validate is '{validate}': it must be one of {list(VALIDATE)}")
    if bad_lines not in BAD_LINES:
        raise ValueError(f"dataset.bad_lines is '{bad_lines}': it must be one of {list(BAD_LINES)}")
    if not path.is_file():
        raise ValueError(f"dataset.path '{path}' is not a file")
    stat = path.stat()
    key = {
        "version": INDEX_VERSION,
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "ends_sha256": _ends_digest(path, stat.st_size),
        "tokenizer": tokenizer.name,
        "rules": rules.name,
    }
    cache_path = None
    if cache_dir is not False:
        digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
        cache_path = Path(cache_dir or cache_root()) / "jsonl" / f"{path.name}-{digest}.npz"
        cached = _load(cache_path, key)
        if cached is not None:
            starts, ends, lines, lengths, keep = cached
            if (
                lengths is not None
                or validate == "parse"
                or (validate == "auto" and len(starts) > rules.auto_tokenize_lines)
            ):
                elapsed = time.perf_counter() - start
                return JsonlIndex(starts, ends, lines, lengths, elapsed, True, cache_path, keep=keep)

    data = path.read_bytes()
    starts, ends, lines = line_offsets(np.frombuffer(data, dtype=np.uint8))
    tokenize = validate == "tokenize" or (validate == "auto" and len(starts) <= rules.auto_tokenize_lines)
    lengths, keep, files, bad = _check_lines(
        path, data, starts, ends, lines, rules, tokenize, max_errors, bad_lines
    )
    if bad:  # bad_lines="skip": the index holds the good lines; not cached (the file is to be fixed)
        good = np.ones(len(starts), bool)
        good[[i for i, _ in bad]] = False
        starts, ends, lines = starts[good], ends[good], lines[good]
        lengths = None if lengths is None else lengths[good]
        keep = None if keep is None else keep[good]
        if not len(starts):
            raise ValueError(
                f"{path}: every one of its {len(bad)} line(s) is bad: nothing to train on\n  {bad[0][1]}"
            )
    elif cache_path is not None:
        _save(cache_path, key, starts, ends, lines, lengths, keep, files)
    elapsed = time.perf_counter() - start
    skipped = [error for _, error in bad]
    return JsonlIndex(starts, ends, lines, lengths, elapsed, False, cache_path, skipped, keep)


def _check_lines(
    path, data, starts, ends, lines, rules: LineRules, tokenize: bool, max_errors: int, bad_lines: str
):
    """The lengths (when tokenizing) and, with ``bad_lines="skip"``, the ``(index, error)`` of each bad line;
    with ``"error"`` a bad line raises (every one counted, the first ``max_errors`` quoted)."""
    lengths = np.zeros(len(starts), np.int64) if tokenize else None
    keep = np.zeros(len(starts), np.int64) if rules.keep is not None else None
    files: dict[str, None] = {}
    check, length, loads = rules.check, rules.length, json.loads
    errors: list[str] = []
    skipped: list[tuple[int, str]] = []
    bad = 0
    for i, (s, e, line) in enumerate(zip(starts.tolist(), ends.tolist(), lines.tolist(), strict=True)):
        where = f"{path}:{line}"
        try:
            try:
                record = loads(data[s:e])
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise ValueError(
                    f"{where}: malformed JSON ({err}): each line must be one JSON object"
                ) from None
            kind = check(record, where)
            if tokenize:
                measured = length(record, kind, where)
                if keep is not None:
                    lengths[i], keep[i] = measured
                else:
                    lengths[i] = measured
            elif keep is not None:
                keep[i] = rules.keep(record, where)
            if rules.files is not None:
                files.update(dict.fromkeys(str(f) for f in rules.files(record, where)))
        except ValueError as err:
            if bad_lines == "skip":
                skipped.append((i, str(err)))
                continue
            bad += 1
            if len(errors) < max_errors:
                errors.append(str(err))
    if bad:
        shown = f"the first {len(errors)}" if len(errors) < bad else "all"
        raise ValueError(
            f"{path}: {bad} bad line(s) of {len(starts)} (every line is checked before training; {shown} "
            "below; dataset.bad_lines=skip leaves them out):\n  " + "\n  ".join(errors)
        )
    return lengths, keep, list(files), skipped


def _ends_digest(path: Path, size: int, span: int = 1 << 20) -> str:
    """A hash of the file's first and last MiB: a rewrite of the same size within the file system's mtime
    granularity (milliseconds on some) still changes the key, at the cost of reading 2 MiB."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f.read(span))
        if size > span:
            f.seek(max(span, size - span))
            digest.update(f.read(span))
    return digest.hexdigest()[:16]


def _load(cache_path: Path, key: dict):
    try:
        with np.load(cache_path) as stored:
            if json.loads(str(stored["key"])) != key:
                return None
            if _signature(stored["files"].tolist()).tolist() != stored["file_signature"].tolist():
                return None  # a file a line reads (an image) changed since: check the lines again
            lengths = stored["lengths"] if bool(stored["tokenized"]) else None
            keep = stored["keep"] if bool(stored["has_keep"]) else None
            return stored["starts"], stored["ends"], stored["lines"], lengths, keep
    except (OSError, KeyError, ValueError):  # absent, cut short, or from another layout: build again
        return None


def _signature(files: list[str]) -> np.ndarray:
    """int64 ``[F, 2]``: each file's size and modification time (-1 for one that is gone)."""
    out = np.full((len(files), 2), -1, np.int64)
    for i, name in enumerate(files):
        try:
            stat = os.stat(name)
            out[i] = (stat.st_size, stat.st_mtime_ns)
        except OSError:
            pass
    return out


def _save(cache_path: Path, key: dict, starts, ends, lines, lengths, keep=None, files=()) -> None:
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    # Written to a private file and renamed into place: a reader never sees half an index, and ranks that build
    # at once all end with a complete one.
    fd, tmp = tempfile.mkstemp(dir=cache_path.parent, prefix=".index-", suffix=".npz")
    with os.fdopen(fd, "wb") as f:
        np.savez(
            f,
            key=np.array(json.dumps(key)),
            starts=starts,
            ends=ends,
            lines=lines,
            lengths=lengths if lengths is not None else np.zeros(0, np.int64),
            tokenized=np.array(lengths is not None),
            keep=keep if keep is not None else np.zeros(0, np.int64),
            has_keep=np.array(keep is not None),
            files=np.array(list(files), dtype=str),
            file_signature=_signature(list(files)),
        )
    os.replace(tmp, cache_path)
