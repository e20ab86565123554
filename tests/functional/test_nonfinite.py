"""A non-finite gradient stops the run naming the step (trainer.on_nonfinite=error, the default) or drops the
update and goes on, counted (trainer.on_nonfinite=skip), until trainer.max_consecutive_skips updates in a row were
dropped. A huge learning rate makes step 1's update blow the weights up, so that every later step's gradients are
not finite. Each run saves every step (checkpoint.save_interval=1): no checkpoint is written from the weights that
gave a non-finite step, and the one of step 1 (those weights) is set aside when the run stops on them."""

from __future__ import annotations

import json
import sys

import pytest

from thdpack.megatron.checkpoint import latest_iteration

from .training import Run, finish, start

pytestmark = pytest.mark.functional

BLOW_UP = [
    "trainer.train_iters=4",
    "trainer.lr=1e30",
    "trainer.min_lr=1e29",
    "trainer.lr_warmup_iters=0",
    "dataset.global_batch_size=4",
    "dataset.micro_batch_size=2",
    "dataset.max_files=10",
    "dataset.seq_length=256",
    "trainer.progress_bar=false",
    "checkpoint.save_interval=1",
]
RUNS = {
    "error": (),
    "skip": ("trainer.on_nonfinite=skip",),
    "skip_limit": ("trainer.on_nonfinite=skip", "trainer.max_consecutive_skips=2"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    """``name -> run`` of BLOW_UP with each of RUNS's overrides, started together (independent one-process runs)."""
    started = {}
    for name, overrides in RUNS.items():
        root = tmp_path_factory.mktemp(name)
        argv = [sys.executable, "-m", "thdpack.train", *BLOW_UP, f"checkpoint.dir={root / 'ckpt'}"]
        started[name] = start([*argv, f"hydra.run.dir={root / 'run'}", *overrides], root / "run")
    return {name: finish(run, timeout=300) for name, run in started.items()}


def ckpt_entries(run: Run) -> list[str]:
    return sorted(p.name for p in (run.run_dir.parent / "ckpt").glob("iter_*"))


def test_nonfinite_gradient_stops_the_run_naming_the_step(runs):
    result = runs["error"]
    assert result.returncode == 1
    assert "FloatingPointError: step 2: the gradient norm is nan" in result.output
    assert "Traceback" not in result.output


def test_on_nonfinite_error_leaves_no_tracked_checkpoint_of_the_diverged_weights(runs):
    result = runs["error"]
    ckpt = result.run_dir.parent / "ckpt"
    assert f"The checkpoint of iteration 1 holds the weights that gave step 2: set aside as {ckpt}" in (
        result.output
    )
    assert latest_iteration(ckpt) is None
    assert ckpt_entries(result) == ["iter_0000001.nonfinite"]


def test_nonfinite_updates_are_skipped_and_counted_with_on_nonfinite_skip(runs):
    result = runs["skip"]
    assert result.returncode == 0, result.output[-2000:]
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in records] == [False, True, True, True]
    assert json.loads((result.run_dir / "summary.json").read_text())["skipped_updates"] == 3


def test_no_checkpoint_is_written_from_skipped_away_state(runs):
    result = runs["skip"]
    assert ckpt_entries(result) == ["iter_0000001"]  # step 1 was finite; steps 2-4 and the final save are not
    for step in (2, 3, 4):
        assert f"not saving the checkpoint of iteration {step}: its last" in result.output


def test_on_nonfinite_skip_gives_up_after_max_consecutive_skips(runs):
    result = runs["skip_limit"]
    assert result.returncode == 1
    assert (
        "2 updates in a row held back (trainer.max_consecutive_skips=2), the run has diverged"
        in result.output
    )
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert ckpt_entries(result) == ["iter_0000001.nonfinite"]
