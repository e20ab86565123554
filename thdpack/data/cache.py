"""Where thdpack caches what it derives from data (the embedded corpus, JSONL indexes)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

__all__ = ["cache_root", "read_entry", "write_entry"]


def cache_root() -> Path:
    """``$THDPACK_CACHE``, else ``~/.cache/thdpack``."""
    return Path(os.environ.get("THDPACK_CACHE") or Path.home() / ".cache" / "thdpack")


def write_entry(path: Path, arrays: dict[str, np.ndarray], meta: dict) -> None:
    """A cache folder ``path``: ``<name>.npy`` per array, ``meta.json``, and a ``done`` marker.

    Written to a private folder and renamed into place: a reader never sees half an entry, and processes that
    build at once all end with a complete one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=".build-"))
    for name, array in arrays.items():
        np.save(tmp / f"{name}.npy", array)
    (tmp / "meta.json").write_text(json.dumps(meta))
    (tmp / "done").write_text("")
    if path.exists():
        shutil.rmtree(path, ignore_errors=True)
    try:
        os.replace(tmp, path)
    except OSError:  # another process renamed its copy first; both are identical
        shutil.rmtree(tmp, ignore_errors=True)


def read_entry(path: Path, mapped: tuple[str, ...] = ()) -> tuple[dict[str, np.ndarray], dict]:
    """The arrays and ``meta.json`` of the cache folder ``path`` (:func:`write_entry`); the arrays named in
    ``mapped`` memory-mapped read-only, the others read whole."""
    arrays = {
        file.stem: np.load(file, mmap_mode="r" if file.stem in mapped else None)
        for file in sorted(path.glob("*.npy"))
    }
    return arrays, json.loads((path / "meta.json").read_text())
