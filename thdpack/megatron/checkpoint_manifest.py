"""A checkpoint's ``manifest.json``: every file of it with its size and CRC-32s, written last, checked on load.

    sums = checksums(partial, my_files(partial, rank))      # each rank, the files it wrote (threads)
    write_manifest(partial, merged_sums, iteration, writer)  # one rank, after every rank's files are written
    damage = verify(final)                                   # None, or the first bad file and what is wrong

One CRC-32 per 256 MiB block of a file, so that a rank's threads sum a large file together (zlib's crc32 releases
the GIL). CRC-32 finds truncation and corruption, not tampering (whoever can rewrite a shard can rewrite the
manifest; what keeps a checkpoint from running code is thdpack.megatron.checkpoint_reader); it is about twice as
fast as SHA-256 (``benchmarks/checksum_cost.py`` measures both and estimates an 8B checkpoint's cost).
"""

from __future__ import annotations

import json
import os
import re
import zlib
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "BLOCK",
    "MANIFEST",
    "REQUIRED",
    "Damage",
    "checksums",
    "my_files",
    "read_manifest",
    "verify",
    "write_manifest",
]

MANIFEST = "manifest.json"
# What megatron-core's torch_dist format always writes: a directory without them is no checkpoint.
REQUIRED = (".metadata", "common.pt", "metadata.json")
_CHUNK = 8 << 20
BLOCK = 256 << 20
_SHARD = re.compile(r"__(\d+)_\d+\.distcp")


@dataclass(frozen=True)
class Damage:
    """What makes a checkpoint unusable: the file, and what is wrong with it."""

    file: Path
    reason: str

    def __str__(self) -> str:
        return f"{self.file}: {self.reason}"


def crc32(path: Path, start: int = 0, length: int | None = None) -> str:
    """CRC-32 of ``length`` bytes of ``path`` from ``start`` (all of the rest when None), as 8 hex digits."""
    value, left = 0, length
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        while left is None or left > 0:
            chunk = f.read(_CHUNK if left is None else min(_CHUNK, left))
            if not chunk:
                break
            value = zlib.crc32(chunk, value)
            left = None if left is None else left - len(chunk)
    return f"{value:08x}"


def checksums(directory: Path, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """``{name: {"size", "crc32": [one a block]}}`` of the files ``names`` in ``directory``, summed in parallel
    threads, block by block."""
    sizes = {name: (directory / name).stat().st_size for name in sorted(names)}
    blocks = [(name, start) for name, size in sizes.items() for start in range(0, max(size, 1), BLOCK)]
    workers = max(1, min(8, os.cpu_count() or 1, len(blocks)))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        sums = list(pool.map(lambda block: crc32(directory / block[0], block[1], BLOCK), blocks))
    found: dict[str, dict[str, Any]] = {name: {"size": size, "crc32": []} for name, size in sizes.items()}
    for (name, _), value in zip(blocks, sums, strict=True):
        found[name]["crc32"].append(value)
    return found


def my_files(directory: Path, rank: int, world: int = 1) -> list[str]:
    """The files of ``directory`` that ``rank`` sums: the shards it wrote (``__<rank>_<i>.distcp``, torch's
    naming), and on rank 0 every other file; a shard of a rank beyond ``world`` goes to ``rank % world``."""
    mine = []
    for path in directory.iterdir():
        if path.name == MANIFEST or not path.is_file():
            continue
        shard = _SHARD.fullmatch(path.name)
        owner = int(shard.group(1)) % world if shard else 0
        if owner == rank:
            mine.append(path.name)
    return mine


def write_manifest(
    directory: Path, files: Mapping[str, Mapping[str, Any]], iteration: int, writer: Mapping[str, Any]
) -> Path:
    """``directory/manifest.json`` (written to a temporary file, synced, renamed): the last file of a save."""
    record = {
        "iteration": iteration,
        "checksum": "crc32",
        "block": BLOCK,
        "writer": dict(writer),
        "files": dict(sorted(files.items())),
    }
    path = directory / MANIFEST
    temporary = path.with_suffix(".tmp")
    with open(temporary, "w") as f:
        f.write(json.dumps(record, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
    return path


def read_manifest(directory: Path) -> dict | None:
    """The manifest of ``directory``, or None when it has none (saved before thdpack wrote manifests)."""
    path = Path(directory) / MANIFEST
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (ValueError, UnicodeDecodeError, OSError) as error:
        raise _Bad(Damage(path, f"cannot be read ({error})")) from None
    if not isinstance(record, dict) or not isinstance(record.get("files"), dict):
        raise _Bad(Damage(path, "holds no list of files"))
    return record


class _Bad(Exception):
    def __init__(self, damage: Damage):
        self.damage = damage


def verify(directory: Path, share: Iterable[str] | None = None) -> Damage | None:
    """The first problem of the checkpoint in ``directory``, or None: a file of the manifest that is missing or
    has another size, or (for the files of ``share``; all when None) another CRC-32. Without a manifest (an
    older thdpack's checkpoint) only the files every checkpoint has are looked for."""
    directory = Path(directory)
    if not directory.is_dir():
        return Damage(directory, "missing")
    try:
        manifest = read_manifest(directory)
    except _Bad as bad:
        return bad.damage
    if manifest is None:
        missing = [name for name in REQUIRED if not (directory / name).is_file()]
        return (
            Damage(directory / missing[0], "missing (and the checkpoint has no manifest.json)")
            if missing
            else None
        )
    files = manifest["files"]
    for name, expected in sorted(files.items()):
        path = directory / name
        if not path.is_file():
            return Damage(path, "missing (listed in manifest.json)")
        size = path.stat().st_size
        if size != expected.get("size"):
            return Damage(
                path, f"{size} bytes, manifest.json says {expected.get('size')} (truncated or replaced)"
            )
    if manifest.get("block", BLOCK) != BLOCK:
        return Damage(directory / MANIFEST, f"sums blocks of {manifest.get('block')} bytes, not {BLOCK}")
    names = sorted(files) if share is None else sorted(set(share) & set(files))
    for name, found in checksums(directory, names).items():
        expected = files[name].get("crc32")
        for i, value in enumerate(found["crc32"]):
            if not isinstance(expected, list) or i >= len(expected) or value != expected[i]:
                said = expected[i] if isinstance(expected, list) and i < len(expected) else expected
                return Damage(
                    directory / name,
                    f"CRC-32 of bytes {i * BLOCK}-{min((i + 1) * BLOCK, found['size'])} is {value}, manifest.json "
                    f"says {said} (corrupt)",
                )
    return None
