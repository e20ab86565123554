"""A non-finite gradient stops the run naming the step (trainer.on_nonfinite=error, the default) or drops the
update and goes on, counted (trainer.on_nonfinite=skip). A huge learning rate makes step 1's update blow the
weights up, so that step 2's gradients are not finite."""

from __future__ import annotations

import json
import sys

import pytest

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
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    """``on_nonfinite -> run`` of BLOW_UP with the default (error) and with skip, started together (independent
    one-process runs; one alone leaves a core of two idle)."""
    started = {}
    for name, overrides in (("error", ()), ("skip", ("trainer.on_nonfinite=skip",))):
        run_dir = tmp_path_factory.mktemp(name) / "run"
        argv = [sys.executable, "-m", "thdpack.train", *BLOW_UP, f"hydra.run.dir={run_dir}", *overrides]
        started[name] = start(argv, run_dir)
    return {name: finish(run, timeout=300) for name, run in started.items()}


def test_nonfinite_gradient_stops_the_run_naming_the_step(runs):
    result = runs["error"]
    assert result.returncode != 0
    assert "FloatingPointError: step 2: the gradient norm is nan" in result.output


def test_nonfinite_updates_are_skipped_and_counted_with_on_nonfinite_skip(runs):
    result = runs["skip"]
    assert result.returncode == 0, result.output[-2000:]
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in records] == [False, True, True, True]
    assert json.loads((result.run_dir / "summary.json").read_text())["skipped_updates"] == 3
