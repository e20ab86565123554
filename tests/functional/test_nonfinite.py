"""A non-finite gradient stops the run naming the step (trainer.on_nonfinite=error, the default) or drops the
update and goes on, counted (trainer.on_nonfinite=skip). A huge learning rate makes step 1's update blow the
weights up, so that step 2's gradients are not finite."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .conftest import REPO_ROOT

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


def _train(tmp_path, *overrides):
    return subprocess.run(
        [sys.executable, "-m", "thdpack.train", *BLOW_UP, f"hydra.run.dir={tmp_path}", *overrides],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_nonfinite_gradient_stops_the_run_naming_the_step(tmp_path):
    result = _train(tmp_path)
    assert result.returncode != 0
    assert "FloatingPointError: step 2: the gradient norm is nan" in result.stderr + result.stdout


def test_nonfinite_updates_are_skipped_and_counted_with_on_nonfinite_skip(tmp_path):
    result = _train(tmp_path, "trainer.on_nonfinite=skip")
    assert result.returncode == 0, result.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in records] == [False, True, True, True]
    assert json.loads((tmp_path / "summary.json").read_text())["skipped_updates"] == 3
