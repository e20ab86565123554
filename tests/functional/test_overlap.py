"""Megatron's data-parallel communication overlap (``trainer.overlap_grad_reduce``, ``trainer.overlap_param_gather``)
changes when the gradient reduce-scatter and the parameter all-gather run, never what is computed: two ranks
train the same steps with it on and off, and the losses and the saved checkpoint are the same bit for bit. The
checkpoint part fails if a save reads the parameters before the all-gather that the overlap leaves to the next
forward (the weights of the step before)."""

from __future__ import annotations

import pytest
import torch

from .test_hf_export import checkpoint_tensors
from .training import finish, start_train

pytestmark = [pytest.mark.functional, pytest.mark.cpu_only]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("overlap")
    started = {
        flag: start_train(
            [
                "trainer.train_iters=3",
                f"trainer.overlap_grad_reduce={flag}",
                f"trainer.overlap_param_gather={flag}",
                f"checkpoint.dir={root / flag / 'ckpt'}",
            ],
            root / flag / "run",
            nproc=2,
        )
        for flag in ("false", "true")
    }
    return {flag: finish(run).check() for flag, run in started.items()}, root


def test_overlap_gives_the_same_losses(runs):
    done, _ = runs
    assert done["true"].losses == done["false"].losses
    assert len(done["true"].losses) == 3


def test_overlap_saves_the_updated_weights(runs):
    _, root = runs
    plain = checkpoint_tensors(root / "false" / "ckpt" / "iter_0000003")
    overlapped = checkpoint_tensors(root / "true" / "ckpt" / "iter_0000003")
    assert plain.keys() == overlapped.keys()
    for key, tensor in plain.items():
        assert torch.equal(tensor, overlapped[key]), key
