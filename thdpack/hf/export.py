"""A thdpack training checkpoint as a Hugging Face directory: ``python -m thdpack.export CHECKPOINT_DIR OUT_DIR``.

A run with ``model.pretrained`` keeps, beside its checkpoints, ``CHECKPOINT_DIR/hf/``: the imported
``config.json``, the tokenizer and processor files, and ``thdpack.json`` (the run's model group and precision);
a vision-language run also ``source_tensors.json`` (the source's tensor names, dtypes, shapes). The export
reads the model's tensors straight from the distributed checkpoint with ``torch.distributed.checkpoint``
(:mod:`thdpack.hf.dist_checkpoint`: whole tensors whatever tensor, pipeline, context and expert parallel layout
the run saved with, and whichever layer spec it trained with: local or Transformer Engine, sequential or
grouped-GEMM experts), maps them with :mod:`thdpack.hf.mapping` and writes ``config.json``, safetensors shards
with ``model.safetensors.index.json``, and the tokenizer and processor files. No model is built. The tensors keep
the checkpoint's dtype and bits.

Vision-language runs (Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE; :mod:`thdpack.hf.vl_export`): the language model
through the same mapping (Qwen3-VL-MoE's experts fused back as the source stored them), the vision tower (transformers' module, frozen or trained) as the checkpoint holds it, every tensor
under the name the source directory gave it (``model.layers.*`` / ``visual.*`` or ``model.language_model.*`` /
``model.visual.*``), exactly the source's set of tensors.

Checked with transformers 5.24.0 (CPU) and 5.17 (GPU host): ``AutoModelForCausalLM.from_pretrained(OUT_DIR)``;
for VL runs, on CPU with 5.24.0, ``AutoModelForImageTextToText.from_pretrained(OUT_DIR)`` with no missing or
unexpected keys.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .checkpoint_hf import checkpoint_hf_tensors, gpt_hf_tensors, run_config
from .config import read_hf_config
from .load import load_weights, never_predict_padding, set_rotary_frequencies
from .mapping import Dims, active_rules, features, megatron_to_hf
from .vl_export import vl_checkpoint_hf_tensors, vl_config_dtype, write_source_tensor_record

__all__ = [
    "PROCESSOR_FILES",
    "TOKENIZER_FILES",
    "checkpoint_hf_tensors",
    "export_checkpoint",
    "hf_state",
    "keep_with_checkpoint",
    "gpt_hf_tensors",
    "main",
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
    from .vl_checkpoint import is_vl_config

    source = Path(model["pretrained"])
    target = Path(checkpoint_dir) / HF_SUBDIR
    target.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", *TOKENIZER_FILES, *PROCESSOR_FILES):
        if (source / name).is_file():
            shutil.copyfile(source / name, target / name)
    if is_vl_config(json.loads((source / "config.json").read_text())):
        write_source_tensor_record(source, target)
    if hasattr(model, "_metadata"):  # an OmegaConf node (the recipe's group)
        from omegaconf import OmegaConf

        model = OmegaConf.to_container(model, resolve=True)
    record = {"model": dict(model), "precision": precision}
    temporary = target / "thdpack.json.tmp"
    temporary.write_text(json.dumps(record, indent=2, default=str) + "\n")
    os.replace(temporary, target / "thdpack.json")
    return target


def hf_state(gpt, hf_config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The HF tensors of a whole Megatron ``GPTModel`` (one rank holding every layer and expert)."""
    config = gpt.config
    rules = active_rules(features(config, bool(gpt.share_embeddings_and_output_weights)))
    dims = Dims(
        config.num_attention_heads,
        config.num_query_groups or config.num_attention_heads,
        config.kv_channels,
        int(hf_config["vocab_size"]),
    )
    return megatron_to_hf(gpt.state_dict(), rules, dims)


