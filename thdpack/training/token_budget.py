"""``dataset.micro_batch_tokens: fit``: the largest packed token budget whose peak memory fits the GPU.

A training step's peak memory grows linearly with the tokens of a micro-batch: ``peak(T) = fixed + per_token * T``
(``fixed``: weights, gradient buffer, optimizer state, workspaces; ``per_token``: the activations kept for the
backward, and with ``model.output_loss=megatron`` the logits). ``benchmarks/token_budget.py`` measures both on one
GPU (peak memory at several budgets, least squares) for a model recipe, an output loss and an optimizer-state
setting, and prints the :data:`MEASURED` entry to add here. ``fit`` then picks::

    T = floor((headroom * device_memory - fixed) / per_token), rounded down to a multiple of 1024

Entries are measured on one GPU without model or data parallelism; more ranks hold less per GPU (sharded optimizer
state, activations split by TP/CP), so the same budget is then conservative.
"""

from __future__ import annotations

from collections.abc import Mapping

from .config_error import ConfigError

__all__ = ["HEADROOM", "MEASURED", "MemoryModel", "fit_micro_batch_tokens", "largest_budget", "setting_key"]

# Of the device's memory, for torch's peak: the CUDA context, cuBLAS/cuDNN/TE workspaces, NCCL and the allocator's
# fragmentation take the rest. On an 80 GB H100 (llama3_1b, chunked loss) a modelled peak of 0.84 of the card
# (36,864 tokens) trained at 66.8 GiB; 0.87 (38,912 tokens) and 0.92 (41,984) ran out of memory.
HEADROOM = 0.85
MULTIPLE = 1024


class MemoryModel(tuple):
    """``(fixed_bytes, per_token_bytes, measured_on)``."""

    __slots__ = ()

    def __new__(cls, fixed_bytes: float, per_token_bytes: float, measured_on: str):
        return super().__new__(cls, (float(fixed_bytes), float(per_token_bytes), measured_on))

    fixed_bytes = property(lambda self: self[0])
    per_token_bytes = property(lambda self: self[1])
    measured_on = property(lambda self: self[2])


# (model.name, resolved model.output_loss, setting_key(trainer)) -> MemoryModel, from benchmarks/token_budget.py
MEASURED: dict[tuple[str, str, str], MemoryModel] = {
    # 8,192 / 16,384 / 32,768 tokens: 34.1 / 43.4 / 62.2 GiB; 49,152 out of memory (token_budget_h100_2026-11-25.md);
    # 36,864: 66.8 GiB; 38,912 and 41,984 out of memory (speed_h100_2026-11-26.md)
    ("llama3_1b", "chunked", "default"): MemoryModel(26513438976, 1227248, "NVIDIA H100 80GB HBM3"),
}


def setting_key(trainer: Mapping) -> str:
    """The optimizer-state setting of a recipe as a table key: ``default`` or ``aware:<params>/<grads>/<m>/<v>``."""
    if not trainer.get("use_precision_aware_optimizer", False):
        return "default"
    dtypes = (
        trainer.get(k, "fp32")
        for k in ("main_params_dtype", "main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
    )
    return "aware:" + "/".join(dtypes)


def largest_budget(model: MemoryModel, device_bytes: int, headroom: float = HEADROOM) -> int:
    """The largest multiple of 1024 tokens whose modelled peak stays within ``headroom * device_bytes`` (0 if none)."""
    free = headroom * device_bytes - model.fixed_bytes
    if free <= 0 or model.per_token_bytes <= 0:
        return 0
    return int(free // model.per_token_bytes) // MULTIPLE * MULTIPLE


def fit_micro_batch_tokens(cfg: Mapping, output_loss: str, device_bytes: int | None) -> int:
    """``dataset.micro_batch_tokens: fit`` made concrete for the device of ``device_bytes`` memory (None: no GPU)."""
    if device_bytes is None:
        raise ConfigError(
            "dataset.micro_batch_tokens=fit sizes the budget to a GPU's memory: give a number on CPU"
        )
    if not cfg["dataset"].get("pack_sequences_in_batch", True):
        raise ConfigError(
            "dataset.micro_batch_tokens=fit needs dataset.pack_sequences_in_batch=true: the padded baseline batches "
            "micro_batch_size samples (set micro_batch_tokens=null)"
        )
    key = (cfg["model"].get("name"), output_loss, setting_key(cfg["trainer"]))
    model = MEASURED.get(key)
    if model is None:
        known = ", ".join(f"{k}" for k in MEASURED) or "none yet"
        raise ConfigError(
            f"dataset.micro_batch_tokens=fit has no measured memory model for (model.name, model.output_loss, "
            f"optimizer state) = {key} (measured: {known}): run benchmarks/token_budget.py for this recipe and add "
            "its entry to thdpack.training.token_budget.MEASURED, or give dataset.micro_batch_tokens a number"
        )
    budget = largest_budget(model, device_bytes)
    seq_length = int(cfg["dataset"]["seq_length"])
    if budget < seq_length:
        raise ConfigError(
            f"dataset.micro_batch_tokens=fit: the memory model of {key} (measured on {model.measured_on}) leaves "
            f"{budget} tokens on this {device_bytes / 2**30:.0f} GiB device, below dataset.seq_length={seq_length}: "
            "lower seq_length, or save memory (model.output_loss=chunked, trainer.use_precision_aware_optimizer)"
        )
    return budget
