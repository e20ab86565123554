"""``embedded``: a corpus that needs no download, cut from the Python standard library's own sources.

Every Python install ships the same real, varied text: prose docstrings and code. Documents:

* files: every ``*.py`` under ``sysconfig.get_paths()["stdlib"]``, in sorted relative-path order, except
  test suites (any ``test``/``tests`` folder), ``idlelib``, ``lib2to3``, ``turtledemo``, ``site-packages``,
  ``config-*`` (build files), and generated files: ``encodings`` (codec tables), ``pydoc_data`` (one 750 KB
  help string), ``_sysconfigdata_*``;
* per file, cut with :mod:`ast`: the module docstring, then each top-level function and class (decorators
  included) in source order; one document is the exact source lines of that statement. Other top-level
  statements (imports, constants, ``if __name__ == "__main__"``) are left out: they are boilerplate.
* tokens: ``bos + tokenizer.encode(document) + eos``; ``source`` is ``stdlib:<file>:<first line>``.

Whole classes stay one document, so lengths have the heavy tail of real data (on Python 3.11.7 with the byte
tokenizer: median ~500 tokens, p99 ~19 K, max ~119 K).

The token array and offsets are built once (about 1.5 s) and cached under ``$THDPACK_CACHE`` (default
``~/.cache/thdpack``) in a folder keyed by the Python version and a hash of the builder version, the tokenizer
and every file's path and content; a cached load (hashing the sources included) takes tens of milliseconds.

``python -m thdpack.data.embedded`` prints the timings and the length histogram.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import os
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

from .cache import cache_root, read_entry, write_entry
from .samples import Sample, format_length_stats, length_stats
from .tokenizer import ByteTokenizer, build_tokenizer

__all__ = ["EmbeddedDataset", "cache_entry", "cache_root", "cut_documents", "read_stdlib", "stdlib_files"]

# Bump when the file selection or the cutting rules change: it is part of the cache key.
BUILD_VERSION = "1"
EXCLUDED_DIRS = frozenset(
    {"test", "tests", "idlelib", "lib2to3", "turtledemo", "site-packages", "__pycache__", "__phello__"}
    | {"encodings", "pydoc_data"}  # generated: codec tables, one huge help string
)


def stdlib_files(root: str | Path | None = None) -> list[str]:
    """Relative POSIX paths of the corpus files under ``root`` (default: this Python's stdlib), sorted."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in EXCLUDED_DIRS and not d.startswith("config-")]
        for name in names:
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                files.append(Path(folder, name).relative_to(root).as_posix())
    return sorted(files)


def cut_documents(source: bytes) -> list[tuple[int, int, int]]:
    """``(start byte, end byte, first line)`` of each document of one module's source (see module docstring).

    ``source`` must use ``\\n`` line ends (the builder normalizes them): documents are whole lines, found by
    byte offset of each line start. Raises ``SyntaxError`` / ``ValueError`` when ``ast`` cannot parse it.
    """
    tree = ast.parse(source)
    newline = np.flatnonzero(np.frombuffer(source, dtype=np.uint8) == 10)
    line_start = np.concatenate([[0], newline + 1, [len(source)]])  # line n starts at line_start[n - 1]
    docs = []
    for i, node in enumerate(tree.body):
        if i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            if not isinstance(node.value.value, str):
                continue
            first = node.lineno
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        else:
            continue
        last = min(node.end_lineno, len(line_start) - 1)
        docs.append((int(line_start[first - 1]), int(line_start[last]), first))
    return docs


class EmbeddedDataset:
    """The stdlib corpus as a sequence of :class:`Sample` (plain LM: ``target_mask`` None).

    Args:
        tokenizer: default :class:`ByteTokenizer`.
        max_files: use only the first ``max_files`` files of the sorted list (fast tests); None = all.
        cache_dir: default :func:`cache_root`.
        rebuild: build even when a cache entry exists.

    Attributes:
        lengths: int64 ``[N]`` tokens per document (bos and eos included).
        files: the relative paths of the files read.
        skipped_files: paths ``ast`` could not parse (none on CPython 3.11).
        build_seconds: seconds spent building (0.0 when loaded from the cache); load_seconds: total.
    """

    def __init__(
        self, tokenizer=None, *, max_files: int | None = None, cache_dir=None, rebuild: bool = False
    ):
        start = time.perf_counter()
        self.tokenizer = tokenizer or ByteTokenizer()
        self.files, sources = read_stdlib(max_files)
        self.cache_path = cache_entry(
            cache_dir, "embedded", BUILD_VERSION, self.tokenizer, self.files, sources
        )
        self.build_seconds = 0.0
        if rebuild or not (self.cache_path / "done").exists():
            self.build_seconds = self._build(sources)
        self._load()
        self.load_seconds = time.perf_counter() - start

    def _build(self, sources: list[bytes]) -> float:
        start = time.perf_counter()
        tok = self.tokenizer
        dtype = np.uint16 if tok.vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32
        bos, eos = np.array([tok.bos_id], dtype), np.array([tok.eos_id], dtype)
        byte_level = isinstance(tok, ByteTokenizer)
        pieces, lengths, doc_file, doc_line, skipped = [], [], [], [], []
        for index, (name, data) in enumerate(zip(self.files, sources, strict=True)):
            try:
                docs = cut_documents(data)
            except (SyntaxError, ValueError):
                skipped.append(name)
                continue
            for begin, end, line in docs:
                if byte_level:  # the bytes are the ids: no decode/encode round trip
                    body = np.frombuffer(data, dtype=np.uint8, count=end - begin, offset=begin).astype(dtype)
                else:
                    body = tok.encode(data[begin:end].decode("utf-8", errors="replace")).astype(dtype)
                pieces += [bos, body, eos]
                lengths.append(len(body) + 2)
                doc_file.append(index)
                doc_line.append(line)
        arrays = {
            "tokens": np.concatenate(pieces) if pieces else np.zeros(0, dtype),
            "offsets": np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64),
            "doc_file": np.asarray(doc_file, np.int32),
            "doc_line": np.asarray(doc_line, np.int32),
        }
        write_entry(self.cache_path, arrays, {"files": self.files, "skipped_files": skipped})
        return time.perf_counter() - start

    def _load(self) -> None:
        arrays, meta = read_entry(self.cache_path, mapped=("tokens",))
        self._tokens, self._offsets = arrays["tokens"], arrays["offsets"]
        self._doc_file, self._doc_line = arrays["doc_file"], arrays["doc_line"]
        self.skipped_files = meta["skipped_files"]
        self.lengths = np.diff(self._offsets)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> Sample:
        if not -len(self) <= index < len(self):
            raise IndexError(f"document {index} of the embedded corpus ({len(self)} documents)")
        index = index % len(self)
        begin, end = self._offsets[index], self._offsets[index + 1]
        return Sample(
            tokens=np.asarray(self._tokens[begin:end], dtype=np.int64),
            target_mask=None,
            source=f"stdlib:{self.files[self._doc_file[index]]}:{self._doc_line[index]}",
        )

    @property
    def num_tokens(self) -> int:
        return int(self._offsets[-1])

    def length_stats(self) -> dict:
        """:func:`~thdpack.data.samples.length_stats` of the document lengths."""
        return length_stats(self.lengths)


