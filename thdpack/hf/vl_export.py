"""A vision-language run's checkpoint (Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE) as the Hugging Face tensors of its source
directory.

The model (:class:`thdpack.megatron.vlm.VisionLanguageModel`) saves two parts in its distributed checkpoint:

* ``language_model.*``: Megatron's ``GPTModel``, converted by the text export (:func:`thdpack.hf.checkpoint_hf.gpt_hf_tensors`,
  with the mapping of the text family the language model imports as) to text-model names (``model.layers.0.self_attn.q_proj.weight``, ``lm_head.weight``);
  Qwen3-VL-MoE's per-expert tensors (``mlp.experts.{e}.gate_proj.weight``...) are stacked back into the layer's
  fused ``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj`` in the orientation the source directory stored
  them (:func:`thdpack.hf.fused_experts.fuse_experts`: ``[E, 2I, H]`` / ``[E, H, I]`` as transformers 5.x saves,
  or ``[E, H, 2I]`` / ``[E, I, H]`` as the released checkpoints);
* ``visual.*``: transformers' own vision tower module, one whole tensor per parameter under the module's names,
  frozen (``model.freeze_vision``, the default) or trained: written as the checkpoint holds them.

Names: what the source directory (``model.pretrained``) used, recorded when the run started
(``CHECKPOINT_DIR/hf/source_tensors.json``: name, dtype, shape of every tensor): transformers 5.x saves Qwen2.5-VL
as ``model.layers.*`` / ``visual.*`` and Qwen3-VL as ``model.language_model.*`` / ``model.visual.*``, and loads
both. The export writes exactly the source's tensors: one it cannot give, or a checkpoint tensor the source did
not have, stops it naming both. A checkpoint that holds no vision tower (written without the frozen tower) gets the
source directory's, bit for bit, when the tower was frozen; the export refuses when that directory is gone.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from .checkpoint import HFCheckpoint, safetensors_files
from .checkpoint_hf import gpt_hf_tensors, run_config
from .fused_experts import fuse_experts
from .mapping import Rule, active_rules
from .vl_checkpoint import VISION_PREFIXES, text_config

__all__ = ["SOURCE_TENSORS", "source_tensor_record", "vl_checkpoint_hf_tensors", "write_source_tensor_record"]

SOURCE_TENSORS = "source_tensors.json"
_GPT = "language_model."
_VISION = "visual."
_NESTED = "model.language_model."


def source_tensor_record(directory: str | Path) -> dict[str, dict]:
    """``{name: {"dtype": safetensors dtype, "shape": [...]}}`` of every tensor of the HF ``directory`` (headers
    only: no tensor is read)."""
    from safetensors import safe_open

    record = {}
    for file in safetensors_files(Path(directory)):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                part = f.get_slice(name)
                record[name] = {"dtype": part.get_dtype(), "shape": list(part.get_shape())}
    return dict(sorted(record.items()))


def write_source_tensor_record(source: str | Path, target: str | Path) -> None:
    """Keep :func:`source_tensor_record` of ``source`` as ``target/source_tensors.json``."""
    path = Path(target) / SOURCE_TENSORS
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(source_tensor_record(source), indent=1) + "\n")
    temporary.replace(path)


def _source_record(hf_dir: Path, source: Path) -> tuple[dict[str, dict], Path]:
    path = hf_dir / SOURCE_TENSORS
    if path.is_file():
        return json.loads(path.read_text()), path
    if source.is_dir():  # kept before the record existed: the source directory itself
        return source_tensor_record(source), source
    raise FileNotFoundError(
        f"{path} is missing and the run's source directory {source} (thdpack.json model.pretrained) is gone: "
        "the export writes the source's tensor names and needs one of them"
    )


def _hf_name(text_name: str, nested: bool) -> str:
    """A text-model name (``model.X``, ``lm_head.weight``) in the source's layout."""
    if nested and text_name.startswith("model."):
        return _NESTED + text_name.removeprefix("model.")
    return text_name


