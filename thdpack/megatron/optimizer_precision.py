"""Optimizer state in lower precision: megatron-core's precision-aware optimizer as recipe settings.

By default the distributed optimizer keeps, per parameter, fp32 main weights (4 bytes), fp32 Adam moments (4 + 4)
and an fp32 gradient buffer (4), next to the bf16 weights (2): 18 bytes. megatron-core's precision-aware
optimizer (``OptimizerConfig.use_precision_aware_optimizer``) hands the main weights and the moments to Transformer
Engine's ``FusedAdam`` in the dtypes asked for; the gradient buffer follows ``main_grads_dtype``.

Recipe keys (``trainer``), megatron-core's names:

* ``use_precision_aware_optimizer``: false (default) | true; needs CUDA, Transformer Engine and bf16 training;
* ``main_params_dtype``: fp32 | fp16 (TE's FusedAdam keeps master weights in these two only; with fp32 and bf16
  weights it stores only the 16 low bits that bf16 drops: ``store_param_remainders``);
* ``main_grads_dtype``: fp32 | bf16 (the DDP gradient buffer; bf16 reduces gradients in bf16);
* ``exp_avg_dtype``, ``exp_avg_sq_dtype``: fp32 | fp16 | bf16 | fp8 (fp8 = TE's E4M3 with a per-tensor scale).

megatron-core asserts that every dtype stays fp32 without the precision-aware optimizer, and the precision-aware
optimizer needs TE's ``FusedAdam``: :func:`check_optimizer_precision` says so at start-up, naming the key.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping

import torch

__all__ = ["DTYPE_KEYS", "check_optimizer_precision", "ddp_grad_reduce_in_fp32", "optimizer_precision_kwargs"]

DTYPE_KEYS = {
    "main_params_dtype": ("fp32", "fp16"),
    "main_grads_dtype": ("fp32", "bf16"),
    "exp_avg_dtype": ("fp32", "fp16", "bf16", "fp8"),
    "exp_avg_sq_dtype": ("fp32", "fp16", "bf16", "fp8"),
}
_TORCH = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.uint8}


def check_optimizer_precision(trainer: Mapping, device: str, precision: str) -> None:
    """Refuse, naming the key, a combination megatron-core or Transformer Engine would reject (or assert on)."""
    aware = trainer.get("use_precision_aware_optimizer", False)
    if aware not in (True, False):
        raise ValueError(f"trainer.use_precision_aware_optimizer is {aware!r}: it must be true or false")
    for key, allowed in DTYPE_KEYS.items():
        value = trainer.get(key, "fp32")
        if value not in allowed:
            raise ValueError(f"trainer.{key} is {value!r}: it must be one of {list(allowed)}")
        if value != "fp32" and not aware:
            raise ValueError(
                f"trainer.{key}={value} needs trainer.use_precision_aware_optimizer=true (megatron-core keeps every "
                "optimizer dtype fp32 without it)"
            )
    if not aware:
        return
    if device != "cuda":
        raise ValueError(
            "trainer.use_precision_aware_optimizer=true needs a CUDA GPU: it runs Transformer Engine's FusedAdam "
            "(set it to false on CPU)"
        )
    if precision not in ("bf16", "fp8"):
        raise ValueError(
            f"trainer.use_precision_aware_optimizer=true with trainer.precision={precision}: it keeps lower-precision "
            "copies of bf16 weights; train in bf16 (or fp8)"
        )
    if importlib.util.find_spec("transformer_engine") is None:
        raise ValueError(
            "trainer.use_precision_aware_optimizer=true needs Transformer Engine's FusedAdam: pip install "
            "'thdpack[gpu]', or set it to false"
        )


def optimizer_precision_kwargs(trainer: Mapping) -> dict:
    """The ``OptimizerConfig`` fields of the recipe's precision settings (empty when the optimizer is the default)."""
    if not trainer.get("use_precision_aware_optimizer", False):
        return {}
    return {"use_precision_aware_optimizer": True} | {
        key: _TORCH[trainer.get(key, "fp32")] for key in DTYPE_KEYS
    }


def ddp_grad_reduce_in_fp32(trainer: Mapping) -> bool:
    """Megatron's DDP keeps (and reduces) gradients in fp32 unless ``trainer.main_grads_dtype=bf16``."""
    return trainer.get("main_grads_dtype", "fp32") == "fp32"