def read_stdlib(max_files: int | None = None) -> tuple[list[str], list[bytes]]:
    """``(files, sources)``: the first ``max_files`` of :func:`stdlib_files` (None = all) and their bytes with
    ``\\n`` line ends (what :func:`cut_documents` takes)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files(root)[:max_files]
    return files, [_normalized(root / f) for f in files]


def cache_entry(
    cache_dir, prefix: str, version: str, tokenizer, files: list[str], sources: list[bytes]
) -> Path:
    """The cache folder of a corpus built from ``sources``: keyed by the builder's ``version``, the Python
    version, the tokenizer and every file's path and content."""
    key = hashlib.sha256(f"{version}|{sys.version}|{tokenizer.name}".encode())
    for name, data in zip(files, sources, strict=True):
        key.update(name.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    return Path(cache_dir or cache_root()) / f"{prefix}-py{python}-{key.hexdigest()[:16]}"


def _normalized(path: Path) -> bytes:
    # ast counts \r\n and \r as line ends too; with \n only, the byte offsets of lines match its line numbers.
    return path.read_bytes().replace(b"\r\n", b"\n").replace(b"\r", b"\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build (or load) the embedded corpus and print its lengths.")
    parser.add_argument("--tokenizer", default="byte", help="'byte' or a tokenizer.json path")
    parser.add_argument("--max-files", type=int, default=None)
    parser.add_argument("--rebuild", action="store_true", help="build even if cached")
    args = parser.parse_args(argv)
    tokenizer = build_tokenizer(args.tokenizer)
    data = EmbeddedDataset(tokenizer, max_files=args.max_files, rebuild=args.rebuild)
    cached = EmbeddedDataset(tokenizer, max_files=args.max_files)
    print(f"Python {sys.version.split()[0]}, {len(data.files)} files, {len(data.skipped_files)} skipped")
    print(f"cache: {data.cache_path}")
    if data.build_seconds:
        print(f"built in {data.build_seconds:.2f} s")
    print(f"cached load in {cached.load_seconds * 1000:.0f} ms")
    print(format_length_stats(data.length_stats()))


if __name__ == "__main__":
    main()
