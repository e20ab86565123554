"""GPU: the fused output losses in bf16 (the chunked one with its compiled element-wise parts, and Liger's) against
the full logits' cross entropy, and a packed training step of each against Megatron's output layer and loss."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from .gpu import ON_GPU
from .training import steps_in_process

pytestmark = ON_GPU

IMPLS = [
    pytest.param("chunked", True, id="chunked_compiled"),
    pytest.param("chunked", False, id="chunked_eager"),
    pytest.param(
        "liger",
        None,
        id="liger",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("liger_kernel") is None, reason="needs liger-kernel"
        ),
    ),
]


@pytest.mark.parametrize(("impl", "compiled"), IMPLS)
def test_bf16_losses_and_gradients_match_the_full_logits(impl, compiled):
    from thdpack.megatron.output_loss import linear_cross_entropy

    torch.manual_seed(0)
    n, h, v = 3000, 256, 5000
    hidden = (torch.randn(n, h, device="cuda") * 0.5).bfloat16().requires_grad_()
    weight = (torch.randn(v, h, device="cuda") * 0.05).bfloat16().requires_grad_()
    labels = torch.randint(0, v, (n,), device="cuda")
    mask = (torch.rand(n, device="cuda") > 0.2).float()
    losses = linear_cross_entropy(
        hidden, weight, labels, mask, impl=impl, compiled=compiled, chunk_tokens=1024
    )
    (losses * mask).sum().backward()
    got = (losses.detach(), hidden.grad.float(), weight.grad.float())

    hidden.grad = weight.grad = None
    reference = F.cross_entropy((hidden @ weight.t()).float(), labels, reduction="none") * mask
    reference.sum().backward()
    torch.testing.assert_close(got[0], reference.detach(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got[1], hidden.grad.float(), rtol=5e-2, atol=1e-3)
    torch.testing.assert_close(got[2], weight.grad.float(), rtol=5e-2, atol=1e-3)


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None, reason="needs Transformer Engine")
@pytest.mark.parametrize("output_loss", ["chunked", "liger"])
def test_a_packed_step_loss_matches_megatrons(output_loss):
    """The first step's loss (same seed, same batch) with the fused output loss and with Megatron's."""
    if output_loss == "liger" and importlib.util.find_spec("liger_kernel") is None:
        pytest.fail("model.output_loss=liger is a supported setting: install thdpack[liger] on the GPU host")
    losses = {
        name: steps_in_process(
            [
                "dataset.seq_length=512",
                "dataset.max_files=40",
                "trainer.train_iters=3",
                f"model.output_loss={name}",
            ],
            steps=1,
        )[0]
        for name in ("megatron", output_loss)
    }
    assert losses[output_loss]["loss"] == pytest.approx(losses["megatron"]["loss"], rel=2e-3)
    assert losses[output_loss]["grad_norm"] == pytest.approx(losses["megatron"]["grad_norm"], rel=2e-2)
