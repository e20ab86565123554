"""GPU: a packed FP8 training step (bf16 weights, Transformer Engine's FP8 GEMMs) runs and its losses stay close to
bf16's on the same seed and samples."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        importlib.util.find_spec("transformer_engine") is None, reason="needs Transformer Engine"
    ),
    pytest.mark.skipif(
        torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
        reason="needs FP8 tensor cores",
    ),
]


def _losses(precision: list[str], steps: int = 4) -> list[float]:
    from hydra import compose, initialize_config_dir

    from thdpack.training.deferred import DeferredScalars
    from thdpack.training.loop import (
        STEP_SCALARS,
        _shutdown,
        recipes_dir,
        setup_run,
        step_scalars,
        train_step,
    )

    os.environ.pop("MASTER_PORT", None)
    overrides = ["dataset.seq_length=512", "dataset.max_files=40", f"trainer.train_iters={steps}", *precision]
    with initialize_config_dir(str(recipes_dir()), version_base="1.3"):
        run = setup_run(compose("train", overrides=overrides))
    try:
        assert bool(run.config.fp8) == ("trainer.precision=fp8" in precision)
        scalars = DeferredScalars("cuda", lag=0)
        for step in range(1, steps + 1):
            reports, outcome = train_step(run, run.data.next_step())
            scalars.push(step, step_scalars(reports, outcome, True, run.step.loss))
        return [dict(zip(STEP_SCALARS, values, strict=True))["loss"] for _, values, _ in scalars.drain()]
    finally:
        _shutdown()


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "blockwise"])
def test_a_packed_fp8_step_runs_and_its_loss_is_close_to_bf16s(recipe):
    bf16 = _losses(["trainer.precision=bf16"])
    fp8 = _losses(["trainer.precision=fp8", f"trainer.fp8_recipe={recipe}"])
    assert all(torch.isfinite(torch.tensor(fp8)))
    assert fp8[0] == pytest.approx(bf16[0], rel=2e-2)
    assert fp8[-1] == pytest.approx(bf16[-1], rel=5e-2)
