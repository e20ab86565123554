"""PEFT's LoRA adapters and a family's mapping: which Hugging Face modules LoRA can adapt, where each sits in
Megatron's fused layers, and PEFT's adapter directory read and written.

    layers = lora_layers(family.mapping)                    # the adaptable layers of the family, as data
    names = target_names(layers, ["q_proj", "v_proj"])      # or "all-linear": every adaptable module's name
    adapter = read_adapter(DIR)                              # adapter_config.json (plain JSON) + safetensors
    write_adapter(OUT, tensors, config)                      # PEFT's format: PeftModel.from_pretrained loads it

The adaptable layers are the family's per-layer ``qkv``, ``gated`` and ``row`` rules (:mod:`thdpack.hf.mapping`): a
layer's Hugging Face modules are its parts (``linear_qkv``: ``q_proj``, ``k_proj``, ``v_proj``; ``linear_fc1``:
``gate_proj``, ``up_proj``). Embeddings and the output layer are not adapted (PEFT's ``all-linear`` leaves the output
layer out too), nor are experts (per-expert rules; transformers 5 stores a MoE's experts as fused parameters, which
PEFT's ``target_modules`` does not reach either).

PEFT's format (peft 0.21): ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``, ...) and
``adapter_model.safetensors`` with ``base_model.model.<module path>.lora_A.weight`` (``[r, in]``) and
``lora_B.weight`` (``[out, r]``); the branch adds ``scale * B A x``, ``scale = lora_alpha / r`` (``/ sqrt(r)`` with
``use_rslora``). A vision-language model's language model sits at ``model.language_model.`` in transformers' module
tree (its checkpoint may name its tensors ``model.layers.*``).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .mapping import GATED, QKV, REPLICATED, ROW, VOCAB, Rule

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "ALL_LINEAR",
    "Adapter",
    "LoRALayer",
    "base_fingerprint",
    "lora_layers",
    "merge_adapters",
    "peft_key",
    "read_adapter",
    "target_names",
    "write_adapter",
]

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
ALL_LINEAR = "all-linear"
PEFT_PREFIX = "base_model.model."
VL_TEXT_PREFIX = "model.language_model."  # transformers 5's module path of a VL model's language model


@dataclass(frozen=True)
class LoRALayer:
    """One adaptable Megatron layer of a family: ``megatron``, its module path with ``{layer}``; ``layout``:
    ``qkv``, ``gated`` or ``row``; ``modules``: the Hugging Face module paths of its parts, in the layout's order
    (``model.layers.{layer}.self_attn.q_proj``, ...); ``layer_type``: the type of the layers that hold it in a
    model whose layers differ (the rule's), None for every layer."""

    megatron: str
    layout: str
    modules: tuple[str, ...]
    layer_type: str | None = None

    @property
    def names(self) -> tuple[str, ...]:
        """The parts' short names (``q_proj``): PEFT's ``target_modules``."""
        return tuple(m.rsplit(".", 1)[-1] for m in self.modules)


def lora_layers(mapping: Iterable[Rule]) -> tuple[LoRALayer, ...]:
    """The adaptable layers of a family's ``mapping`` (module docstring)."""
    out = []
    for rule in mapping:
        name = rule.megatron[0]
        if (
            rule.kind in (QKV, GATED, ROW)
            and not rule.per_expert
            and "{layer}" in name
            and name.endswith(".weight")
            and all(h.endswith(".weight") for h in rule.hf)
        ):
            modules = tuple(h.removesuffix(".weight") for h in rule.hf)
            out.append(LoRALayer(name.removesuffix(".weight"), rule.kind, modules, rule.layer_type))
    return tuple(out)


def not_adapted(mapping: Iterable[Rule]) -> list[str]:
    """The short names of a family's per-layer weights that are neither adaptable nor norms, embeddings or experts:
    projections of a layout LoRA does not implement (Qwen3.5's gated QKV and DeltaNet input projections), which
    ``all-linear`` leaves with their weights."""
    adapted = {n for layer in lora_layers(mapping) for n in layer.names}
    names = set()
    for rule in mapping:
        if (
            rule.kind in (QKV, GATED, ROW, REPLICATED, VOCAB)
            or rule.per_expert
            or "{layer}" not in rule.megatron[0]
        ):
            continue
        names.update(h.removesuffix(".weight").rsplit(".", 1)[-1] for h in rule.hf if h.endswith(".weight"))
    return sorted(names - adapted)


def target_names(layers: Iterable[LoRALayer], wanted, key: str = "peft.target_modules") -> tuple[str, ...]:
    """The modules to adapt, by short name, in the family's order: ``all-linear`` (every adaptable module) or a
    list of names. A name the family cannot adapt is refused naming ``key`` and the names it can."""
    known = [n for layer in layers for n in layer.names]
    if wanted == ALL_LINEAR or wanted == [ALL_LINEAR]:
        return tuple(known)
    if isinstance(wanted, str) or not wanted or not all(isinstance(n, str) for n in wanted):
        raise ValueError(
            f"{key} is {wanted!r}: '{ALL_LINEAR}' or a list of module names from {known} expected"
        )
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise ValueError(
            f"{key} names {unknown}: LoRA adapts {known} of this model ('{ALL_LINEAR}': all of them; embeddings, "
            "the output layer and MoE experts are not adapted)"
        )
    return tuple(n for n in known if n in wanted)


def peft_key(module_path: str, which: str) -> str:
    """PEFT's safetensors key of a module's ``lora_A`` or ``lora_B`` (``which``)."""
    return f"{PEFT_PREFIX}{module_path}.lora_{which}.weight"


def module_path(text_path: str, vision_language: bool) -> str:
    """transformers' module path of a text-model module path (``model.layers.0.self_attn.q_proj``) in the model
    PEFT wraps: the same for a text model, under ``model.language_model.`` for a vision-language one."""
    if vision_language and text_path.startswith("model."):
        return VL_TEXT_PREFIX + text_path.removeprefix("model.")
    return text_path


def text_path(path: str, vision_language: bool) -> str | None:
    """The inverse of :func:`module_path` (a transformers 4 VL key ``model.layers.*`` is accepted as it is); None
    for a module outside the language model (a vision tower's)."""
    if not vision_language:
        return path
    if path.startswith(VL_TEXT_PREFIX):
        return "model." + path.removeprefix(VL_TEXT_PREFIX)
    if path.startswith(("model.layers.", "model.embed_tokens", "lm_head")):
        return path
    return None


# ---------------------------------------------------------------------------------------------------------
# adapter_config.json


# Keys that say nothing about the computation (bookkeeping, or initialisers whose result the weights replace).
_INFORMATIONAL = {
    "task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
    "inference_mode", "r", "lora_alpha", "lora_dropout", "target_modules", "exclude_modules", "megatron_core",
    "init_lora_weights", "use_rslora", "loftq_config", "eva_config", "corda_config", "lora_ga_config",
    "qalora_group_size", "ensure_weight_tying", "layers_pattern",
}  # fmt: skip
# Keys that change the computation: thdpack takes them at these values only (the rule says why).
_NEUTRAL = {
    "bias": ("none", "LoRA biases (bias='all' / 'lora_only') are not implemented"),
    "lora_bias": (False, "a bias on lora_B is not implemented"),
    "use_dora": (False, "DoRA (weight-decomposed LoRA) is not implemented"),
    "fan_in_fan_out": (
        False,
        "fan_in_fan_out is for Conv1D (GPT-2) layers, which thdpack's families have not",
    ),
    "modules_to_save": (None, "fully trained extra modules (modules_to_save) are not implemented"),
    "layers_to_transform": (None, "adapters on some layers only (layers_to_transform) are not implemented"),
    "rank_pattern": ({}, "a rank per module (rank_pattern) is not implemented"),
    "alpha_pattern": ({}, "an alpha per module (alpha_pattern) is not implemented"),
    "megatron_config": (None, "PEFT's own Megatron layers are not what thdpack builds"),
    "trainable_token_indices": (None, "trainable token embeddings are not implemented"),
    "layer_replication": (None, "layer replication changes the model's layers"),
    "target_parameters": (None, "LoRA on parameters (MoE experts) is not implemented"),
    "use_qalora": (False, "QA-LoRA is not implemented"),
    "alora_invocation_tokens": (None, "activated LoRA is not implemented"),
}
# Initialisers that changed the base model's weights: the adapter only works on that changed base.
_BASE_CHANGING_INIT = re.compile(r"(pissa|corda|olora|mica|loftq|lora_ga)", re.IGNORECASE)


@dataclass(frozen=True)
class Adapter:
    """A PEFT LoRA adapter directory: ``config`` (``adapter_config.json`` as read), ``rank``, ``alpha``,
    ``dropout``, ``rslora``; ``names``: the modules it adapts (short names); ``weights``: ``{module path: (A, B)}``
    (transformers' module paths, as the keys say)."""

    directory: Path
    config: dict
    rank: int
    alpha: float
    dropout: float
    rslora: bool
    names: tuple[str, ...]
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def _neutral(value, neutral) -> bool:
    if neutral is None or neutral == {}:
        return value in (None, {}, [], "")
    return value == neutral


def read_config(directory: str | Path) -> dict:
    """``adapter_config.json`` of a PEFT LoRA adapter, parsed as plain JSON and checked: PEFT's LoRA, a positive
    ``r``, a positive ``lora_alpha``, and no option that thdpack does not compute (named with the file and why).
    An unknown key passes only at a neutral value (null, false, empty)."""
    path = Path(directory) / ADAPTER_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: peft.from_adapter takes a PEFT adapter directory")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: a JSON object expected")
    if config.get("peft_type") != "LORA":
        raise ValueError(
            f"{path}: peft_type is {config.get('peft_type')!r}: only PEFT's 'LORA' adapters load"
        )
    for key, value in config.items():
        if key in _NEUTRAL:
            neutral, rule = _NEUTRAL[key]
            if not _neutral(value, neutral):
                raise ValueError(f"{path}: {key} is {value!r}: {rule} (thdpack needs {neutral!r})")
        elif key not in _INFORMATIONAL and value not in (None, False, {}, [], ""):
            raise ValueError(
                f"{path}: {key} is {value!r}: thdpack does not know what this PEFT option changes (it loads "
                "adapters whose unknown options are null, false or empty)"
            )
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and _BASE_CHANGING_INIT.search(init):
        raise ValueError(
            f"{path}: init_lora_weights is {init!r}: that initialisation changed the base model's weights, so the "
            "adapter needs that changed base, not the checkpoint's (convert it with PEFT's "
            "path_initial_model_for_weight_conversion first)"
        )
    r, alpha = config.get("r"), config.get("lora_alpha")
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise ValueError(f"{path}: r is {r!r}: a positive integer expected")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise ValueError(f"{path}: lora_alpha is {alpha!r}: a positive number expected")
    dropout = config.get("lora_dropout", 0.0) or 0.0
    if not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ValueError(f"{path}: lora_dropout is {dropout!r}: a number in [0, 1) expected")
    return config


