"""Checkpoints with Megatron's distributed checkpointing, in Megatron's layout.

``<dir>/iter_0000042/`` holds one checkpoint (model and distributed-optimizer shards, the scheduler, every
rank's RNG states, the data position, the parallel layout it was saved on); ``<dir>/latest_checkpointed_iteration.txt``
names the latest complete one. A save writes ``iter_0000042.partial/`` first and renames it once every rank has
written its part; only then does the tracker move (written to a temporary file and renamed). A process killed
mid-save leaves the tracker on the previous checkpoint, and the next save of that iteration clears the leftovers.

A checkpoint loads on another DP/TP/PP/CP/EP layout when its optimizer state is ``fully_reshardable`` (the
default, :mod:`thdpack.megatron.parallel_layout` says what may change); the data position is global, the model's
tensors are global, and the per-rank RNG states are re-seeded from the recipe's seed when the layout changed.
"""

from __future__ import annotations

import contextlib
import logging
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
from .parallel_layout import OPTIMIZER_FORMATS, ParallelLayout, check_resumable

__all__ = [
    "TRACKER",
    "check_optimizer_format",
    "checkpoint_path",
    "latest_iteration",
    "load_checkpoint",
    "resume_vocab_size",
    "save_checkpoint",
    "saved_metadata",
]

TRACKER = "latest_checkpointed_iteration.txt"
# For tests only: THDPACK_TEST_KILL_BEFORE_RENAME=<iteration> SIGKILLs every rank in the save of that iteration once
# all its files are written, before the rename (tests/functional/test_resume.py: a kill -9 mid-save, made
# deterministic).
KILL_BEFORE_RENAME = "THDPACK_TEST_KILL_BEFORE_RENAME"
log = logging.getLogger("thdpack")


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


def check_optimizer_format(value: str) -> str:
    """``checkpoint.optimizer_format`` checked at start-up (a save, maybe hours later, would refuse it)."""
    if value not in OPTIMIZER_FORMATS:
        raise ValueError(
            f"checkpoint.optimizer_format is '{value}': it must be one of {list(OPTIMIZER_FORMATS)}"
        )
    return value


def saved_metadata(directory: str | os.PathLike | None) -> dict[str, Any] | None:
    """thdpack's metadata of the latest complete checkpoint under ``directory`` (iteration, layout, optimizer
    format, vocabulary size, data position), or None when there is none. Reads one small file."""
    from megatron.core import dist_checkpointing

    iteration = latest_iteration(directory)
    if iteration is None:
        return None
    return dict(
        dist_checkpointing.load_common_state_dict(str(checkpoint_path(directory, iteration)))["thdpack"]
    )


def resume_vocab_size(directory: str | os.PathLike | None, vocab_size: int, tp: int, explicit: bool) -> int:
    """The padded vocabulary size to build the model with: ``vocab_size`` (the recipe's rule, 128 x TP padding),
    or, when resuming and the recipe leaves ``model.vocab_size`` unset (``explicit`` False), the size the
    checkpoint was saved with: a TP change must not change the embedding's rows."""
    saved = (saved_metadata(directory) or {}).get("vocab_size") if not explicit else None
    if saved is None or saved == vocab_size or saved % tp:
        return vocab_size  # a size that TP does not divide is refused by load_checkpoint, naming the key
    log.info(
        "vocabulary: %d rows as in the checkpoint in %s (this layout would pad it to %d)",
        saved,
        directory,
        vocab_size,
    )
    return int(saved)


