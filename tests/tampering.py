"""What an attacker or a failing disk does to a checkpoint directory, for the tests: a ``.metadata`` or a byte object
in a shard replaced by a pickle that runs code (writing a marker file) while it loads, then returns what was there;
a manifest written again to match (an attacker can); a shard cut short."""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch

from thdpack.megatron.checkpoint_manifest import MANIFEST, checksums, read_manifest, write_manifest


class _Payload:
    """Unpickled, writes ``marker`` and evaluates to ``value`` (the original object)."""

    def __init__(self, marker: Path, value):
        self.marker, self.value = str(marker), value

    def __reduce__(self):
        code = f"__import__('pathlib').Path({self.marker!r}).touch() or __import__('pickle').loads({pickle.dumps(self.value)!r})"
        return (eval, (code,))


def _metadata(directory: Path):
    with open(directory / ".metadata", "rb") as f:
        return pickle.load(f)  # the test's own, untampered file


def poison_metadata(directory: Path, marker: Path) -> None:
    """Replace ``.metadata`` by a pickle that writes ``marker`` and then returns the real metadata."""
    metadata = _metadata(directory)
    (directory / ".metadata").write_bytes(pickle.dumps(_Payload(marker, metadata)))
    refresh_manifest(directory)


def poison_byte_object(directory: Path, prefix: str, marker: Path) -> str:
    """Replace the first byte object whose key starts with ``prefix`` (``rng_state``) inside its shard by a
    ``torch.save`` of a pickle that writes ``marker`` and then returns the original; returns the shard's name."""
    return replace_byte_object(directory, prefix, lambda value: _Payload(marker, value))


def replace_byte_object(directory: Path, prefix: str, change) -> str:
    """Replace the first byte object whose key starts with ``prefix`` inside its shard by ``torch.save`` of
    ``change(its value)``; offsets in ``.metadata`` and the manifest follow. Returns the shard's name."""
    metadata = _metadata(directory)
    index, info = next((i, s) for i, s in metadata.storage_data.items() if i.fqn.startswith(prefix))
    shard = directory / info.relative_path
    original = shard.read_bytes()
    value = torch.load(io.BytesIO(original[info.offset : info.offset + info.length]), weights_only=False)
    payload = io.BytesIO()
    torch.save(change(value), payload)
    payload = payload.getvalue()
    shard.write_bytes(original[: info.offset] + payload + original[info.offset + info.length :])
    delta = len(payload) - info.length
    for other in metadata.storage_data.values():
        if other.relative_path == info.relative_path and other.offset > info.offset:
            other.offset += delta
    info.length = len(payload)
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    refresh_manifest(directory)
    return shard.name


def refresh_manifest(directory: Path) -> None:
    """Write the manifest again for the files as they are now (what an attacker would do)."""
    manifest = read_manifest(directory)
    files = [n for n in manifest["files"]]
    write_manifest(directory, checksums(directory, files), manifest["iteration"], manifest["writer"])
    assert (directory / MANIFEST).is_file()


def truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
