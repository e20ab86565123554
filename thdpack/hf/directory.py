"""Hugging Face model directories around a run: what a run keeps beside its checkpoints, where an export finds it,
and a directory written.

A run with ``model.pretrained`` keeps, beside its checkpoints, ``CHECKPOINT_DIR/hf/`` (:func:`keep_with_checkpoint`):
the imported ``config.json``, the tokenizer and processor files, and ``thdpack.json`` (the run's model group and
precision); a vision-language run also ``source_tensors.json`` (the source's tensor names, dtypes, shapes).
``python -m thdpack.export`` (:mod:`thdpack.models.export`) finds it (:func:`resolve_checkpoint`), has the family
map the checkpoint's tensors, and writes them (:func:`write_hf_directory`): ``config.json``, safetensors shards
with ``model.safetensors.index.json``, and the tokenizer and processor files, copied as they are.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .checkpoint import HFCheckpoint
from .vl_checkpoint import has_vision
from .vl_export import vl_config_dtype, write_source_tensor_record

__all__ = [
    "PROCESSOR_FILES",
    "TOKENIZER_FILES",
    "InMemoryTensors",
    "keep_with_checkpoint",
    "resolve_checkpoint",
    "write_hf_directory",
]

HF_SUBDIR = "hf"
# What a model directory holds besides the weights and config.json, copied as they are.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
# A vision-language directory's processor (thdpack.hf.processor reads the image processor; transformers'
# AutoProcessor the rest): copied as they are too.
PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json")
DEFAULT_SHARD_BYTES = 5 * 2**30


def keep_with_checkpoint(checkpoint_dir: str | Path, model: Mapping[str, Any], precision: str) -> Path:
    """Copy ``model.pretrained``'s config.json, tokenizer and processor files to ``checkpoint_dir/hf/`` with
    ``thdpack.json`` (the resolved model group and the run's precision): what an export needs to rebuild the
    model. A vision-language source also leaves the names, dtypes and shapes of its tensors
    (:data:`thdpack.hf.vl_export.SOURCE_TENSORS`): the export writes the same. Call it on one rank."""
    source = Path(model["pretrained"])
    target = Path(checkpoint_dir) / HF_SUBDIR
    target.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", *TOKENIZER_FILES, *PROCESSOR_FILES):
        if (source / name).is_file():
            shutil.copyfile(source / name, target / name)
    if has_vision(HFCheckpoint.open(source).config):
        write_source_tensor_record(source, target)
    if hasattr(model, "_metadata"):  # an OmegaConf node (the recipe's group)
        from omegaconf import OmegaConf

        model = OmegaConf.to_container(model, resolve=True)
    record = {"model": dict(model), "precision": precision}
    temporary = target / "thdpack.json.tmp"
    temporary.write_text(json.dumps(record, indent=2, default=str) + "\n")
    os.replace(temporary, target / "thdpack.json")
    return target


def write_hf_directory(
    out_dir: str | Path,
    tensors: Mapping[str, torch.Tensor],
    hf_config: Mapping[str, Any],
    files_from: str | Path | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Write ``config.json`` (``hf_config`` with ``dtype`` set to the tensors', without ``quantization_config``),
    ``model-0000i-of-0000n`` safetensors shards of at most ``max_shard_bytes`` (a larger tensor gets a shard of
    its own), ``model.safetensors.index.json``, and the tokenizer and processor files found in ``files_from``."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty: choose a new directory (nothing was written)")
    out.mkdir(parents=True, exist_ok=True)
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    weight_map, total = {}, 0
    for i, names in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        # own storage for each tensor: safetensors refuses views of one buffer (q, k, v of one fused tensor)
        part = {n: tensors[n].detach().to("cpu").clone(memory_format=torch.contiguous_format) for n in names}
        save_file(part, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
        total += sum(t.numel() * t.element_size() for t in part.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    dtypes = {t.dtype for t in tensors.values()}
    config = {k: v for k, v in hf_config.items() if not k.startswith("_")}
    # the tensors are written as trained, in one float dtype: a source's quantization (gpt-oss's MXFP4 experts,
    # dequantized on import) no longer describes them
    config.pop("quantization_config", None)
    if len(dtypes) == 1:
        dtype = str(dtypes.pop()).removeprefix("torch.")
        config = vl_config_dtype(config, dtype)
        config["dtype"] = dtype
        if "torch_dtype" in config:
            config["torch_dtype"] = dtype
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if files_from is not None:
        for name in (*TOKENIZER_FILES, *PROCESSOR_FILES):
            if (Path(files_from) / name).is_file():
                shutil.copyfile(Path(files_from) / name, out / name)
    return out


def resolve_checkpoint(path: str | Path, iteration: int | None = None) -> tuple[Path, Path]:
    """``(iteration directory, hf/ directory)`` for ``path``: a run's ``checkpoint.dir`` (its latest complete
    checkpoint, or ``iteration``) or one ``iter_XXXXXXX`` directory in it."""
    from thdpack.megatron.checkpoint import checkpoint_path, latest_iteration

    path = Path(path)
    if re.fullmatch(r"iter_\d{7}", path.name) and path.is_dir():
        root, chosen = path.parent, path
    else:
        root = path
        if iteration is None:
            iteration = latest_iteration(root)
            if iteration is None:
                raise FileNotFoundError(
                    f"{root} holds no complete checkpoint (no latest_checkpointed_iteration.txt)"
                )
        chosen = checkpoint_path(root, iteration)
        if not chosen.is_dir():
            raise FileNotFoundError(f"{chosen} does not exist")
    _check_complete(chosen, root)
    hf_dir = root / HF_SUBDIR
    if not (hf_dir / "thdpack.json").is_file():
        raise FileNotFoundError(
            f"{hf_dir}/thdpack.json is missing: only runs that imported a Hugging Face model (model=hf "
            "model.pretrained=DIR) keep what an export needs"
        )
    return chosen, hf_dir


def _check_complete(chosen: Path, root: Path) -> None:
    """The checkpoint's files against its manifest; a damaged one is refused naming the file (and the newest
    complete checkpoint beside it, if any)."""
    from thdpack.megatron.checkpoint_dir import checkpoint_path, iterations
    from thdpack.megatron.checkpoint_manifest import verify

    damage = verify(chosen)
    if damage is None:
        return
    others = (checkpoint_path(root, i) for i in iterations(root))
    complete = next((p for p in others if p != chosen and verify(p) is None), None)
    hint = f"; the newest complete checkpoint there is {complete.name} (--iteration {int(complete.name[5:])})"
    raise ValueError(f"{chosen} is damaged: {damage}{hint if complete else ''}")


class InMemoryTensors:
    """HF tensors in memory, read as :func:`thdpack.hf.load.load_weights` reads a safetensors directory."""

    def __init__(self, tensors: dict[str, torch.Tensor], source: Path):
        self.tensors, self.directory = tensors, source

    def names(self) -> set[str]:
        return set(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def read(self, name: str, rows: slice = slice(None), cols: slice = slice(None)) -> torch.Tensor:
        t = self.tensors[name]
        return t[rows] if t.dim() == 1 else t[rows, cols]

    def where(self, name: str) -> str:
        return str(self.directory)