def read_adapter(directory: str | Path, vision_language: bool = False) -> Adapter:
    """A PEFT LoRA adapter directory (:func:`read_config`; weights from ``adapter_model.safetensors`` only: no
    pickle). Every key must be a ``lora_A`` / ``lora_B`` weight of a language-model module, each module with both,
    every layer adapting the same modules."""
    from safetensors.torch import load_file

    directory = Path(directory)
    config = read_config(directory)
    weights_path = directory / ADAPTER_WEIGHTS
    if not weights_path.is_file():
        pickled = directory / "adapter_model.bin"
        raise FileNotFoundError(
            f"{weights_path} is missing"
            + (
                f" ({pickled.name} is a pickle, which thdpack never loads: save with safetensors)"
                if pickled.exists()
                else ""
            )
        )
    tensors = load_file(str(weights_path))
    pattern = re.compile(re.escape(PEFT_PREFIX) + r"(?P<path>.+)\.lora_(?P<which>[AB])\.weight\Z")
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = pattern.match(key)
        if m is None:
            raise ValueError(
                f"{weights_path}: '{key}' is not a LoRA weight (base_model.model.<module>.lora_A/lora_B.weight): "
                "adapters with other tensors (modules_to_save, DoRA magnitudes, biases) are not loaded"
            )
        path = text_path(m["path"], vision_language)
        if path is None:
            raise ValueError(
                f"{weights_path}: '{key}' adapts the vision tower: thdpack's LoRA adapts the language model only "
                "(the vision tower stays frozen)"
            )
        parts.setdefault(path, {})[m["which"]] = tensor
    weights = {}
    for path, ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{weights_path}: module '{path}' has lora_{next(iter(ab))} without its pair")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != config["r"] or b.shape[1] != config["r"]:
            raise ValueError(
                f"{weights_path}: module '{path}' has lora_A {list(a.shape)} and lora_B {list(b.shape)}; r is "
                f"{config['r']} in {ADAPTER_CONFIG}"
            )
        weights[path] = (a, b)
    if not weights:
        raise ValueError(f"{weights_path}: no LoRA weights")
    names = sorted({p.rsplit(".", 1)[-1] for p in weights})
    return Adapter(
        directory=directory,
        config=config,
        rank=int(config["r"]),
        alpha=float(config["lora_alpha"]),
        dropout=float(config.get("lora_dropout") or 0.0),
        rslora=bool(config.get("use_rslora", False)),
        names=tuple(names),
        weights=weights,
    )


