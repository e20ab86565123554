"""GPU: ``model.te_op_fuser=true`` builds megatron-core's ``TEFusedMLP`` (Transformer Engine's fused operations for
norm, FC1, SwiGLU and FC2) with the plain MLP's parameters, and trains packed to the plain MLP's losses and
gradient norms, in bf16 (also with MRoPE, the vision-language models' language model) and in FP8."""

from __future__ import annotations

import pytest

from .gpu import FP8_CORES, WITH_TE
from .training import steps_in_process

pytestmark = WITH_TE


def _steps(fused: bool, extra: list[str]) -> tuple[list[dict], dict]:
    seen = {}

    def inspect(run) -> None:
        from thdpack.megatron.unwrap import unwrap_model

        module = unwrap_model(run.model)
        seen["mlp"] = {type(layer.mlp).__name__ for layer in module.decoder.layers}
        seen["parameters"] = sorted(name for name, _ in module.named_parameters())

    overrides = ["dataset.seq_length=512", "dataset.max_files=40", f"model.te_op_fuser={fused}", *extra]
    return steps_in_process(overrides, 4, inspect=inspect), seen


@pytest.mark.parametrize(
    ("extra", "rel"),
    [
        pytest.param(["trainer.precision=bf16"], (2e-3, 2e-2), id="bf16"),
        pytest.param(["model=tiny_mrope", "trainer.precision=bf16"], (2e-3, 2e-2), id="bf16_mrope"),
        pytest.param(
            ["trainer.precision=fp8", "trainer.fp8_recipe=delayed"], (2e-2, 1e-1), id="fp8", marks=FP8_CORES
        ),
    ],
)
def test_the_fused_mlp_trains_to_the_plain_mlps_losses(extra, rel):
    plain, plain_seen = _steps(False, extra)
    fused, fused_seen = _steps(True, extra)
    assert plain_seen["mlp"] == {"MLP"} and fused_seen["mlp"] == {"TEFusedMLP"}
    # the same parameter names: checkpoints and the Hugging Face export read the same keys
    assert fused_seen["parameters"] == plain_seen["parameters"]
    for a, b in zip(plain, fused, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=rel[0])
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=rel[1])
