"""What a run says and keeps when it resumes from ``checkpoint.dir``: a learning-rate schedule that differs from
the checkpoint's (megatron-core's scheduler keeps the checkpoint's values without a word), a run that is already
complete (nothing to train, nothing saved again), and the run directory of the earlier attempt, whose
``metrics.jsonl`` the new run continues.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["RUN_DIR_FILE", "continue_metrics", "nothing_to_train", "schedule_changes"]

# In checkpoint.dir: the run directory of the last run that trained into it (one absolute path).
RUN_DIR_FILE = "thdpack_run_dir.txt"


def schedule_changes(recipe: Mapping, checkpoint: Mapping, iteration: int, train_iters: int) -> str | None:
    """A warning when the recipe's schedule (``OptimizerParamScheduler.state_dict()`` as built from the recipe)
    differs from the one the checkpoint restored (``checkpoint``, the scheduler's state after loading: its values
    win), saying what the rest of the run (``iteration`` to ``train_iters``) will do; None when they agree or
    nothing is left to train."""
    if iteration >= train_iters:
        return None

    def warmup(steps: int) -> str:  # thdpack.megatron.optimizer.warmup_from_first_step: iters - 1 steps
        return str(steps + 1) if steps else "0 or 1"

    keys = (
        ("max_lr", "trainer.lr", str),
        ("min_lr", "trainer.min_lr", str),
        ("lr_warmup_steps", "trainer.lr_warmup_iters", warmup),
        ("lr_decay_steps", "trainer.lr_decay_iters (null: train_iters)", str),
        ("lr_decay_style", "trainer.lr_decay_style", str),
    )
    changed = [
        f"{name} {show(checkpoint[key])} in the checkpoint, {show(recipe[key])} in the recipe"
        for key, name, show in keys
        if recipe[key] != checkpoint[key]
    ]
    if not changed:
        return None
    decay, min_lr = int(checkpoint["lr_decay_steps"]), checkpoint["min_lr"]
    after = (
        f"; iterations {max(decay, iteration) + 1}-{train_iters} train at min_lr {min_lr:g}"
        if train_iters > decay and checkpoint["lr_decay_style"] != "constant"
        else ""
    )
    return (
        "the learning-rate schedule differs from the checkpoint's, and the checkpoint's continues (megatron-core "
        f"keeps it on resume): {'; '.join(changed)}{after}. To follow the recipe's schedule, start a new run "
        "from the exported weights"
    )


def nothing_to_train(checkpoint_dir: str, iteration: int, train_iters: int) -> str | None:
    """The message of a resumed run that is already complete, else None."""
    if iteration < train_iters:
        return None
    return (
        f"nothing to train: the checkpoint in {checkpoint_dir} is at iteration {iteration} and "
        f"trainer.train_iters={train_iters}; raise trainer.train_iters to train further (no checkpoint is saved)"
    )


def continue_metrics(checkpoint_dir: str | None, run_dir: Path, iteration: int) -> Path | None:
    """Record ``run_dir`` in ``checkpoint_dir`` (:data:`RUN_DIR_FILE`) and return the earlier run's directory when
    this one resumes (``iteration`` > 0) in another: its ``metrics.jsonl`` records up to ``iteration`` start this
    run's (a new file only), so one file holds the whole run. Call on one rank."""
    if checkpoint_dir is None:
        return None
    record = Path(checkpoint_dir) / RUN_DIR_FILE
    run_dir = Path(run_dir).resolve()
    earlier = None
    if iteration > 0 and record.is_file():
        earlier = Path(record.read_text().strip())
        if earlier == run_dir:
            earlier = None
    if earlier is not None:
        source, target = earlier / "metrics.jsonl", run_dir / "metrics.jsonl"
        if source.is_file() and not target.exists():
            run_dir.mkdir(parents=True, exist_ok=True)
            target.write_text("".join(line + "\n" for line in _records_through(source, iteration)))
    Path(checkpoint_dir).mkdir(parents=True, exist_ok=True)
    tmp = record.with_name(record.name + f".{os.getpid()}")
    tmp.write_text(f"{run_dir}\n")
    os.replace(tmp, record)
    return earlier


def _records_through(path: Path, iteration: int) -> list[str]:
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= iteration:
                kept.append(line)
        except (ValueError, KeyError, TypeError):  # a line cut short by a kill
            pass
    return kept
