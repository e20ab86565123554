"""``trainer.precision: fp8``: bf16 weights and Transformer Engine's FP8 GEMMs in the transformer layers.

megatron-core runs each transformer layer under TE's ``fp8_autocast`` when ``TransformerConfig.fp8`` is set
(``hybrid``: E4M3 forward, E5M2 gradients) with the scaling recipe of ``fp8_recipe``; the embedding and the output
layer stay bf16, the weights stay bf16 parameters (TE casts them per GEMM), the optimizer is unchanged.

Recipes on Hopper (TE 2.x, megatron-core's ``Fp8Recipe``): ``delayed`` (the default: per-tensor scales from an amax
history; 1.12x tensorwise's tokens/s on ``llama3_1b``, ``benchmarks/results/speed_h100_2026-11-26.md``),
``tensorwise`` (per-tensor current scaling, TE >= 2.2) and ``blockwise`` (1x128 / 128x128 block scales, TE >= 2.3).
``mxfp8`` needs Blackwell. FP8 GEMMs need a token dimension that is a multiple of 16 on every GEMM rank (32 for
MXFP8); the packer pads each packed row for it after context and sequence parallelism have split it
(``thdpack.packing.layout.Alignment.total_multiple``).

Recipe keys: ``trainer.precision: fp8`` and ``trainer.fp8_recipe`` (delayed | tensorwise | blockwise | mxfp8).
Attention stays bf16 unless the recipe sets megatron-core's ``model.config.fp8_dot_product_attention``; on packed
(THD) rows Transformer Engine 2.20 trains FP8 attention only on Blackwell with cuDNN 9.23 or newer
(:func:`check_fp8_attention`).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping

__all__ = ["FP8_RECIPES", "check_fp8", "check_fp8_attention", "fp8_config"]

FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")


# Delayed scaling's amax history: Transformer Engine's own ``DelayedScaling`` defaults (the largest amax of the last
# 1,024 steps sets a tensor's scale); megatron-core's defaults (one step, its amax alone) let a single spike overflow.
DELAYED_AMAX = {"fp8_amax_history_len": 1024, "fp8_amax_compute_algo": "max"}


def fp8_config(precision: str, recipe: str | None) -> dict:
    """The ``TransformerConfig`` fields for ``precision`` (empty unless fp8)."""
    if precision != "fp8":
        return {}
    recipe = recipe or "delayed"
    return {"fp8": "hybrid", "fp8_recipe": recipe, **(DELAYED_AMAX if recipe == "delayed" else {})}


def check_fp8(trainer: Mapping, device: str, backend: str) -> None:
    """Refuse, naming the key, an FP8 recipe this device, backend or Transformer Engine cannot run."""
    recipe = trainer.get("fp8_recipe", "delayed")
    if recipe not in FP8_RECIPES:
        raise ValueError(f"trainer.fp8_recipe is {recipe!r}: it must be one of {list(FP8_RECIPES)}")
    if trainer.get("precision", "auto") != "fp8":
        return
    if device != "cuda":
        raise ValueError(
            "trainer.precision=fp8 needs a CUDA GPU (Transformer Engine's FP8 GEMMs): use bf16 or fp32"
        )
    if backend != "te" or importlib.util.find_spec("transformer_engine") is None:
        raise ValueError(
            "trainer.precision=fp8 runs Transformer Engine's layers: it needs model.attention_backend=te (or auto) "
            "and Transformer Engine installed"
        )
    import torch

    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        raise ValueError(
            f"trainer.precision=fp8 needs FP8 tensor cores (Ada/Hopper or newer); this GPU is sm_{major}{minor}"
        )
    if recipe == "mxfp8" and major < 10:
        raise ValueError(
            f"trainer.fp8_recipe=mxfp8 needs a Blackwell GPU (sm_100); this one is sm_{major}{minor}: use tensorwise, "
            "delayed or blockwise"
        )


# Transformer Engine 2.20's rules for FP8 fused attention on THD (packed) rows in training: its backward runs on
# Blackwell (sm_100) and newer only, and needs cuDNN 9.23 or newer; elsewhere no attention backend is left.
FP8_THD_ATTENTION_CAPABILITY = (10, 0)
FP8_THD_ATTENTION_CUDNN = (9, 23, 0)


def check_fp8_attention(
    model_config: Mapping | None,
    precision: str,
    packed: bool,
    capability: tuple[int, int] | None = None,
    cudnn: tuple[int, int, int] | None = None,
) -> None:
    """Refuse, naming the key, ``model.config.fp8_dot_product_attention`` in an FP8 run (``trainer.precision``) on
    packed rows where Transformer Engine has no FP8 attention for the THD layout: a GPU older than Blackwell, or a
    cuDNN older than 9.23. ``capability`` and ``cudnn`` default to this host's (read only when the rule applies)."""
    model_config = model_config or {}
    fp8 = precision == "fp8" or model_config.get("fp8") is not None
    if not (fp8 and model_config.get("fp8_dot_product_attention") and packed):
        return
    if capability is None:
        import torch

        capability = torch.cuda.get_device_capability()
    if tuple(capability) < FP8_THD_ATTENTION_CAPABILITY:
        raise ValueError(
            "model.config.fp8_dot_product_attention=true on packed sequences (THD) needs a Blackwell GPU (sm_100 or "
            "newer): Transformer Engine runs FP8 attention's backward on THD rows there only; this GPU is "
            f"sm_{capability[0]}{capability[1]}: leave attention in bf16 (drop the key)"
        )
    cudnn = cudnn or cudnn_version()
    if cudnn is not None and tuple(cudnn) < FP8_THD_ATTENTION_CUDNN:
        need = ".".join(map(str, FP8_THD_ATTENTION_CUDNN))
        raise ValueError(
            f"model.config.fp8_dot_product_attention=true on packed sequences (THD) needs cuDNN {need} or newer for "
            f"Transformer Engine's FP8 attention; it loaded cuDNN {'.'.join(map(str, cudnn))} (CUDNN_HOME's, "
            "CUDA's or the system's before the Python package's): point CUDNN_HOME at a newer one, or leave "
            "attention in bf16 (drop the key)"
        )


def cudnn_version() -> tuple[int, int, int] | None:
    """The cuDNN that Transformer Engine's attention runs on, as (major, minor, patch); None without Transformer
    Engine. It can differ from torch's: TE loads CUDNN_HOME's, CUDA's or the system's cuDNN before the Python
    package's."""
    if importlib.util.find_spec("transformer_engine") is None:
        return None
    from transformer_engine.pytorch.utils import get_cudnn_version

    return tuple(get_cudnn_version())
