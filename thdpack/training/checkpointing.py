"""The run's side of its checkpoints (:mod:`thdpack.megatron.checkpoint` writes and reads them):

    check_checkpoint_dir(cfg.checkpoint.dir)         # every rank, before set-up: a directory that can be written
    checkpoints = RunCheckpoints(run, run_dir, fmt)  # after set-up: the lock, leftovers removed, free space
    iteration = checkpoints.resume()                 # the newest complete checkpoint, checked against the recipe
    checkpoints.save(iteration)                      # "saved" only for what this run wrote
    checkpoints.close()

What a resume checks before step 1: the checkpoint's files (its manifest; a damaged one is passed over for the
newest complete one, said in the log), the model's tensor shapes (naming the ``model.*`` keys that differ from the
run that saved it), and the data set (``dataset.*`` keys, the number of samples, ``trainer.seed``): another data set
is refused unless ``checkpoint.allow_dataset_change=true``, which restarts the data position.
"""

from __future__ import annotations

import atexit
import functools
import logging
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from omegaconf import OmegaConf

from .config_error import ConfigError

if TYPE_CHECKING:
    from .loop import Run

__all__ = ["DATASET_KEYS", "RunCheckpoints", "check_checkpoint_dir", "checkpoint_bytes"]

log = logging.getLogger("thdpack")

# What a checkpoint records of the data set: a data position means nothing on another one. The samples themselves
# are known by a fingerprint (their number, a CRC-32 of the tokens of FINGERPRINT_SAMPLES of them) so that files
# moved elsewhere (dataset.path, dataset.tokenizer) are the same data set; those keys are named when it differs.
DATASET_KEYS = ("name", "path", "tokenizer", "chat_template_kwargs", "max_files", "synthetic", "shuffle")
WHERE_KEYS = ("path", "tokenizer")
FINGERPRINT_SAMPLES = 8
# Bytes a checkpoint holds per parameter besides the weights: the distributed optimizer's fp32 main copy and
# Adam's two fp32 moments (measured: tiny_gpt in fp32, 492,160 parameters, 8.0 MB = 16.3 bytes a parameter).
OPTIMIZER_BYTES = 12


def check_checkpoint_dir(directory) -> None:
    """``checkpoint.dir`` exists or can be made, and can be written: checked on every rank before set-up."""
    from thdpack.megatron.checkpoint_dir import unusable

    if directory is None:
        return
    problem = unusable(directory)
    if problem:
        raise ConfigError(f"checkpoint.dir={directory} cannot hold checkpoints: {problem}")


def checkpoint_bytes(model: Mapping, vocab_size: int, precision: str) -> int:
    """About how many bytes one checkpoint of the model that ``model`` (the recipe's group) describes takes."""
    from .memory import parameter_count

    weight_bytes = 4 if precision == "fp32" else 2
    return parameter_count(model, vocab_size).total * (weight_bytes + OPTIMIZER_BYTES)


