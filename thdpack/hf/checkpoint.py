"""A Hugging Face model directory, opened once: its ``config.json`` parsed (plain JSON, never transformers' remote
code), the text kept for ``file:line`` in errors, its architecture, and its safetensors tensors.

    checkpoint = HFCheckpoint.open("path/to/hf_dir")
    checkpoint.architecture                    # "LlamaForCausalLM"
    checkpoint.config["num_hidden_layers"]     # config.json as read (a read-only mapping)
    checkpoint.where("rope_theta")             # "path/to/hf_dir/config.json:21"
    checkpoint.tensors().read(name, rows)      # only the asked slice, memory-mapped

A process parses a directory's ``config.json`` once: :meth:`HFCheckpoint.open` returns the same object while the
file is unchanged on disk, so the recipe, the start-up checks, the model build and the processor share one parse.
The tensors are opened anew by each :meth:`HFCheckpoint.tensors` call (a reader holds its files open).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

__all__ = ["HFCheckpoint", "HFConfigError", "SafetensorsReader", "safetensors_files"]


class HFConfigError(ValueError):
    """A ``config.json`` thdpack cannot import exactly; the message names the file, line, key and rule."""


class HFCheckpoint:
    """One Hugging Face directory (``directory``): ``config`` (``config.json``, read-only), ``path`` (of
    ``config.json``), ``architecture`` (``architectures[0]``, or None) and its tensors (:meth:`tensors`)."""

    def __init__(self, directory: str | Path, config: Mapping[str, Any], text: str = ""):
        self.directory = Path(directory)
        self.path = self.directory / "config.json"
        self.config: Mapping[str, Any] = MappingProxyType(dict(config))
        self.text = text

    @classmethod
    def open(cls, directory: str | Path) -> HFCheckpoint:
        """``directory``'s checkpoint; raises :class:`HFConfigError` for a missing or unreadable ``config.json``."""
        path = Path(directory) / "config.json"
        if not path.is_file():
            raise HFConfigError(
                f"model.pretrained={directory}: no config.json there (a Hugging Face model directory)"
            )
        stat = path.stat()
        return _open(str(Path(directory).resolve()), stat.st_mtime_ns, stat.st_size)

    @classmethod
    def from_config(cls, config: Mapping[str, Any], directory: str | Path = ".") -> HFCheckpoint:
        """A checkpoint of ``config`` alone (no file): what a test or a derived config reads."""
        return cls(directory, config, json.dumps(dict(config), indent=2))

    @property
    def architecture(self) -> str | None:
        architectures = self.config.get("architectures")
        if isinstance(architectures, list) and len(architectures) == 1 and isinstance(architectures[0], str):
            return architectures[0]
        return None

    def tensors(self) -> SafetensorsReader:
        """The directory's safetensors (index and headers read now, tensors as they are asked for)."""
        return SafetensorsReader(self.directory)

    def where(self, key: str) -> str:
        """``config.json:LINE`` of the first line naming ``key`` (the file alone when none does)."""
        needle = f'"{key}"'
        for number, line in enumerate(self.text.splitlines(), start=1):
            if needle in line:
                return f"{self.path}:{number}"
        return str(self.path)

    def error(self, key: str, message: str) -> HFConfigError:
        return HFConfigError(f"{self.where(key)}: key '{key}' {message}")


@functools.lru_cache(maxsize=16)
def _open(directory: str, mtime_ns: int, size: int) -> HFCheckpoint:
    """The parse of ``directory/config.json`` as it was at ``(mtime_ns, size)``: a rewritten file is read anew."""
    path = Path(directory) / "config.json"
    text = path.read_text()
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise HFConfigError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from e
    if not isinstance(config, dict):
        raise HFConfigError(f"{path}: a JSON object expected, found {type(config).__name__}")
    return HFCheckpoint(directory, config, text)


def safetensors_files(directory: str | Path) -> list[Path]:
    """The safetensors files of ``directory``: the shards ``model.safetensors.index.json`` lists, or
    ``model.safetensors``."""
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return sorted({directory / f for f in weight_map.values()})
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"{directory}: no model.safetensors or model.safetensors.index.json")


class SafetensorsReader:
    """The tensors of an HF directory (``model.safetensors``, or shards listed in
    ``model.safetensors.index.json``), opened memory-mapped on first use; reads return only the asked slice."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        index = self.directory / "model.safetensors.index.json"
        single = self.directory / "model.safetensors"
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index}: no 'weight_map' object (tensor name -> shard file)")
            self.files = {name: self.directory / file for name, file in weight_map.items()}
        elif single.is_file():
            from safetensors import safe_open

            with safe_open(single, framework="pt") as f:
                self.files = dict.fromkeys(f.keys(), single)
        else:
            found = sorted(p.name for p in self.directory.glob("*.bin"))
            raise ValueError(
                f"{self.directory} has neither model.safetensors nor model.safetensors.index.json"
                + (f" (found {found}: thdpack reads weights through safetensors only)" if found else "")
            )
        self._open: dict[Path, object] = {}

    def names(self) -> set[str]:
        return set(self.files)

    def _slice(self, name: str):
        from safetensors import safe_open

        path = self.files[name]
        if path not in self._open:
            if not path.is_file():
                raise ValueError(f"{path} (listed for '{name}' in the index) does not exist")
            self._open[path] = safe_open(path, framework="pt")
        try:
            return self._open[path].get_slice(name)
        except Exception as e:  # safetensors raises its own error type for a missing name
            raise ValueError(f"{path} does not hold '{name}' although the index says so") from e

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, rows: slice = slice(None), cols: slice = slice(None)) -> torch.Tensor:
        part = self._slice(name)
        return part[rows] if len(part.get_shape()) == 1 else part[rows, cols]

    def where(self, name: str) -> str:
        return str(self.files[name])
