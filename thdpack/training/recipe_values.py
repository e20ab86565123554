"""The values of a recipe that megatron-core, torch or thdpack's loader would reject, refused at start-up by key.

Each rule is the one the library underneath asserts (megatron-core 0.16.1's ``OptimizerParamScheduler.__init__``
and ``get_lr``, torch's ``Adam``/``AdamW`` argument checks, thdpack's ``TrainData``), stated here with the recipe
key to change: without it a user meets a bare ``AssertionError`` from the scheduler (``max_lr >= min_lr``), torch's
``Invalid learning rate``, or a loader error after the process groups and the model exist.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import cache
from pathlib import Path

from .config_error import ConfigError
from .recipe_keys import TRANSFORMER_CONFIG, boolean_keys

__all__ = ["LR_DECAY_STYLES", "check_types", "check_values"]

# OptimizerParamScheduler.get_lr: WSD also needs wsd_decay_steps and lr_wsd_decay_style, which thdpack does not
# pass (the scheduler asserts wsd_decay_steps is not None).
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")
PACKING_MODES = ("auto", "distinct", "fold")
OVERLONG = ("truncate", "drop", "error")
PAD_TO = ("seq_length", "longest")
PARALLEL_SIZES = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
)


def check_values(cfg: Mapping, *, world_size: int, recipes: Path) -> None:
    """Raise :class:`ConfigError` for the first value of ``cfg`` (a composed recipe) that cannot run."""
    parallel, trainer, dataset = cfg["parallel"], cfg["trainer"], cfg["dataset"]
    for key in PARALLEL_SIZES:
        _integer(f"parallel.{key}", parallel[key], low=1)
    _trainer(trainer, recipes)
    tp, pp, cp = (int(parallel[k]) for k in PARALLEL_SIZES[:3])
    _dataset(dataset, dp=world_size // (tp * pp * cp) if world_size % (tp * pp * cp) == 0 else None)
    save_interval = (cfg.get("checkpoint") or {}).get("save_interval")
    if save_interval is not None:
        _integer("checkpoint.save_interval", save_interval, low=1, null="never save between the end points")
    allow = (cfg.get("checkpoint") or {}).get("allow_dataset_change", False)
    if not isinstance(allow, bool):
        raise ConfigError(f"checkpoint.allow_dataset_change is {allow!r}: it must be true or false")


def check_types(cfg: Mapping, recipes: Path) -> None:
    """Raise :class:`ConfigError` for a value of the wrong type: a key the recipe files set to true or false takes
    only true or false (``bool("false")`` is True: a quoted or misspelt value would flip it), and ``model.config``'s
    boolean, integer and float fields take what ``TransformerConfig`` declares (null: the default)."""
    for path in sorted(boolean_keys(recipes)):
        value = _lookup(cfg, path)
        if value is not _ABSENT and not isinstance(value, bool):
            quoted = isinstance(value, str) and value.lower() in ("true", "false")
            raise ConfigError(
                f"{'.'.join(path)} is {value!r}: it must be true or false" + (" (unquoted)" if quoted else "")
            )
    config = _lookup(cfg, TRANSFORMER_CONFIG)
    if not isinstance(config, Mapping):
        return
    kinds = _transformer_config_kinds()
    for name, value in config.items():
        kind = kinds.get(str(name))
        if value is None or kind is None:
            continue
        ok = {
            "bool": isinstance(value, bool),
            "int": isinstance(value, int) and not isinstance(value, bool),
            "float": isinstance(value, int | float) and not isinstance(value, bool),
        }[kind]
        if not ok:
            rule = {"bool": "true or false", "int": "an integer", "float": "a number"}[kind]
            raise ConfigError(
                f"model.config.{name} is {value!r}: it must be {rule} (megatron.core TransformerConfig's {kind})"
            )


_ABSENT = object()


def _lookup(cfg: Mapping, path: tuple[str, ...]):
    for part in path:
        if not isinstance(cfg, Mapping) or part not in cfg:
            return _ABSENT
        cfg = cfg[part]
    return cfg


@cache
def _transformer_config_kinds() -> dict[str, str]:
    """``TransformerConfig``'s fields declared ``bool``, ``int`` or ``float`` (or Optional of one), by name."""
    import types
    import typing

    from megatron.core.transformer.transformer_config import TransformerConfig

    kinds = {}
    for name, hint in typing.get_type_hints(TransformerConfig).items():
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
            hint = args[0]
        if hint in (bool, int, float):
            kinds[name] = hint.__name__
    return kinds


