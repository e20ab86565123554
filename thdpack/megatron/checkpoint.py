"""Checkpoints with Megatron's distributed checkpointing, in Megatron's layout.

``<dir>/iter_0000042/`` holds one checkpoint (model and distributed-optimizer shards, the scheduler, every
rank's RNG states, the data position, the parallel layout it was saved on); ``<dir>/latest_checkpointed_iteration.txt``
names the latest complete one. A save writes ``iter_0000042.partial/`` first, ends it with ``manifest.json`` (every
file's size and CRC-32, :mod:`thdpack.megatron.checkpoint_manifest`) and renames it once every rank has written its
part; only then does the tracker move (written to a temporary file and renamed). A process killed mid-save leaves
the tracker on the previous checkpoint; a disk that fills up mid-save raises :class:`CheckpointWriteError`, says so
and removes the half-written files. A resume verifies the manifest and passes over a damaged checkpoint for the
newest complete one (:func:`choose_resume`). Every file is read without running code from it
(:mod:`thdpack.megatron.checkpoint_reader`); the RNG states are saved as tensors and plain values for that.

A checkpoint loads on another DP/TP/PP/CP/EP layout when its optimizer state is ``fully_reshardable`` (the
default, :mod:`thdpack.megatron.parallel_layout` says what may change); the data position is global, the model's
tensors are global, and the per-rank RNG states are re-seeded from the recipe's seed when the layout changed.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import random
import shutil
import signal
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .checkpoint_dir import (
    TRACKER,
    CheckpointWriteError,
    ResumePoint,
    checkpoint_path,
    iterations,
    resume_point,
    tracked_iteration,
)
from .checkpoint_manifest import Damage, checksums, my_files, verify, write_manifest
from .checkpoint_reader import (
    SafeCommonLoad,
    SafeTorchDistLoad,
    check_format,
    extra_states_loading,
    read_common,
    read_dcp_metadata,
)
from .host_group import all_gather_host
from .lora import adapter_modules, check_loaded_keys, trainable_state
from .models import unwrap_model
from .parallel_layout import OPTIMIZER_FORMATS, ParallelLayout, check_resumable

__all__ = [
    "TRACKER",
    "CheckpointWriteError",
    "check_optimizer_format",
    "checkpoint_path",
    "choose_resume",
    "latest_iteration",
    "load_checkpoint",
    "resume_vocab_size",
    "save_checkpoint",
    "saved_metadata",
    "set_aside",
]

# For tests only: THDPACK_TEST_KILL_BEFORE_RENAME=<iteration> SIGKILLs every rank in the save of that iteration once
# all its files are written, before the rename (tests/functional/test_resume.py: a kill -9 mid-save, made
# deterministic).
KILL_BEFORE_RENAME = "THDPACK_TEST_KILL_BEFORE_RENAME"
log = logging.getLogger("thdpack")


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


def choose_resume(directory: str | os.PathLike | None) -> ResumePoint | None:
    """The checkpoint under ``directory`` to resume from (:func:`thdpack.megatron.checkpoint_dir.resume_point`):
    every file of it checked against its manifest, each rank summing the shards it would have written (collective
    over the world when one is running). Remembered for the directory as it is (one verification a start-up)."""
    if directory is None or not Path(directory).is_dir():
        return None
    key = (str(Path(directory).resolve()), tracked_iteration(directory), tuple(iterations(directory)))
    if key not in _chosen:
        _chosen.clear()
        _chosen[key] = resume_point(directory, check=_verify_together)
    return _chosen[key]


_chosen: dict[tuple, ResumePoint | None] = {}


def _verify_together(path: Path) -> Damage | None:
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    share = my_files(path, rank, world) if path.is_dir() else []
    found = all_gather_host(verify(path, share))
    return next((damage for damage in found if damage is not None), None)


def saved_metadata(directory: str | os.PathLike | None) -> dict[str, Any] | None:
    """thdpack's metadata of the checkpoint a run in ``directory`` resumes from (iteration, layout, optimizer
    format, vocabulary size, data position, recipe), or None when there is none. Reads one small file."""
    point = choose_resume(directory)
    return None if point is None else dict(read_common(point.path)["thdpack"])


def resume_vocab_size(directory: str | os.PathLike | None, vocab_size: int, tp: int, explicit: bool) -> int:
    """The padded vocabulary size to build the model with: ``vocab_size`` (the recipe's rule, 128 x TP padding),
    or, when resuming and the recipe leaves ``model.vocab_size`` unset (``explicit`` False), the size the
    checkpoint was saved with: a TP change must not change the embedding's rows."""
    try:
        saved = (saved_metadata(directory) or {}).get("vocab_size") if not explicit else None
    except ValueError:  # a damaged or unsafe checkpoint: the resume names it
        saved = None
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
    partial = final.with_name(final.name + ".partial")
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # a save of this iteration that was killed
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
    try:
        dist_checkpointing.save(state, str(partial))
        dist.barrier()
        # each rank sums the shards it wrote (still in its page cache); rank 0 writes the manifest last
        sums = all_gather_host(checksums(partial, my_files(partial, rank, dist.get_world_size())))
        if rank == 0:
            files = {name: entry for part in sums for name, entry in part.items()}
            leftover = set(my_files(partial, 0)) - set(files)  # world 1: every file; any no rank claimed
            files.update(checksums(partial, leftover))
            write_manifest(partial, files, iteration, _writer())
    except BaseException as error:  # torch's CheckpointException is a BaseException
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        if _disk_full(error, Path(directory)):
            raise CheckpointWriteError(_disk_full_message(directory, iteration, partial)) from error
        raise
    dist.barrier()
    if os.environ.get(KILL_BEFORE_RENAME) == str(iteration):
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)  # one this run replaces (damaged, or set aside by a resume)
        os.replace(partial, final)
        _write_tracker(Path(directory), iteration)
    dist.barrier()
    return final


