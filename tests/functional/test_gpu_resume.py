"""GPU: resume on the same and on another layout with NCCL, bf16 and Transformer Engine (TE's fused Adam keeps its
step in the param groups; the optimizer state is gathered over NCCL ranks' gloo groups). The CPU suite
(tests/functional/test_resume.py) pins the rules in fp32; here each change is run once and its largest relative
loss difference from the uninterrupted run is printed (``-s``) and held to GPU_RTOL (bf16 sums in another order).

    pytest tests/functional/test_gpu_resume.py -m gpu -s      # 2 GPUs for the layout changes, 1 for the rest
"""

from __future__ import annotations

import shutil

import pytest
import torch

from .gpu import WITH_TE
from .training import FAMILIES, ITERS, family, run_train

pytestmark = [*WITH_TE, pytest.mark.functional]

GPU_RTOL = 2e-2
CHANGES = {  # name: (saved family, resumed family, resumed ranks)
    "same_layout": ("dense", "dense", 1),
    "dp1_to_dp2": ("dense", "dense", 2),
    "tp1_to_tp2": ("dense", "dense_tp2", 2),
    "pp2_to_pp1": ("dense_pp2", "dense", 1),
}


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    runs = {}

    def get(name: str):
        if name not in runs:
            overrides, nproc = family(name)
            root = tmp_path_factory.mktemp(f"gpu_{name}")
            command = [*overrides, f"checkpoint.dir={root / 'ckpt'}", "trainer.exit_interval=3"]
            run_train(command, root / "run", nproc).check()
            runs[name] = root / "ckpt"
        return runs[name]

    return get


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_gpu_resume_continues_the_uninterrupted_run(change, stopped, trained, tmp_path):
    saved, resumed, nproc = CHANGES[change]
    needed = max(nproc, family(saved)[1])
    if torch.cuda.device_count() < needed:
        pytest.skip(f"needs {needed} GPUs")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(stopped(saved), ckpt)
    overrides = [
        *FAMILIES[resumed][0],
        f"trainer.train_iters={ITERS}",
        "dataset.pack_sequences_in_batch=true",
    ]
    run = run_train([*overrides, f"checkpoint.dir={ckpt}"], tmp_path / "run", nproc).check()
    reference = {r["step"]: r for r in trained(*family(saved)[0], nproc=family(saved)[1]).check().records}
    assert run.steps == [1, 2, 3, 4, 5, 6]  # the saved run's steps 1-3 start the new run directory's metrics
    resumed_steps = [r for r in run.records if r["step"] > 3]
    worst = max(
        abs(r["loss"] - reference[r["step"]]["loss"]) / abs(reference[r["step"]]["loss"])
        for r in resumed_steps
    )
    print(f"\n{change}: largest relative loss difference from the uninterrupted run {worst:.2e}")
    assert worst <= GPU_RTOL