def save_checkpoint(
    directory: str | os.PathLike,
    iteration: int,
    model,
    optimizer,
    scheduler,
    extra: Mapping[str, Any],
    optimizer_format: str = "fully_reshardable",
) -> Path:
    """Save every rank's part of the checkpoint of ``iteration``; collective over the world.

    ``extra``: small host state kept as is (the data loader's position, counters); taken from rank 0.
    ``optimizer_format``: the distributed optimizer's state as ``fully_reshardable`` (gathered into the model's
    shapes on each data-parallel group's first rank: loads on any layout) or ``dp_reshardable`` (each rank's flat
    buffer, written in parallel without a gather: loads only on the same TP/PP/CP/EP).
    """
    check_optimizer_format(optimizer_format)
    from megatron.core import dist_checkpointing

    from .distributed import sync_params

    sync_params(model)  # trainer.overlap_param_gather: the updated weights, not the last forward's
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
    state = _sharded_state(model, optimizer, optimizer_format, is_loading=False, with_rng=True)
    state["scheduler"] = scheduler.state_dict()
    state["thdpack"] = {
        "iteration": iteration,
        "layout": ParallelLayout.current().as_dict(),
        "optimizer_format": optimizer_format,
        "vocab_size": int(unwrap_model(model).vocab_size),
        **extra,
    }
    _write_results_in_process()
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


