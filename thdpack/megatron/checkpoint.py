"""Checkpoints with Megatron's distributed checkpointing, in Megatron's layout.

``<dir>/iter_0000042/`` holds one checkpoint (model and distributed-optimizer shards, the scheduler, every
rank's RNG states, the data position); ``<dir>/latest_checkpointed_iteration.txt`` names the latest complete
one. A save writes ``iter_0000042.partial/`` first and renames it once every rank has written its part; only
then does the tracker move (written to a temporary file and renamed). A process killed mid-save leaves the
tracker on the previous checkpoint, and the next save of that iteration clears the leftovers.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .models import unwrap_model

__all__ = ["TRACKER", "checkpoint_path", "latest_iteration", "load_checkpoint", "save_checkpoint"]

TRACKER = "latest_checkpointed_iteration.txt"
# For tests only: THDPACK_TEST_KILL_BEFORE_RENAME=<iteration> SIGKILLs every rank in the save of that iteration once
# all its files are written, before the rename (tests/functional/test_resume.py: a kill -9 mid-save, made
# deterministic).
KILL_BEFORE_RENAME = "THDPACK_TEST_KILL_BEFORE_RENAME"
# The distributed optimizer's state in a format that runs on CPU (gloo) as on GPU and reloads exactly.
_OPTIMIZER_FORMAT = {"distrib_optim_sharding_type": "dp_reshardable"}


def checkpoint_path(directory: str | os.PathLike, iteration: int) -> Path:
    return Path(directory) / f"iter_{iteration:07d}"


def latest_iteration(directory: str | os.PathLike | None) -> int | None:
    """The iteration of the latest complete checkpoint under ``directory``, or None when there is none."""
    if directory is None:
        return None
    tracker = Path(directory) / TRACKER
    if not tracker.exists():
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{tracker} holds {text!r}: expected the iteration number of the latest checkpoint")
    iteration = int(text)
    if not checkpoint_path(directory, iteration).is_dir():
        raise ValueError(
            f"{tracker} names iteration {iteration} but {checkpoint_path(directory, iteration)} is missing"
        )
    return iteration


def save_checkpoint(
    directory: str | os.PathLike, iteration: int, model, optimizer, scheduler, extra: Mapping[str, Any]
) -> Path:
    """Save every rank's part of the checkpoint of ``iteration``; collective over the world.

    ``extra``: small host state kept as is (the data loader's position, counters); taken from rank 0.
    """
    from megatron.core import dist_checkpointing

    final = checkpoint_path(directory, iteration)
    if latest_iteration(directory) == iteration:
        # Loaded and not trained since (a finished run started again): the checkpoint is complete already, and
        # clearing it to write it again would leave the tracker naming a missing directory if killed meanwhile.
        return final
    partial = final.with_name(final.name + ".partial")
    rank = dist.get_rank()
    if rank == 0:
        for leftover in (partial, final):  # a save of this iteration that was killed, or one not tracked
            shutil.rmtree(leftover, ignore_errors=True)
        partial.mkdir(parents=True)
    dist.barrier()
    state = _sharded_state(model, optimizer, is_loading=False)
    state["scheduler"] = scheduler.state_dict()
    state["thdpack"] = {"iteration": iteration, **extra}
    dist_checkpointing.save(state, str(partial))
    dist.barrier()
    if os.environ.get(KILL_BEFORE_RENAME) == str(iteration):
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 0:
        os.replace(partial, final)
        tracker = Path(directory) / TRACKER
        temporary = tracker.with_suffix(".tmp")
        with open(temporary, "w") as f:
            f.write(f"{iteration}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, tracker)
        _fsync_dir(Path(directory))
    dist.barrier()
    return final


def load_checkpoint(
    directory: str | os.PathLike, iteration: int, model, optimizer, scheduler
) -> dict[str, Any]:
    """Load the checkpoint of ``iteration`` into ``model``, ``optimizer`` and ``scheduler``, restore this
    rank's RNG states, and return the ``extra`` state saved with it (plus ``iteration``)."""
    from megatron.core import dist_checkpointing

    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        # A fresh torch Adam has no state to load into (its state_dict() then fails): Megatron's own dummy
        # initialisation (one step with zero gradients) creates it; the loaded state replaces all of it. The
        # helper is private (megatron-core 0.16.1 distrib_optimizer.py:1137); Megatron calls it itself only
        # when loading the fsdp_dtensor format (distrib_optimizer.py:1357), not the dp_reshardable one used here.
        inner = getattr(sub, "optimizer", None)
        if inner is not None and not inner.state and hasattr(sub, "_init_optimizer_states_with_dummy_values"):
            sub._init_optimizer_states_with_dummy_values()
    state = _sharded_state(model, optimizer, is_loading=True)
    loaded = dist_checkpointing.load(state, str(checkpoint_path(directory, iteration)))
    unwrap_model(model).load_state_dict(loaded["model"])
    with torch.no_grad():  # fp32 main parameters are views of the model's (leaves that require grad)
        optimizer.load_state_dict(loaded["optimizer"])
    _restore_adam_steps(optimizer, loaded["optimizer"])
    scheduler.load_state_dict(loaded["scheduler"])
    _set_rng_state(loaded["rng"])
    return dict(loaded["thdpack"])


def _restore_adam_steps(optimizer, loaded) -> None:
    """Without Transformer Engine or Apex, megatron-core keeps torch Adam's per-parameter ``step`` in the
    checkpoint's param groups, but loading gives every parameter one shared step tensor (0.16.1
    ``DistributedOptimizer.load_state_dict`` sets ``s["step"] = step`` for every state,
    distrib_optimizer.py:817-824), which torch's Adam then increments once per parameter: the bias correction is
    wrong from the first resumed update on. Give each parameter its own tensor holding the checkpoint's step."""
    steps = set(_param_group_steps(loaded))
    if len(steps) != 1:
        return  # TE's FusedAdam keeps the step in its param groups, which load as they are
    step = float(steps.pop())
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", None)
        for state in inner.state.values() if inner is not None else ():
            if torch.is_tensor(state.get("step")):
                state["step"] = torch.tensor(step, dtype=state["step"].dtype, device=state["step"].device)


def _param_group_steps(tree):
    if isinstance(tree, Mapping):
        for group in tree.get("param_groups", ()) if isinstance(tree.get("param_groups"), list) else ():
            if isinstance(group, Mapping) and group.get("step") is not None:
                yield group["step"]
        for value in tree.values():
            yield from _param_group_steps(value)


def _sharded_state(model, optimizer, is_loading: bool) -> dict[str, Any]:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    # The bare GPTModel's keys (no DDP / Float16Module prefixes), as Megatron-LM saves them.
    model_state = unwrap_model(model).sharded_state_dict()
    # Each rank's RNG streams are its own (tensor-parallel dropout, expert initialisation): one shard a rank.
    rng = ShardedObject("rng_state", _rng_state(), (dist.get_world_size(),), (dist.get_rank(),), replica_id=0)
    return {
        "model": model_state,
        "optimizer": optimizer.sharded_state_dict(
            model_state, is_loading=is_loading, metadata=_OPTIMIZER_FORMAT
        ),
        "rng": rng,
    }


def _rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