class RunCheckpoints:
    """The checkpoints of one run: it holds ``checkpoint.dir``'s lock from construction (collective) to
    :meth:`close` (or the process's exit)."""

    def __init__(self, run: Run, run_dir: Path, optimizer_format: str):
        from thdpack.megatron.checkpoint_dir import DirInUse, DirLock, remove_partials
        from thdpack.megatron.host_group import broadcast_host

        self.run, self.optimizer_format = run, optimizer_format
        self.directory = run.cfg.checkpoint.dir
        self.resumed_from: int | None = None
        self.lock = None
        if self.directory is None:
            return
        refused = None
        if dist.get_rank() == 0:
            try:
                self.lock = DirLock.claim(self.directory, run_dir)
                atexit.register(self.close)
            except DirInUse as error:
                refused = str(error)
        refused = broadcast_host(refused)
        if refused:
            raise ConfigError(refused)
        if self.lock is not None:
            if self.lock.took_over:
                log.warning("checkpoint.dir %s: took over its lock (%s)", self.directory, self.lock.took_over)
            for path in remove_partials(self.directory):
                log.warning("checkpoint.dir: removed %s, left by a save that did not finish", path)
            self._warn_if_short_of_space()

    def _warn_if_short_of_space(self) -> None:
        from thdpack.megatron.models import unwrap_model

        cfg = self.run.cfg
        module = unwrap_model(self.run.model)
        need = checkpoint_bytes(cfg.model, int(module.vocab_size), self.run.runtime.precision)
        if self.peft is not None:  # LoRA: the adapters and their optimizer state, not the frozen base
            need = sum(p.numel() for p in module.parameters() if p.requires_grad) * (4 + OPTIMIZER_BYTES)
        free = shutil.disk_usage(self.directory).free
        if free < need:
            log.warning(
                "checkpoint.dir %s has %.2f GiB free, and one checkpoint of this model takes about %.2f GiB: a save "
                "may fail (the previous checkpoint is kept if it does)",
                self.directory,
                free / 2**30,
                need / 2**30,
            )

    @functools.cached_property
    def recipe(self) -> dict[str, Any]:
        """What a checkpoint records of the recipe, to check a resume against (plain data; once a run)."""
        cfg, data = self.run.cfg, self.run.data
        dataset = {k: _plain(cfg.dataset.get(k)) for k in DATASET_KEYS}
        dataset |= {
            "samples": len(data.dataset),
            "fingerprint": fingerprint(data.dataset),
            "trainer.seed": int(cfg.trainer.seed),
        }
        return {"model": _plain(cfg.model), "dataset": dataset}

    @functools.cached_property
    def peft(self) -> dict[str, Any] | None:
        """A LoRA run's adapters and base, as its checkpoints record them (:func:`thdpack.models.lora.peft_record`);
        None without LoRA."""
        from thdpack.models.lora import lora_enabled, peft_record

        cfg = self.run.cfg
        return peft_record(cfg.peft, cfg.model) if lora_enabled(cfg.get("peft")) else None

    def resume(self) -> int:
        """Load the checkpoint to resume from, if any; return its iteration (0: none)."""
        from thdpack.megatron.checkpoint import choose_resume, load_checkpoint
        from thdpack.megatron.checkpoint_reader import read_common
        from thdpack.models.lora import check_resume

        run = self.run
        try:
            point = choose_resume(self.directory)
            if point is None:
                return 0
            if run.logging_rank:
                for note in point.passed_over:
                    log.warning("checkpoint.dir: %s: passed over", note)
                if point.passed_over:
                    log.warning("resuming from %s, the newest complete checkpoint", point.path)
                if not point.verified:
                    log.warning(
                        "%s has no manifest.json (an older thdpack's): its files are not checked", point.path
                    )
            recipe = self.recipe
            # a LoRA checkpoint holds adapters that mean something on their own settings and base only
            check_resume(read_common(point.path)["thdpack"], self.peft, str(point.path))
            state = load_checkpoint(
                self.directory,
                point.iteration,
                run.model,
                run.optimizer,
                run.scheduler,
                seed=int(run.cfg.trainer.seed),
                model_recipe=recipe["model"],
            )
            self._restore_data(state, point.path, recipe["dataset"])
        except ValueError as error:  # a damaged or unsafe file, another model or data set: named
            raise ConfigError(str(error)) from None
        self.resumed_from = int(state["iteration"])
        log.info("resumed from %s at iteration %d", self.directory, self.resumed_from)
        return self.resumed_from

    def _restore_data(self, state: Mapping, path: Path, dataset: Mapping) -> None:
        saved = (state.get("recipe") or {}).get("dataset")
        differ = _differences(saved, dataset) if saved is not None else []
        if differ and all(d.split(" ")[0].removeprefix("dataset.") in WHERE_KEYS for d in differ):
            log.info(
                "data: the same samples as %s was saved on, from elsewhere (%s)", path, ", ".join(differ)
            )
            differ = []
        data_state = state["data"]
        if saved is None:  # an older thdpack's checkpoint: the loader checks the sample count and seed
            differ = [
                f"{key} (saved {data_state.get(key)}, now {mine})"
                for key, mine in (("samples", dataset["samples"]), ("trainer.seed", dataset["trainer.seed"]))
                if data_state.get("dataset_size" if key == "samples" else "seed") != mine
            ]
        if not differ:
            self.run.data.load_state_dict(data_state)
            return
        if self.run.cfg.checkpoint.get("allow_dataset_change", False):
            log.warning(
                "data: checkpoint.allow_dataset_change=true and the data set differs from the one %s was saved on "
                "(%s): the data position starts over on this one (the checkpoint's had consumed %d samples); model, "
                "optimizer and schedule carry over",
                path,
                ", ".join(differ),
                int(data_state.get("consumed", 0)),
            )
            return
        raise ConfigError(
            f"{path} was saved on another data set: {', '.join(differ)}; its data position would not continue its "
            "sample order. Set checkpoint.allow_dataset_change=true to train on this data set from its start "
            "(model, optimizer and schedule carry over), or resume with the data set it was saved on"
        )

    def save(self, iteration: int, may_save: str | None = None) -> bool:
        """Save the checkpoint of ``iteration``; ``may_save``: why not to (the state is not one to keep), logged.
        True when a checkpoint of this run's state at ``iteration`` is on disk afterwards."""
        from thdpack.megatron.checkpoint import save_checkpoint

        if self.directory is None:
            return False
        if may_save is not None:
            log.warning("not saving the checkpoint of iteration %d: %s", iteration, may_save)
            return False
        if iteration == self.resumed_from:
            log.info(
                "the checkpoint of iteration %d is the one this run resumed from, and nothing was trained since",
                iteration,
            )
            return True
        run = self.run
        extra = {"data": run.data.state_dict(), "recipe": self.recipe}
        if self.peft is not None:
            extra["peft"] = self.peft
        save_checkpoint(
            self.directory,
            iteration,
            run.model,
            run.optimizer,
            run.scheduler,
            extra,
            optimizer_format=self.optimizer_format,
        )
        log.info("saved checkpoint of iteration %d to %s", iteration, self.directory)
        return True

    def close(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def fingerprint(dataset) -> str:
    """CRC-32 of the tokens (and target masks) of :data:`FINGERPRINT_SAMPLES` samples spread over ``dataset``."""
    import zlib

    import numpy as np

    n = len(dataset)
    value = 0
    for index in sorted({int(i) for i in np.linspace(0, n - 1, min(n, FINGERPRINT_SAMPLES))}):
        sample = dataset[index]
        value = zlib.crc32(np.asarray(sample.tokens, dtype=np.int64).tobytes(), value)
        if sample.target_mask is not None:
            value = zlib.crc32(np.asarray(sample.target_mask, dtype=np.bool_).tobytes(), value)
    return f"{value:08x}"


def _plain(value):
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def _differences(saved: Mapping, mine: Mapping) -> list[str]:
    keys = sorted(set(saved) | set(mine))
    named = {k: k if k in ("samples", "fingerprint", "trainer.seed") else f"dataset.{k}" for k in keys}
    return [
        f"{named[k]} (saved {saved.get(k)!r}, now {mine.get(k)!r})"
        for k in keys
        if saved.get(k) != mine.get(k)
    ]