def _write_results_in_process() -> None:
    """megatron-core 0.16's torch_dist writer (dist_checkpointing/strategies/filesystem_async.py) hands a save's
    write results to the saving process over a queue it creates on the first save from a multiprocessing Manager
    started with "spawn": a new interpreter that imports the launching module (``thdpack.train``, hence torch and
    thdpack: about 3 s of CPU on every rank of every run that saves), and a process that outlives a killed rank. A
    synchronous save, the only kind thdpack makes, runs the writer in this process: a plain queue carries them."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    # None: not created yet (a release without the name is left alone)
    if getattr(filesystem_async, "_results_queue", ...) is None:
        filesystem_async._results_queue = queue.Queue()


def load_checkpoint(
    directory: str | os.PathLike, iteration: int, model, optimizer, scheduler, seed: int
) -> dict[str, Any]:
    """Load the checkpoint of ``iteration`` into ``model``, ``optimizer`` and ``scheduler`` and return the
    ``extra`` state saved with it (plus ``iteration``). On the layout it was saved on, this rank's RNG states are
    restored; on another one they are re-seeded from ``seed + iteration`` (they are per rank). A checkpoint that
    cannot load on this layout, or whose vocabulary has another padded size, is refused before anything loads."""
    from megatron.core import dist_checkpointing

    path = checkpoint_path(directory, iteration)
    saved = dist_checkpointing.load_common_state_dict(str(path))["thdpack"]
    layout, current = ParallelLayout.from_dict(saved.get("layout")), ParallelLayout.current()
    # Checkpoints that recorded no format were written in dp_reshardable.
    optimizer_format = saved.get("optimizer_format", "dp_reshardable")
    has_experts = bool(getattr(unwrap_model(model).config, "num_moe_experts", None))
    check_resumable(layout, current, optimizer_format, str(path), has_experts)
    _check_vocab_size(saved.get("vocab_size"), int(unwrap_model(model).vocab_size), layout, current, path)
    same_layout = layout is None or layout == current
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        # A fresh torch Adam has no state to load into (its state_dict() then fails): Megatron's own dummy
        # initialisation (one step with zero gradients) creates it; the loaded state replaces all of it. The
        # helper is private (megatron-core 0.16.1 distrib_optimizer.py:1137); Megatron calls it itself only
        # when loading the fsdp_dtensor format (distrib_optimizer.py:1357), not the dp_reshardable one used here.
        inner = getattr(sub, "optimizer", None)
        if inner is not None and not inner.state and hasattr(sub, "_init_optimizer_states_with_dummy_values"):
            sub._init_optimizer_states_with_dummy_values()
    state = _sharded_state(model, optimizer, optimizer_format, is_loading=True, with_rng=same_layout)
    loaded = dist_checkpointing.load(state, str(path))
    unwrap_model(model).load_state_dict(loaded["model"])
    with torch.no_grad(), _torch_adam_step_kept(optimizer):  # fp32 main parameters are views of the model's
        optimizer.load_state_dict(loaded["optimizer"])
    _restore_adam_steps(optimizer, loaded["optimizer"])
    scheduler.load_state_dict(loaded["scheduler"])
    if same_layout:
        _set_rng_state(loaded["rng"])
    else:
        _reseed(seed + iteration)
        log.info(
            "resuming on %s from a checkpoint saved on %s: model and optimizer state resharded; the per-rank "
            "random streams do not carry over and are re-seeded from trainer.seed + iteration (%d)",
            current,
            layout,
            seed + iteration,
        )
    return dict(loaded["thdpack"])


def _check_vocab_size(saved: int | None, mine: int, layout, current, path: Path) -> None:
    """The embedding and output layer are padded to a multiple of 128 x TP: a TP change can change their rows."""
    if saved is None or saved == mine:
        return
    hint = (
        f"set model.vocab_size={saved}" if saved % current.tp == 0 else "keep the saved tensor-parallel size"
    )
    raise ValueError(
        f"{path} has a vocabulary of {saved} rows (padded, saved on {layout}) but this run pads it to {mine} "
        f"(on {current}): {hint} to resume from it"
    )


@contextlib.contextmanager
def _torch_adam_step_kept(optimizer):
    """megatron-core (0.16) without Transformer Engine or Apex keeps torch Adam's per-parameter ``step`` in the
    optimizer state, but ``fully_reshardable`` loading copies every state key of a parameter from the loaded
    tensors, which hold no ``step`` (it lives in the param groups): a KeyError. Keep each parameter's ``step``
    as it is there (:func:`_restore_adam_steps` sets it from the checkpoint afterwards)."""
    patched = []
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not hasattr(sub, "_set_main_param_and_optimizer_states"):
            continue
        original, current_states = (
            sub._set_main_param_and_optimizer_states,
            sub._get_main_param_and_optimizer_states,
        )

        def set_states(model_param, tensors, original=original, current_states=current_states):
            kept = {k: v for k, v in current_states(model_param).items() if k == "step" and k not in tensors}
            original(model_param, {**tensors, **kept})

        sub._set_main_param_and_optimizer_states = set_states
        patched.append(sub)
    try:
        yield
    finally:
        for sub in patched:
            del sub._set_main_param_and_optimizer_states  # the class's method again


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


def _sharded_state(
    model, optimizer, optimizer_format: str, is_loading: bool, with_rng: bool
) -> dict[str, Any]:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    # The bare GPTModel's keys (no DDP / Float16Module prefixes), as Megatron-LM saves them.
    model_state = unwrap_model(model).sharded_state_dict()
    # Without its own gather on the CPU the default (every rank gathers) moves the state to CUDA first; the
    # memory-efficient gather holds the whole state on each data-parallel group's first rank only.
    metadata = {
        "distrib_optim_sharding_type": optimizer_format,
        "distrib_optim_fully_reshardable_mem_efficient": True,
    }
    state = {
        "model": model_state,
        "optimizer": _without_empty_param_state(
            optimizer.sharded_state_dict(model_state, is_loading=is_loading, metadata=metadata)
        ),
    }
    if with_rng:
        # Each rank's RNG streams are its own (tensor-parallel dropout, expert initialisation): one shard a rank.
        state["rng"] = ShardedObject(
            "rng_state", _rng_state(), (dist.get_world_size(),), (dist.get_rank(),), replica_id=0
        )
    return state


def _without_empty_param_state(tree):
    """The memory-efficient gather leaves ``param_state`` None on all but each data-parallel group's first rank:
    dropped, so that every rank's common (non-sharded) state is the same (dist_checkpointing warns otherwise)."""
    if isinstance(tree, dict):
        return {
            k: _without_empty_param_state(v)
            for k, v in tree.items()
            if not (k == "param_state" and v is None)
        }
    return tree


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


def _reseed(seed: int) -> None:
    """Every stream from ``seed``, as start-up seeds them (Megatron's per-rank offsets for the tracker's)."""
    random.seed(seed)
    np.random.seed(seed)
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed)
    else:
        from .cpu import model_parallel_cpu_manual_seed

        model_parallel_cpu_manual_seed(seed)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
