"""GPU: Transformer Engine's layers add their weight gradients into Megatron's fp32 gradient buffer inside the
GEMM (``thdpack.megatron.distributed.fuse_te_wgrad_accumulation``, on by default with TE on a GPU), and a step's
gradients over several micro-batches equal those of the unfused path (a bf16 weight gradient per micro-batch that
Megatron's hook adds to the buffer) up to the bf16 rounding the fusion removes: for the plain and the fused MLP,
FP8 (whose first micro-batch overwrites the buffer)."""

from __future__ import annotations

import pytest
import torch

from .gpu import FP8_CORES, WITH_TE
from .training import run_in_process

pytestmark = WITH_TE


UNFUSED = "+model.config.gradient_accumulation_fusion=false"


def _step_gradients(extra: list[str]) -> tuple[dict[str, torch.Tensor], list[bool]]:
    """The fp32 gradient buffer of every parameter after one step's forward and backward, and the TE layers'
    ``fuse_wgrad_accumulation`` flags."""
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

    from thdpack.training.loop import forward_backward

    overrides = [
        "dataset.seq_length=512",
        "dataset.max_files=40",
        "dataset.micro_batch_tokens=1024",  # several micro-batches a step: the buffer accumulates across them
        *extra,
    ]
    with run_in_process(overrides) as run:
        batches = run.data.next_step()
        assert len(batches) > 1
        forward_backward(run, batches)
        torch.cuda.synchronize()
        grads = {
            name: p.main_grad.float().clone() for name, p in run.model.named_parameters() if p.requires_grad
        }
        flags = [
            m.fuse_wgrad_accumulation
            for m in run.model.modules()
            if isinstance(m, TransformerEngineBaseModule) and hasattr(m, "fuse_wgrad_accumulation")
        ]
        return grads, flags


@pytest.mark.parametrize(
    ("extra", "tolerance"),
    [
        pytest.param(["trainer.precision=bf16", "model.te_op_fuser=false"], 1e-2, id="bf16"),
        pytest.param(["trainer.precision=bf16", "model.te_op_fuser=true"], 1e-2, id="bf16_fused_mlp"),
        pytest.param(
            ["trainer.precision=fp8", "trainer.fp8_recipe=delayed"], 3e-2, id="fp8", marks=FP8_CORES
        ),
    ],
)
def test_weight_gradients_accumulated_inside_the_gemm_equal_the_unfused_ones(extra, tolerance):
    fused, fused_flags = _step_gradients(extra)
    unfused, unfused_flags = _step_gradients([*extra, UNFUSED])
    assert fused_flags and all(fused_flags)
    assert unfused_flags and not any(unfused_flags)
    assert fused.keys() == unfused.keys()
    for name, grad in fused.items():
        reference = unfused[name]
        assert reference.norm() > 0, name
        # a gradient lost or counted twice would be off by its own size
        assert (grad - reference).norm() / reference.norm() < tolerance, name