def vl_checkpoint_hf_tensors(
    iteration_dir: str | Path, kept: HFCheckpoint, mapping: Iterable[Rule]
) -> dict[str, torch.Tensor]:
    """The HF tensors of a vision-language run's distributed checkpoint ``iteration_dir``, named as the source
    directory named them, as saved (dtype, bits); ``kept``: the run's kept ``hf/`` directory; ``mapping``: the
    mapping of the text family its language model imports as. Raises ``ValueError`` naming the tensor and the
    rule for a checkpoint that does not give exactly the source's tensors, ``FileNotFoundError`` when a frozen
    tower must come from a source directory that is gone."""
    from .dist_checkpoint import checkpoint_tensors

    iteration_dir, hf_dir = Path(iteration_dir), kept.directory
    config, tied, model = run_config(hf_dir)
    source = Path(str(model.get("pretrained", "")))
    record, record_path = _source_record(hf_dir, source)
    nested = any(n.startswith(_NESTED) for n in record)
    vision_prefix = next(
        (p for p in VISION_PREFIXES if any(n.startswith(p) for n in record)), VISION_PREFIXES[0]
    )

    language, vision = {}, {}
    for name, tensor in checkpoint_tensors(iteration_dir).items():
        if name.startswith(_GPT):
            language[name.removeprefix(_GPT)] = tensor
        elif name.startswith(_VISION):
            vision[vision_prefix + name.removeprefix(_VISION)] = tensor
        else:
            raise ValueError(
                f"{iteration_dir}: the checkpoint's tensor '{name}' belongs neither to the language model "
                f"('{_GPT}*') nor to the vision tower ('{_VISION}*'): no Hugging Face counterpart in {record_path}"
            )
    vocab = int(text_config(kept.config)["vocab_size"])
    rules = active_rules(mapping, tied)
    text = gpt_hf_tensors(language, rules, config, vocab, iteration_dir, hf_dir, prefix=_GPT)
    out = {_hf_name(n, nested): t for n, t in text.items()}
    if config.num_moe_experts:  # Qwen3-VL-MoE: one fused pair per layer, as the source stored it
        shapes = {n: r["shape"] for n, r in record.items()}
        out = fuse_experts(
            out,
            shapes,
            config.num_moe_experts,
            config.hidden_size,
            config.moe_ffn_hidden_size,
            str(iteration_dir),
            str(record_path),
        )
    lm_head = "lm_head.weight"
    if tied and lm_head in record and lm_head not in out:
        # A tied source may keep lm_head equal to the embedding (thdpack's import allows it): so does the export.
        out[lm_head] = out[_hf_name("model.embed_tokens.weight", nested)]

    source_vision = sorted(n for n in record if n.startswith(VISION_PREFIXES))
    if not vision and source_vision:
        vision = _frozen_tower(source, source_vision, bool(model.get("freeze_vision", True)), iteration_dir)
    out.update(vision)

    extra = sorted(set(out) - set(record))
    if extra:
        raise ValueError(
            f"{iteration_dir}: the checkpoint gives {len(extra)} tensor(s) the source directory did not have "
            f"(names from {record_path}), e.g. {extra[:4]}: the checkpoint is not of this model"
        )
    missing = sorted(set(record) - set(out))
    if missing:
        raise ValueError(
            f"{iteration_dir}: the checkpoint gives no tensor for {len(missing)} of the source directory's "
            f"tensors ({record_path}), e.g. {missing[:4]}: every tensor of the source must be written"
        )
    for name, tensor in out.items():
        if list(tensor.shape) != list(record[name]["shape"]):
            raise ValueError(
                f"{iteration_dir}: '{name}' has shape {list(tensor.shape)} in the checkpoint but "
                f"{record[name]['shape']} in the source directory ({record_path}): the checkpoint is not of "
                "this model"
            )
    return out


def _frozen_tower(
    source: Path, names: list[str], frozen: bool, iteration_dir: Path
) -> dict[str, torch.Tensor]:
    """The source directory's vision tensors ``names``, bit for bit, for a checkpoint without the vision tower."""
    if not frozen:
        raise ValueError(
            f"{iteration_dir}: the checkpoint holds no vision tower but the run trained it "
            "(model.freeze_vision=false): its weights are lost, and the source directory's would not be them"
        )
    if not source.is_dir():
        raise FileNotFoundError(
            f"{source}: the run's source directory (thdpack.json model.pretrained) is gone: the checkpoint "
            f"{iteration_dir} holds no vision tower, and a frozen tower is copied from the source directory; "
            "restore it there to export"
        )
    from safetensors import safe_open

    wanted, out = set(names), {}
    for file in safetensors_files(source):
        with safe_open(str(file), framework="pt") as f:
            for name in wanted & set(f.keys()):
                out[name] = f.get_tensor(name)
    missing = sorted(wanted - set(out))
    if missing:
        raise ValueError(
            f"{source}: the source directory no longer holds the frozen vision tower's {missing[:4]}: "
            "it changed since the run started"
        )
    return out


def vl_config_dtype(config: Mapping, dtype: str) -> dict:
    """``config`` with ``dtype`` (and ``torch_dtype`` where present) set at the top level and in the nested
    ``text_config`` / ``vision_config`` that carry one."""
    out = dict(config)
    for key in ("text_config", "vision_config"):
        nested = out.get(key)
        if isinstance(nested, Mapping):
            nested = dict(nested)
            for name in ("dtype", "torch_dtype"):
                if name in nested:
                    nested[name] = dtype
            out[key] = nested
    return out
