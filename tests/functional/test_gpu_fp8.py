"""GPU: a packed FP8 training step (bf16 weights, Transformer Engine's FP8 GEMMs) runs and its losses stay close to
bf16's on the same seed and samples."""

from __future__ import annotations

import pytest
import torch

from thdpack.megatron import fp8

from .gpu import FP8_CORES, WITH_TE
from .training import steps_in_process

pytestmark = [*WITH_TE, FP8_CORES]


def _losses(precision: list[str], steps: int = 4, inspect=None) -> list[float]:
    def is_fp8(run) -> None:
        assert bool(run.config.fp8) == ("trainer.precision=fp8" in precision)
        if inspect is not None:
            inspect(run)

    overrides = ["dataset.seq_length=512", "dataset.max_files=40", *precision]
    return [step["loss"] for step in steps_in_process(overrides, steps, inspect=is_fp8)]


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "blockwise"])
def test_a_packed_fp8_step_runs_and_its_loss_is_close_to_bf16s(recipe):
    bf16 = _losses(["trainer.precision=bf16"])
    fp8 = _losses(["trainer.precision=fp8", f"trainer.fp8_recipe={recipe}"])
    assert all(torch.isfinite(torch.tensor(fp8)))
    assert fp8[0] == pytest.approx(bf16[0], rel=2e-2)
    assert fp8[-1] == pytest.approx(bf16[-1], rel=5e-2)


def test_fp8_attention_on_packed_rows_trains_close_to_bf16():
    attention = "+model.config.fp8_dot_product_attention=true"
    try:  # Transformer Engine's rule for this GPU and the cuDNN it loaded, as start-up applies it
        fp8.check_fp8_attention({"fp8_dot_product_attention": True}, "fp8", packed=True)
    except ValueError as refused:
        pytest.skip(str(refused))

    def fp8_attention(run) -> None:
        assert run.config.fp8 and run.config.fp8_dot_product_attention

    bf16 = _losses(["trainer.precision=bf16"])
    fp8_losses = _losses(
        ["trainer.precision=fp8", "trainer.fp8_recipe=delayed", attention], inspect=fp8_attention
    )
    assert all(torch.isfinite(torch.tensor(fp8_losses)))
    assert fp8_losses[0] == pytest.approx(bf16[0], rel=2e-2)
    assert fp8_losses[-1] == pytest.approx(bf16[-1], rel=5e-2)
