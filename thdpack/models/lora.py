"""LoRA fine-tuning of a Hugging Face checkpoint's family (``peft=lora``): the recipe's ``peft`` group made
concrete, the adapters put on the built model, and a run's adapters out again as PEFT's adapter or merged.

    peft = resolve_peft(cfg.peft, cfg.model)            # the recipe: nulls from the adapter or the defaults
    module = apply_peft(module, peft, cfg.model, config, seed)   # after family.build (weights loaded), before wrap_model
    export_adapter(iteration_dir, out)                  # python -m thdpack.export CKPT OUT --adapter
    export_merged(iteration_dir, out)                   # python -m thdpack.export CKPT OUT

The adapted modules come from the family's mapping (:func:`thdpack.hf.adapter.lora_layers`); the branch is
:mod:`thdpack.megatron.lora`. A vision-language family adapts its language model; its vision tower stays frozen.

A LoRA run's checkpoint holds what training changes (the adapters, their optimizer state, buffers) and the
fingerprint of the base it refers to (:func:`thdpack.hf.adapter.base_fingerprint`), not the frozen base: an 8B
model's checkpoint is its adapters' megabytes, not 16 GB a save. Resuming rebuilds the base from
``model.pretrained`` as at the start (the same bits) and loads the adapters: exact, and refused when the base
directory changed; the merged export reads the base there too.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from thdpack.hf.adapter import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    ALL_LINEAR,
    LoRALayer,
    base_fingerprint,
    check_coverage,
    lora_layers,
    lora_scale,
    merge_adapters,
    not_adapted,
    read_adapter,
    read_config,
    target_names,
    write_adapter,
)
from thdpack.hf.checkpoint import HFCheckpoint
from thdpack.hf.vl_checkpoint import has_vision

__all__ = [
    "DEFAULTS",
    "apply_peft",
    "check_resume",
    "export_adapter",
    "export_merged",
    "lora_enabled",
    "peft_record",
    "resolve_peft",
]

log = logging.getLogger("thdpack")

# peft=lora's defaults, for the keys the recipe leaves null and no adapter gives.
DEFAULTS = {"rank": 16, "alpha": 32.0, "dropout": 0.0, "target_modules": ALL_LINEAR, "use_rslora": False}
# recipe key -> adapter_config.json key
ADAPTER_KEYS = {
    "rank": "r",
    "alpha": "lora_alpha",
    "dropout": "lora_dropout",
    "target_modules": "target_modules",
    "use_rslora": "use_rslora",
}


def lora_enabled(peft: Mapping | None) -> bool:
    return bool(peft) and peft.get("name", "none") == "lora"


def _family(model: Mapping):
    from .registry import family_of

    return family_of(HFCheckpoint.open(model["pretrained"]))


def _layers(model: Mapping) -> tuple[tuple[LoRALayer, ...], bool]:
    checkpoint = HFCheckpoint.open(model["pretrained"])
    return lora_layers(_family(model).mapping), has_vision(checkpoint.config)


def resolve_peft(peft: Mapping | None, model: Mapping) -> dict[str, Any]:
    """The recipe's ``peft`` group made concrete for the resolved ``model`` group: ``{"name": "none"}``, or for
    ``lora`` every key set (a null takes the ``from_adapter`` directory's value, else :data:`DEFAULTS`), checked.
    Raises ``ValueError`` naming the key (and the adapter's file) for a value LoRA cannot take."""
    if not lora_enabled(peft):
        name = (peft or {}).get("name", "none")
        if name != "none":
            raise ValueError(f"peft.name is {name!r}: peft=none or peft=lora")
        return {"name": "none"}
    if not model.get("pretrained"):
        raise ValueError(
            "peft=lora adapts a pretrained model: set model=hf model.pretrained=DIR (a Hugging Face directory)"
        )
    layers, _ = _layers(model)
    if not layers:
        raise ValueError(f"peft=lora: the '{model.get('family')}' family declares no layer LoRA can adapt")
    out = {key: peft.get(key) for key in DEFAULTS}
    source = peft.get("from_adapter")
    if source:
        config = read_config(source)
        names = _adapter_module_names(Path(source))
        given = {
            "rank": config["r"],
            "alpha": float(config["lora_alpha"]),
            "dropout": float(config.get("lora_dropout") or 0.0),
            "target_modules": names,
            "use_rslora": bool(config.get("use_rslora", False)),
        }
        for key, value in given.items():
            mine = out[key]
            if mine is not None and key not in ("dropout",) and not _same(key, mine, value, layers):
                raise ValueError(
                    f"peft.{key}={mine!r} but {Path(source) / ADAPTER_CONFIG} says {ADAPTER_KEYS[key]}={value!r}: "
                    f"the adapter fixes it (leave peft.{key} null)"
                )
            if mine is None:
                out[key] = value
    for key, value in DEFAULTS.items():
        if out[key] is None:
            out[key] = value
    rank, alpha, dropout = out["rank"], out["alpha"], out["dropout"]
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise ValueError(f"peft.rank is {rank!r}: a positive integer expected (LoRA's r)")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise ValueError(f"peft.alpha is {alpha!r}: a positive number expected (LoRA's lora_alpha)")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ValueError(f"peft.dropout is {dropout!r}: a number in [0, 1) expected")
    if not isinstance(out["use_rslora"], bool):
        raise ValueError(f"peft.use_rslora is {out['use_rslora']!r}: true or false expected")
    targets = out["target_modules"]
    if not isinstance(targets, str):
        targets = list(targets)
    out["target_modules"] = list(target_names(layers, targets))
    left = not_adapted(_family(model).mapping)
    if left and targets in (ALL_LINEAR, [ALL_LINEAR]):
        log.warning(
            "peft.target_modules=all-linear adapts %s of this model; %s keep their weights (LoRA on their fused "
            "layouts is not implemented)",
            out["target_modules"],
            left,
        )
    if model.get("te_op_fuser") is True and {"gate_proj", "up_proj", "down_proj"} & set(
        out["target_modules"]
    ):
        raise ValueError(
            "peft=lora on the MLP (peft.target_modules) with model.te_op_fuser=true: Transformer Engine's fused MLP "
            "never calls the linear layers the adapters hang on; set model.te_op_fuser=false"
        )
    if not model.get("freeze_vision", True):
        raise ValueError(
            "peft=lora with model.freeze_vision=false: LoRA trains the language model's adapters only and keeps the "
            "vision tower frozen; leave model.freeze_vision=true"
        )
    return {
        "name": "lora",
        "rank": int(rank),
        "alpha": float(alpha),
        "dropout": float(dropout),
        "use_rslora": out["use_rslora"],
        "target_modules": out["target_modules"],
        "from_adapter": str(source) if source else None,
    }


def _same(key: str, mine, theirs, layers) -> bool:
    if key == "target_modules":
        return set(target_names(layers, mine if isinstance(mine, str) else list(mine))) == set(theirs)
    if key == "alpha":
        return float(mine) == float(theirs)
    return mine == theirs


def _adapter_module_names(directory: Path) -> list[str]:
    """The short names of the modules an adapter's safetensors adapt (keys only; no tensor read)."""
    from safetensors import safe_open

    path = directory / ADAPTER_WEIGHTS
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing (peft.from_adapter needs the adapter's safetensors)")
    with safe_open(str(path), framework="pt") as f:
        keys = list(f.keys())
    pattern = re.compile(r".+\.(?P<name>[^.]+)\.lora_[AB]\.weight\Z")
    return sorted({m["name"] for m in map(pattern.match, keys) if m})


# ---------------------------------------------------------------------------------------------------------
# The model


def _language_model(chunk):
    from thdpack.megatron.unwrap import unwrap_model

    chunk = unwrap_model(chunk)
    return getattr(chunk, "language_model", chunk)


def lora_targets(gpt, layers: tuple[LoRALayer, ...], names) -> list:
    """The :class:`~thdpack.megatron.lora.LoRATarget` of this rank's ``GPTModel`` chunk ``gpt``: each of its
    layers' adaptable layers holding a module of ``names``; keys: the global Hugging Face module paths."""
    from thdpack.megatron.lora import LoRATarget

    offset = gpt.decoder.layers[0].layer_number - 1 if len(gpt.decoder.layers) else 0
    targets = []
    for i in range(len(gpt.decoder.layers)):
        for layer in layers:
            module = layer.megatron.format(layer=i)
            parts = tuple(n if n in names else None for n in layer.names)
            if not any(parts):
                continue
            try:
                gpt.get_submodule(module)
            except AttributeError:  # a layer without this module (a MoE layer's MLP)
                continue
            keys = tuple(
                m.format(layer=offset + i) if p else None for m, p in zip(layer.modules, parts, strict=True)
            )
            targets.append(LoRATarget(module, layer.layout, parts, keys))
    return targets


def apply_peft(module, peft: Mapping, model: Mapping, config, seed: int = 0):
    """Put LoRA adapters on ``module`` (this rank's model from ``family.build``, or a list of chunks): the modules
    ``peft["target_modules"]`` of every layer, initialised as PEFT does, or loaded from ``peft["from_adapter"]``;
    then freeze everything else. Returns ``module``."""
    from thdpack.megatron.lora import LoRASettings, add_lora, freeze_base

    layers, vision_language = _layers(model)
    names = set(peft["target_modules"])
    settings = LoRASettings(
        rank=int(peft["rank"]),
        alpha=float(peft["alpha"]),
        dropout=float(peft["dropout"]),
        rslora=bool(peft["use_rslora"]),
        seed=int(seed),
    )
    adapter = None
    if peft.get("from_adapter"):
        from thdpack.hf.mapping import layer_types

        adapter = read_adapter(peft["from_adapter"], vision_language)
        check_coverage(adapter, layers, config.num_layers, layer_types(config))
    chunks = module if isinstance(module, (list, tuple)) else [module]
    trainable = 0
    for chunk in chunks:
        gpt = _language_model(chunk)
        targets = lora_targets(gpt, layers, names)
        adapters = add_lora(gpt, targets, settings, config)
        if adapter is not None:
            for target, branch in zip(targets, adapters, strict=True):
                for part, key in zip(target.parts, target.keys, strict=True):
                    if part is not None:
                        a, b = adapter.weights[key]
                        dtype = branch.lora_A[part].dtype
                        branch.load_whole(part, a.to(dtype), b.to(dtype))
        trainable += freeze_base(chunk)
    log.info(
        "LoRA: rank %d, alpha %g%s on %s; %d trainable parameters on this rank%s",
        settings.rank,
        settings.alpha,
        " (rsLoRA)" if settings.rslora else "",
        ", ".join(peft["target_modules"]),
        trainable,
        f", from {peft['from_adapter']}" if adapter is not None else "",
    )
    return module


# ---------------------------------------------------------------------------------------------------------
# Checkpoints


def peft_record(peft: Mapping, model: Mapping) -> dict[str, Any]:
    """What a LoRA run's checkpoint records of its adapters and its base (checked on resume and export)."""
    return {
        "rank": int(peft["rank"]),
        "alpha": float(peft["alpha"]),
        "use_rslora": bool(peft["use_rslora"]),
        "target_modules": list(peft["target_modules"]),
        "pretrained": str(model["pretrained"]),
        "base_fingerprint": base_fingerprint(model["pretrained"]),
    }


def check_resume(saved: Mapping | None, record: Mapping | None, where: str) -> None:
    """Refuse to resume from a checkpoint (thdpack metadata ``saved``) whose adapters or base differ from this
    run's (``record``: :func:`peft_record`, None without LoRA), naming what differs."""
    if saved is None:
        return
    theirs = saved.get("peft")
    if (theirs is None) != (record is None):
        saved_kind, mine = (
            ("a LoRA run", "without peft=lora") if theirs else ("a full fine-tune", "with peft=lora")
        )
        raise ValueError(
            f"{where} was saved by {saved_kind}; this run is {mine}: use a new checkpoint.dir (or the run's own "
            "peft settings)"
        )
    if record is None:
        return
    for key in ("rank", "alpha", "use_rslora", "target_modules"):
        if theirs.get(key) != record[key]:
            raise ValueError(
                f"{where} holds adapters with {key}={theirs.get(key)!r}; this run has peft.{key}={record[key]!r}"
            )
    if theirs.get("base_fingerprint") != record["base_fingerprint"]:
        raise ValueError(
            f"{where}'s adapters were trained on the base model {theirs.get('pretrained')}, but "
            f"model.pretrained={record['pretrained']} is not that model (its weights or config.json differ): the "
            "adapters only mean something on their own base"
        )


# ---------------------------------------------------------------------------------------------------------
# Export

_ADAPTER_TENSOR = re.compile(
    r"(?:language_model\.)?(?P<module>.+)_lora\.lora_(?P<which>[AB])\.(?P<part>[^.]+)\Z"
)


def saved_peft(iteration_dir: str | Path) -> dict | None:
    """The LoRA record (:func:`peft_record`) of a checkpoint, None for a run without LoRA."""
    from thdpack.megatron.checkpoint_reader import read_common  # tensors and plain data only

    return (read_common(iteration_dir).get("thdpack") or {}).get("peft")


def checkpoint_adapters(iteration_dir: Path, kept: HFCheckpoint) -> dict[str, tuple]:
    """``{text-model module path: (A, B)}`` of a LoRA checkpoint: its adapter tensors, whole, by the family's
    mapping. A checkpoint tensor that is no adapter of a known module stops it, naming the tensor."""
    from thdpack.hf.dist_checkpoint import checkpoint_tensors

    from .registry import family_of

    layers = lora_layers(family_of(kept).mapping)
    patterns = [
        (re.compile(re.escape(layer.megatron).replace(r"\{layer\}", r"(?P<layer>\d+)") + r"\Z"), layer)
        for layer in layers
    ]
    found: dict[str, dict[str, Any]] = {}
    for name, tensor in checkpoint_tensors(iteration_dir).items():
        m = _ADAPTER_TENSOR.match(name)
        hit = None
        if m:
            hit = next(((p.match(m["module"]), layer) for p, layer in patterns if p.match(m["module"])), None)
        if hit is None or m["part"] not in hit[1].names:
            raise ValueError(
                f"{iteration_dir}: the checkpoint's tensor '{name}' is no LoRA adapter of the family's layers: not "
                "a LoRA run's checkpoint, or of another model"
            )
        match, layer = hit
        path = layer.modules[layer.names.index(m["part"])].format(layer=int(match["layer"]))
        found.setdefault(path, {})[m["which"]] = tensor
    return {path: (ab["A"], ab["B"]) for path, ab in sorted(found.items())}


def _lora_checkpoint(iteration_dir: Path, kept: HFCheckpoint) -> dict:
    record = saved_peft(iteration_dir)
    if record is None:
        raise ValueError(
            f"{iteration_dir} is a full fine-tune's checkpoint, not a LoRA run's: export it without --adapter"
        )
    return record


def export_adapter(iteration_dir: str | Path, hf_dir: str | Path, out_dir: str | Path) -> Path:
    """A LoRA run's checkpoint as a PEFT adapter directory (``adapter_config.json``, ``adapter_model.safetensors``)
    that ``peft.PeftModel.from_pretrained(base, out_dir)`` loads onto the run's base model."""
    kept = HFCheckpoint.open(hf_dir)
    iteration_dir = Path(iteration_dir)
    record = _lora_checkpoint(iteration_dir, kept)
    weights = checkpoint_adapters(iteration_dir, kept)
    return write_adapter(
        out_dir,
        weights,
        rank=record["rank"],
        alpha=record["alpha"],
        dropout=0.0,
        rslora=record["use_rslora"],
        names=record["target_modules"],
        vision_language=has_vision(kept.config),
        base=record.get("pretrained"),
    )


def export_merged(
    iteration_dir: str | Path,
    hf_dir: str | Path,
    out_dir: str | Path,
    base: str | Path | None = None,
    max_shard_bytes: int | None = None,
) -> Path:
    """A LoRA run's checkpoint merged into its base: the base directory's tensors (``base``, default the run's
    ``model.pretrained``; its fingerprint must be the run's) with every adapted weight ``W + scale B A``, written as a
    Hugging Face directory (the base's names, dtype, config and tokenizer files)."""
    from safetensors.torch import load_file

    from thdpack.hf.checkpoint import safetensors_files
    from thdpack.hf.directory import DEFAULT_SHARD_BYTES, write_hf_directory

    kept = HFCheckpoint.open(hf_dir)
    iteration_dir = Path(iteration_dir)
    record = _lora_checkpoint(iteration_dir, kept)
    source = Path(base or record["pretrained"])
    if not (source / "config.json").is_file():
        raise FileNotFoundError(
            f"{source}: the base model of the LoRA run is not there (a LoRA checkpoint holds the adapters only): pass "
            "its directory with --base DIR, or export the adapter alone with --adapter"
        )
    if base_fingerprint(source) != record["base_fingerprint"]:
        raise ValueError(
            f"{source} is not the base the adapters of {iteration_dir} were trained on (its weights or config.json "
            "differ from the run's model.pretrained)"
        )
    tensors = {}
    for file in safetensors_files(source):
        tensors.update(load_file(str(file)))
    nested = any(n.startswith("model.language_model.") for n in tensors)

    def stored_name(name: str) -> str:
        return "model.language_model." + name.removeprefix("model.") if nested else name

    weights = checkpoint_adapters(iteration_dir, kept)
    scale = lora_scale(record["rank"], record["alpha"], record["use_rslora"])
    merged = merge_adapters(tensors, weights, scale, stored_name)
    return write_hf_directory(out_dir, merged, kept.config, hf_dir, max_shard_bytes or DEFAULT_SHARD_BYTES)