def write_hf_directory(
    out_dir: str | Path,
    tensors: Mapping[str, torch.Tensor],
    hf_config: Mapping[str, Any],
    files_from: str | Path | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Write ``config.json`` (``hf_config`` with ``dtype`` set to the tensors'), ``model-0000i-of-0000n``
    safetensors shards of at most ``max_shard_bytes`` (a larger tensor gets a shard of its own),
    ``model.safetensors.index.json``, and the tokenizer and processor files found in ``files_from``."""
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
    hf_dir = root / HF_SUBDIR
    if not (hf_dir / "thdpack.json").is_file():
        raise FileNotFoundError(
            f"{hf_dir}/thdpack.json is missing: only runs that imported a Hugging Face model (model=hf "
            "model.pretrained=DIR) keep what an export needs"
        )
    return chosen, hf_dir


class _Tensors:
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


def load_checkpoint_model(iteration_dir: str | Path, hf_dir: str | Path):
    """The run's ``GPTModel``, built on CPU without model parallelism with the local layer spec, holding the
    checkpoint's weights (through the same HF tensors the export writes; rows past the vocabulary are zero and
    never predicted) and the imported RoPE frequencies. Starts a one-process gloo group and Megatron's parallel
    state if none is running."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from thdpack.megatron.cpu import initialize_model_parallel_cpu
    from thdpack.megatron.models import build_gpt_model

    from .vl_checkpoint import is_vl_config

    if is_vl_config(read_hf_config(hf_dir)):
        raise ValueError(
            f"{Path(hf_dir) / 'config.json'}: a vision-language run; load_checkpoint_model rebuilds text models "
            "only (export it with export_checkpoint, or load the checkpoint into the model thdpack.hf.vlm_family "
            "builds)"
        )
    tensors = checkpoint_hf_tensors(iteration_dir, hf_dir)
    config, tied, model = run_config(hf_dir)
    if not dist.is_initialized():
        store = Path(tempfile.mkdtemp(prefix="thdpack_export_")) / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    if not ps.model_parallel_is_initialized():
        initialize_model_parallel_cpu()
    gpt = build_gpt_model(
        config,
        int(model["vocab_size"]),
        1,  # RoPE lengths are computed per call; no weight depends on it
        backend="torch",
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=tied,
    )
    hf_config = read_hf_config(hf_dir)
    load_weights(gpt, _Tensors(tensors, Path(iteration_dir)), hf_config)
    set_rotary_frequencies(gpt, hf_config)  # what the weights do not carry, as at import
    never_predict_padding(gpt, int(hf_config["vocab_size"]))
    return gpt


def export_checkpoint(
    checkpoint: str | Path,
    out_dir: str | Path,
    iteration: int | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Export ``checkpoint`` (a run's checkpoint.dir or one of its iteration directories) to ``out_dir``."""
    from .vl_checkpoint import is_vl_config

    iteration_dir, hf_dir = resolve_checkpoint(checkpoint, iteration)
    hf_config = read_hf_config(hf_dir)
    if is_vl_config(hf_config):
        tensors = vl_checkpoint_hf_tensors(iteration_dir, hf_dir)
    else:
        tensors = checkpoint_hf_tensors(iteration_dir, hf_dir)
    return write_hf_directory(out_dir, tensors, hf_config, hf_dir, max_shard_bytes)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m thdpack.export",
        description="Write a thdpack checkpoint of a run that imported a Hugging Face model as a Hugging Face "
        "directory (config.json, safetensors shards with index, tokenizer and processor files).",
    )
    parser.add_argument(
        "checkpoint", help="the run's checkpoint.dir (its latest checkpoint) or an iter_XXXXXXX dir"
    )
    parser.add_argument("out_dir", help="a new or empty directory")
    parser.add_argument(
        "--iteration", type=int, default=None, help="export this iteration instead of the latest"
    )
    parser.add_argument("--max-shard-gib", type=float, default=5.0, help="largest safetensors shard (GiB)")
    args = parser.parse_args(argv)
    # megatron-core without Apex/TE on CPU, and torch's renamed collectives: expected, not news
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    warnings.filterwarnings("ignore", category=FutureWarning)
    max_shard_bytes = int(args.max_shard_gib * 2**30)
    try:  # no such checkpoint, an occupied out_dir, a run without a Hugging Face model, ...
        out = export_checkpoint(args.checkpoint, args.out_dir, args.iteration, max_shard_bytes)
    except (OSError, ValueError) as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    print(f"exported {args.checkpoint} to {out}")
