"""L1: ``python -m thdpack.train model=hf model.pretrained=<a Qwen2.5-VL, Qwen3-VL or Qwen3-VL-MoE directory>
dataset=embedded_vlm`` trains; packed, padded and packed under CP2 (and, for the MoE family, EP2) compute the same
losses step after step (as do PP2 runs of the dense families), and the first step's loss equals transformers' on
the same global batch and weights.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.vlm_models import build_tiny_vl

from .training import Run, finish, start_train

pytestmark = pytest.mark.functional

SAMPLES, MAX_SIDE, SEQ, BATCH, SEED = 64, 112, 512, 8, 1234
VL = (
    "dataset=embedded_vlm",
    f"dataset.vlm.num_samples={SAMPLES}",
    f"dataset.vlm.max_side={MAX_SIDE}",
    f"dataset.seq_length={SEQ}",
    f"dataset.global_batch_size={BATCH}",
    f"trainer.seed={SEED}",
    "trainer.train_iters=3",
)


# The parallel run each family trains besides packed, padded and CP2 (Qwen3-VL-MoE under PP: unchecked).
# Qwen3-VL's tiny language model has 3 layers, DeepStack after layers 1 and 2: both go on the first stage (with the
# vision tower), the third on the second (checks.py refuses any other split, naming this key).
OTHER = {
    "qwen2_5_vl": ("pp2", ("parallel=pp2",)),
    "qwen3_vl": ("pp2", ("parallel=pp2", "+model.config.num_layers_in_first_pipeline_stage=2")),
    "qwen3_vl_moe": ("ep2", ("parallel=ep2",)),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(family) -> (directory, {name: Run})``, once a family: the packed, padded and CP2 runs on a tiny directory
    of the family and its other parallel run (OTHER), started together: independent runs, and a one-process run
    alone leaves a core of two idle."""
    done = {}

    def get(family: str) -> tuple[Path, dict[str, Run]]:
        if family not in done:
            root = tmp_path_factory.mktemp(family)
            directory = build_tiny_vl(root / "vl", family=family)
            model = ("model=hf", f"model.pretrained={directory}")
            other, overrides = OTHER[family]
            started = {
                "packed": start_train([*model, *VL], root / "packed"),
                "padded": start_train(
                    [*model, *VL, "dataset.pack_sequences_in_batch=false"], root / "padded"
                ),
                "cp2": start_train([*model, *VL, "parallel=cp2"], root / "cp2", nproc=2),
                other: start_train([*model, *VL, *overrides], root / other, nproc=2),
            }
            done[family] = directory, {name: finish(run, timeout=300) for name, run in started.items()}
        return done[family]

    return get


@pytest.mark.parametrize("family", list(OTHER))
def test_packed_padded_and_cp2_runs_train_the_same_losses(runs, family):
    _, run = runs(family)
    packed, padded, cp2 = run["packed"].check(), run["padded"].check(), run["cp2"].check()
    print("packed", packed.losses, "padded", padded.losses, "cp2", cp2.losses)
    assert len(packed.losses) == 3
    assert padded.losses == pytest.approx(packed.losses, rel=1e-5)
    assert cp2.losses == pytest.approx(packed.losses, rel=1e-5)


@pytest.mark.parametrize("family", ["qwen3_vl_moe"])
def test_ep2_trains_the_same_losses_as_one_rank(runs, family):
    """Half the experts on each of two ranks (two data-parallel ranks, each half the global batch; alltoall)."""
    _, run = runs(family)
    packed, ep2 = run["packed"].check(), run["ep2"].check()
    print("packed", packed.losses, "ep2", ep2.losses)
    assert ep2.losses == pytest.approx(packed.losses, rel=1e-5)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_pp2_trains_the_same_losses_as_one_rank(runs, family):
    """The vision tower (and DeepStack) on the first stage, the hidden states sent on, MRoPE ids on both stages."""
    _, run = runs(family)
    packed, pp2 = run["packed"].check(), run["pp2"].check()
    print("packed", packed.losses, "pp2", pp2.losses)
    assert pp2.losses == pytest.approx(packed.losses, rel=1e-5)


@pytest.mark.parametrize("family", list(OTHER))
def test_first_step_loss_equals_transformers_on_the_same_batch(runs, family):
    import torch

    from benchmarks.vlm_gpu import first_batch_rows, transformers_loss

    directory, run = runs(family)
    packed = run["packed"].check()
    args = SimpleNamespace(samples=SAMPLES, max_side=MAX_SIDE, seq_length=SEQ, global_batch=BATCH, seed=SEED)
    expected = transformers_loss(directory, first_batch_rows(directory, args), torch.float32, "cpu")
    print(f"first-step loss thdpack {packed.losses[0]:.8f} transformers {expected:.8f}")
    assert packed.losses[0] == pytest.approx(expected, rel=1e-5)
