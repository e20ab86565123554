"""The GPU tests' marks: ``pytest -m gpu`` selects them, and each skips cleanly (CI has no GPU) where the hardware
or library it needs is missing."""

from __future__ import annotations

import importlib.util

import pytest
import torch

ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

WITH_TE = [
    *ON_GPU,
    pytest.mark.skipif(
        importlib.util.find_spec("transformer_engine") is None, reason="needs Transformer Engine"
    ),
]

FP8_CORES = pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9), reason="needs FP8 tensor cores"
)


def steady_step_scalars(run, warmup: int = 3, measured: int = 3) -> list:
    """Train ``warmup`` steps (allocator, cuDNN/TE autotuning, Triton compilation, optimizer state), then
    ``measured`` steps under ``torch.cuda.set_sync_debug_mode("error")``: any host-device sync raises. The steps'
    scalars go through :class:`thdpack.training.deferred.DeferredScalars` as in the training loop (read one step
    late); returns the ``(step, values, ...)`` entries settled during the measured steps and after them (the mode
    does not see ``Event.synchronize``, the deferred read's wait)."""
    from thdpack.training.deferred import DeferredScalars
    from thdpack.training.loop import step_scalars, train_step

    scalars = DeferredScalars("cuda")

    def iteration(step: int) -> list:
        losses, outcome = train_step(run, run.data.next_step())
        scalars.push(step, step_scalars(losses, outcome, True, run.step.loss))
        return list(scalars.ready())

    for step in range(1, warmup + 1):
        iteration(step)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        settled = [entry for step in range(warmup + 1, warmup + measured + 1) for entry in iteration(step)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return settled + list(scalars.drain())