def _trainer(trainer: Mapping, recipes: Path) -> None:
    iters = _integer("trainer.train_iters", trainer["train_iters"], low=1)
    lr = _number("trainer.lr", trainer["lr"])
    if lr <= 0:
        raise ConfigError(
            f"trainer.lr is {lr}: the peak learning rate must be > 0 (torch's Adam refuses a negative one; 0 trains "
            "nothing)"
        )
    min_lr = _number("trainer.min_lr", trainer["min_lr"])
    if min_lr < 0:
        raise ConfigError(f"trainer.min_lr is {min_lr}: it must be >= 0 (the rate the schedule decays to)")
    if min_lr > lr:
        finetune = (recipes / "trainer" / "finetune.yaml").is_file()
        raise ConfigError(
            f"trainer.min_lr ({min_lr}) is above trainer.lr ({lr}): the schedule decays from trainer.lr down to "
            f"trainer.min_lr, so min_lr <= lr (megatron-core's OptimizerParamScheduler asserts max_lr >= min_lr). "
            f"Set trainer.min_lr={lr / 10:g} or lower"
            + (", or use trainer=finetune (a fine-tuning schedule)" if finetune else "")
        )
    warmup = _integer("trainer.lr_warmup_iters", trainer["lr_warmup_iters"], low=0)
    decay = trainer.get("lr_decay_iters")
    decay = iters if decay is None else _integer("trainer.lr_decay_iters", decay, low=1, null="train_iters")
    if warmup >= decay:
        raise ConfigError(
            f"trainer.lr_warmup_iters ({warmup}) must be below the decay iterations ({decay}: "
            "trainer.lr_decay_iters, or train_iters when null)"
        )
    if warmup > iters:
        raise ConfigError(
            f"trainer.lr_warmup_iters ({warmup}) is beyond the run (trainer.train_iters={iters}): the learning rate "
            "would never reach trainer.lr; lower the warmup or raise train_iters"
        )
    style = trainer["lr_decay_style"]
    if style not in LR_DECAY_STYLES:
        raise ConfigError(
            f"trainer.lr_decay_style is '{style}': it must be one of {', '.join(LR_DECAY_STYLES)} (megatron-core's "
            "OptimizerParamScheduler; WSD needs settings thdpack does not pass)"
        )
    weight_decay = _number("trainer.weight_decay", trainer["weight_decay"])
    if weight_decay < 0:
        raise ConfigError(
            f"trainer.weight_decay is {weight_decay}: it must be >= 0 (torch's Adam refuses it)"
        )
    for key in ("adam_beta1", "adam_beta2"):
        beta = _number(f"trainer.{key}", trainer[key])
        if not 0 <= beta < 1:
            raise ConfigError(
                f"trainer.{key} is {beta}: Adam's betas are in [0, 1) (torch refuses others; 1 never forgets)"
            )
    clip = _number("trainer.clip_grad", trainer["clip_grad"])
    if clip < 0:
        raise ConfigError(
            f"trainer.clip_grad is {clip}: the gradient-norm bound must be >= 0 (0 turns clipping off)"
        )
    seed = _integer("trainer.seed", trainer["seed"], low=0)
    if seed >= 2**32:
        raise ConfigError(f"trainer.seed is {seed}: numpy's generators take seeds below 2**32")
    _integer("trainer.log_interval", trainer["log_interval"], low=1)
    for key, null in (
        ("exit_interval", "run to train_iters"),
        ("eval_interval", "never evaluate"),
        ("profile_step", "never profile"),
    ):
        value = trainer.get(key)
        if value is not None:
            _integer(f"trainer.{key}", value, low=1, null=null)
    profile_step = trainer.get("profile_step")
    if profile_step is not None and int(profile_step) > iters:
        raise ConfigError(
            f"trainer.profile_step ({profile_step}) is beyond the run (trainer.train_iters={iters}): nothing would "
            "be profiled"
        )
    if trainer.get("eval_interval") is not None:
        _integer("trainer.eval_iters", trainer["eval_iters"], low=1)
        _integer("trainer.eval_samples", trainer["eval_samples"], low=1)
    if trainer.get("progress_bar", "auto") not in ("auto", True, False):
        raise ConfigError(
            f"trainer.progress_bar is '{trainer['progress_bar']}': it must be auto, true or false"
        )
    for key in ("overlap_grad_reduce", "overlap_param_gather"):
        if trainer.get(key, False) not in (True, False):
            raise ConfigError(f"trainer.{key} is {trainer.get(key)!r}: it must be true or false")
    if trainer.get("ddp_bucket_size") is not None:
        _integer("trainer.ddp_bucket_size", trainer["ddp_bucket_size"], low=1, null="megatron-core's default")
    if trainer.get("on_nonfinite", "error") not in ("error", "skip"):
        raise ConfigError(
            f"trainer.on_nonfinite is '{trainer.get('on_nonfinite')}': it must be error or skip"
        )
    _integer("trainer.max_consecutive_skips", trainer.get("max_consecutive_skips", 10), low=1)