def check_coverage(
    adapter: Adapter, layers: Iterable[LoRALayer], num_layers: int, types: list[str] | None = None
) -> tuple[str, ...]:
    """The adapter's module names in the family's order, after checking that its weights are exactly those of
    these names in every one of ``num_layers`` layers that holds them (``types``: each layer's type where they
    differ; an adapter for another model, or for some layers only, is refused naming a module)."""
    names = target_names(layers, list(adapter.names), key=f"{adapter.directory / ADAPTER_WEIGHTS}'s modules")
    expected = {
        module.format(layer=i)
        for layer in layers
        for module, name in zip(layer.modules, layer.names, strict=True)
        if name in names
        for i in range(num_layers)
        if layer.layer_type is None or types is None or types[i] == layer.layer_type
    }
    missing, extra = sorted(expected - set(adapter.weights)), sorted(set(adapter.weights) - expected)
    if missing or extra:
        raise ValueError(
            f"{adapter.directory / ADAPTER_WEIGHTS}: the adapter does not fit this model's {num_layers} layers"
            + (f"; no weights for {missing[:4]}" if missing else "")
            + (f"; weights for modules the model has not: {extra[:4]}" if extra else "")
        )
    return names


def write_adapter(
    out_dir: str | Path,
    weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    *,
    rank: int,
    alpha: float,
    dropout: float,
    rslora: bool,
    names: Iterable[str],
    vision_language: bool,
    base: str | None = None,
) -> Path:
    """Write a PEFT adapter directory: ``adapter_config.json`` and ``adapter_model.safetensors`` with ``weights``
    (``{text-model module path: (A, B)}``). ``target_modules``: the module names, or for a vision-language model a
    regular expression over its language model only (PEFT would otherwise adapt the vision tower's modules of the
    same names)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty: choose a new directory (nothing was written)")
    out.mkdir(parents=True, exist_ok=True)
    names = list(names)
    targets: Any = names
    if vision_language:
        targets = re.escape(VL_TEXT_PREFIX) + r"layers\.\d+\..*\.(" + "|".join(map(re.escape, names)) + ")"
    tensors = {}
    for path, (a, b) in weights.items():
        full = module_path(path, vision_language)
        tensors[peft_key(full, "A")] = a.detach().to("cpu").contiguous()
        tensors[peft_key(full, "B")] = b.detach().to("cpu").contiguous()
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": int(rank),
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "use_rslora": bool(rslora),
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "use_dora": False,
    }
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return out


def merge_adapters(
    tensors: dict[str, torch.Tensor],
    weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    scale: float,
    stored_name,
) -> dict[str, torch.Tensor]:
    """``tensors`` (a model directory's, by stored name) with each adapted module's weight replaced by ``W + scale
    B A`` (computed in fp32, written in W's dtype: what PEFT's ``merge_and_unload`` gives); ``stored_name``: the
    stored name of a text-model weight name."""
    out = dict(tensors)
    for path, (a, b) in weights.items():
        name = stored_name(path + ".weight")
        if name not in out:
            raise KeyError(f"the base model has no tensor '{name}' for the adapter of '{path}'")
        w = out[name]
        delta = scale * (b.float() @ a.float())
        if delta.shape != w.shape:
            raise ValueError(f"'{name}' is {list(w.shape)} but its adapter gives {list(delta.shape)}")
        out[name] = (w.float() + delta).to(w.dtype)
    return out


def lora_scale(rank: int, alpha: float, rslora: bool) -> float:
    """PEFT's scaling of the branch: ``alpha / r``, or ``alpha / sqrt(r)`` with ``use_rslora``."""
    return alpha / (math.sqrt(rank) if rslora else rank)


# ---------------------------------------------------------------------------------------------------------
# The base a LoRA run refers to


def base_fingerprint(directory: str | Path) -> str:
    """A fingerprint of a Hugging Face directory's weights and config: per safetensors file its name, size, header
    (every tensor's name, dtype, shape, offsets) and the first and last MiB of its data, with config.json. A LoRA
    checkpoint keeps it: resuming or exporting on a base that changed is refused. Reads a few MiB, not the model."""
    from .checkpoint import safetensors_files

    directory = Path(directory)
    digest = hashlib.sha256()
    digest.update((directory / "config.json").read_bytes())
    chunk = 2**20
    for file in safetensors_files(directory):
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with open(file, "rb") as f:
            header = int.from_bytes(f.read(8), "little")
            digest.update(f.read(header))
            digest.update(f.read(chunk))
            f.seek(max(8 + header, size - chunk))
            digest.update(f.read(chunk))
    return digest.hexdigest()