def _writer() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "world": dist.get_world_size()}


def _write_tracker(directory: Path, iteration: int | None) -> None:
    tracker = directory / TRACKER
    if iteration is None:
        tracker.unlink(missing_ok=True)
    else:
        temporary = tracker.with_suffix(".tmp")
        with open(temporary, "w") as f:
            f.write(f"{iteration}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, tracker)
    _fsync_dir(directory)


def _disk_full(error: BaseException, directory: Path) -> bool:
    """ENOSPC anywhere in the exception's chain (megatron-core re-raises a writer process's error as its cause;
    torch's zip writer reports a full disk only as "unexpected pos"), or a file system with almost nothing free."""
    seen, stack = set(), [error]
    while stack:
        e = stack.pop()
        e = e[0] if isinstance(e, tuple) and e else e  # torch's (exception, traceback) of a rank
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if (isinstance(e, OSError) and e.errno == errno.ENOSPC) or "No space left on device" in str(e):
            return True
        stack += [e.__cause__, e.__context__, *getattr(e, "failures", {}).values()]
    with contextlib.suppress(OSError):
        return shutil.disk_usage(directory).free < (1 << 20)
    return False


def _disk_full_message(directory, iteration: int, partial: Path) -> str:
    kept = tracked_iteration(directory)
    kept_text = (
        f"the previous checkpoint, {checkpoint_path(directory, kept)}, is kept and the same command resumes from it"
        if kept is not None
        else "no earlier checkpoint exists in it"
    )
    return (
        f"no space left on device while saving the checkpoint of iteration {iteration} to {partial} (its files "
        f"were removed): {kept_text}. Free space on that file system (a checkpoint of this run takes about "
        f"{_size_text(directory)}) or set another checkpoint.dir"
    )


def _size_text(directory) -> str:
    sizes = [
        sum(f.stat().st_size for f in checkpoint_path(directory, i).iterdir() if f.is_file())
        for i in iterations(directory)[:1]
    ]
    return f"{sizes[0] / 2**30:.2f} GiB" if sizes else "as much as the model and its optimizer state"


def set_aside(directory: str | os.PathLike, iteration: int, label: str) -> tuple[Path, int | None]:
    """Rename the checkpoint of ``iteration`` to ``iter_XXXXXXX.<label>`` (kept for a look, never resumed from)
    and point the tracker at the newest checkpoint left (none: removed). Returns the new name and that
    iteration. Call it on one rank."""
    directory = Path(directory)
    path = checkpoint_path(directory, iteration)
    aside = path.with_name(f"{path.name}.{label}")
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(path, aside)
    left = iterations(directory)
    _write_tracker(directory, left[0] if left else None)
    return aside, (left[0] if left else None)


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
    directory: str | os.PathLike,
    iteration: int,
    model,
    optimizer,
    scheduler,
    seed: int,
    model_recipe: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Load the checkpoint of ``iteration`` into ``model``, ``optimizer`` and ``scheduler`` and return the
    ``extra`` state saved with it (plus ``iteration``). On the layout it was saved on, this rank's RNG states are
    restored; on another one they are re-seeded from ``seed + iteration`` (they are per rank). A checkpoint that
    cannot load on this layout, whose vocabulary has another padded size, or whose tensors have other shapes than
    the model's (naming them, and the keys of ``model_recipe`` that differ from the saved run's ``recipe.model``)
    is refused before anything loads. Nothing but tensors and plain data is read from its files."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException

    path = checkpoint_path(directory, iteration)
    check_format(path)
    saved = read_common(path)["thdpack"]
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
    saved_recipe = saved.get("recipe", {}).get("model")
    _check_shapes(state["model"], path, saved_recipe, model_recipe)
    try:
        loaded = dist_checkpointing.load(
            state, str(path), sharded_strategy=SafeTorchDistLoad(), common_strategy=SafeCommonLoad()
        )
    except CheckpointingException as error:  # a shape _check_shapes cannot see (a tensor built at load)
        keys = _recipe_differences(saved_recipe, model_recipe, "model")
        raise ValueError(f"{path}: {error}" + (f" (the keys that differ: {keys})" if keys else "")) from None
    _load_model_state(unwrap_model(model), loaded["model"], path)
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