def _dataset(dataset: Mapping, dp: int | None) -> None:
    _integer("dataset.seq_length", dataset["seq_length"], low=1)
    mbs = _integer("dataset.micro_batch_size", dataset["micro_batch_size"], low=1)
    gbs = _integer("dataset.global_batch_size", dataset["global_batch_size"], low=1)
    for key, allowed in (
        ("mode", PACKING_MODES),
        ("overlong", OVERLONG),
        ("pad_to", PAD_TO),
        ("bad_lines", ("error", "skip")),
    ):
        value = dataset.get(key, allowed[0])
        if value not in allowed:
            raise ConfigError(f"dataset.{key} is '{value}': it must be one of {', '.join(allowed)}")
    budget = dataset.get("micro_batch_tokens", "auto")
    if budget not in (None, "auto"):
        budget = _integer(
            "dataset.micro_batch_tokens", budget, low=1, null="micro_batch_size samples a micro-batch"
        )
    bucket = dataset.get("pad_total_to")
    if bucket is not None:
        _integer("dataset.pad_total_to", bucket, low=1, null="no fixed bucket")
    max_files = dataset.get("max_files")
    if max_files is not None:
        _integer("dataset.max_files", max_files, low=1, null="every file")
    if dp is None:
        return  # the world size does not divide into the layout: check_recipe says so
    samples_per_microbatch = not dataset["pack_sequences_in_batch"] or budget is None
    if samples_per_microbatch and gbs % (mbs * dp):
        raise ConfigError(
            f"dataset.global_batch_size ({gbs}) is not divisible by dataset.micro_batch_size ({mbs}) x "
            f"{dp} data-parallel rank(s): every rank needs a whole number of micro-batches"
        )
    if gbs < dp:
        raise ConfigError(
            f"dataset.global_batch_size ({gbs}) is below the {dp} data-parallel ranks: every rank needs a sample"
        )


def _number(key: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{key} is {value!r}: it must be a finite number")
    return float(value)


def _integer(key: str, value, *, low: int, null: str | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(
            f"{key} is {value!r}: it must be an integer >= {low}" + (f" (or null: {null})" if null else "")
        )
    if value < low:
        raise ConfigError(f"{key} is {value}: it must be >= {low}" + (f" (or null: {null})" if null else ""))
    return value
