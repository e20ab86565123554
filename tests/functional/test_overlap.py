"""Megatron's data-parallel communication overlap (``trainer.overlap_grad_reduce``, ``trainer.overlap_param_gather``)
changes when the gradient reduce-scatter and the parameter all-gather run, never what is computed: two ranks
train the same steps with it on and off, and the losses and the saved checkpoint are the same bit for bit.

The checkpoint part fails if a save reads the parameters before the all-gather that the overlap leaves to the next
forward (the weights of the step before). The cases with small buckets (``trainer.ddp_bucket_size``, so that
each layer has buckets of its own, as an 8B has) fail if a parameter is read without its module's forward
pre-hook, where megatron-core waits for the gathered weights: the GPU's fused output loss reading the untied output
layer (it stopped llama3_8b and Qwen3-30B-A3B on four H200s with a bare ``AssertionError``), LoRA's adapters
(their losses drifted from the third step), experts under expert parallelism. Every module's reach, family by
family: tests/unit/test_param_reach.py."""

from __future__ import annotations

import pytest
import torch

from .test_hf_export import checkpoint_tensors
from .training import finish, start_train

pytestmark = [pytest.mark.functional, pytest.mark.cpu_only]

# Small buckets shard the distributed optimizer's state otherwise than one bucket does (megatron-core buckets only
# with the overlap): the gradient norm then sums in another order, one ulp apart; without clipping the update is
# elementwise, the same bit for bit.
SMALL_BUCKETS = ("trainer.ddp_bucket_size=2000", "trainer.clip_grad=0.0")
CASES = {
    "dp2": [],
    "fused-loss": ["model.output_loss=chunked", *SMALL_BUCKETS],  # tiny_gpt: untied output layer
    "moe-ep2": ["model=tiny_moe", "parallel=ep2", "model.output_loss=chunked", *SMALL_BUCKETS],
    "lora": ["model=hf", "peft=lora", *SMALL_BUCKETS],
}


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    from tests.make_tiny_hf import make

    return make(tmp_path_factory.mktemp("tiny_hf") / "llama3", "llama3")


@pytest.fixture(scope="module", params=list(CASES))
def runs(request, tmp_path_factory, tiny_hf):
    case = request.param
    root = tmp_path_factory.mktemp(f"overlap_{case}")
    extra = [*CASES[case], *([f"model.pretrained={tiny_hf}"] if "model=hf" in CASES[case] else [])]
    started = {
        flag: start_train(
            [
                *extra,
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