def _load_model_state(module, state: Mapping[str, Any], path: Path) -> None:
    """The loaded model tensors into ``module``: all of them, or under LoRA the adapters (and buffers), every
    other key being a frozen base parameter (:func:`thdpack.megatron.lora.check_loaded_keys`). Transformer
    Engine's extra states are read through the allow-list first (:func:`extra_states_loading`)."""
    lora = bool(adapter_modules(module))
    with extra_states_loading(state, path):
        result = module.load_state_dict(state, strict=not lora)
    if not lora:
        return
    check_loaded_keys(result.missing_keys, result.unexpected_keys, module, str(path))


def _check_shapes(model_state, path: Path, saved_recipe, recipe) -> None:
    """The model's tensors against the checkpoint's (global shapes, from its ``.metadata``)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = read_dcp_metadata(path / ".metadata").state_dict_metadata
    differ = []
    for tensor in nested_values(model_state):
        if not isinstance(tensor, ShardedTensor) or tensor.allow_shape_mismatch:
            continue
        found = saved.get(tensor.key)
        if not isinstance(found, TensorStorageMetadata):
            differ.append(f"{tensor.key}: not in the checkpoint")
        elif tuple(found.size) != tuple(tensor.global_shape):
            differ.append(f"{tensor.key}: saved {list(found.size)}, this model {list(tensor.global_shape)}")
    differ = sorted(set(differ))
    if not differ:
        return
    more = f" and {len(differ) - 3} more" if len(differ) > 3 else ""
    keys = _recipe_differences(saved_recipe, recipe, "model")
    raise ValueError(
        f"{path} holds another model than this run builds ({'; '.join(differ[:3])}{more}): "
        + (f"the keys that differ from the run that saved it: {keys}. " if keys else "")
        + "Resume with the model recipe it was saved with, or start in a new checkpoint.dir"
    )


def _recipe_differences(saved, mine, prefix: str) -> str:
    """``key (saved X, now Y)`` for each leaf of two recipe groups that differs."""
    if not isinstance(saved, Mapping) or not isinstance(mine, Mapping):
        return ""
    out = []
    for key in sorted(set(saved) | set(mine), key=str):
        a, b = saved.get(key), mine.get(key)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            inner = _recipe_differences(a, b, f"{prefix}.{key}")
            out += [inner] if inner else []
        elif a != b:
            out.append(f"{prefix}.{key} (saved {a!r}, now {b!r})")
    return ", ".join(out)


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
    module = unwrap_model(model)
    model_state = module.sharded_state_dict()
    if adapter_modules(module):  # LoRA: what training changes; the frozen base is the run's model.pretrained
        model_state = trainable_state(model_state, module)
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
    """This rank's random streams as tensors and plain values (a checkpoint is read with weights_only=True)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    version, internal, gauss = random.getstate()
    _, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    state = {
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    python, numpy = state["python"], state["numpy"]
    if isinstance(python, tuple):  # saved before the states were tensors: Python's and numpy's own tuples
        random.setstate(python)
        np.random.set_state(numpy)
    else:
        random.setstate((python["version"], tuple(python["state"].tolist()), python["gauss"]))
        keys = numpy["keys"].numpy().astype(np.uint32)
        np.random.set_state(("MT19937", keys, numpy["pos"], numpy["has_gauss"], numpy["cached_gaussian"]))
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
