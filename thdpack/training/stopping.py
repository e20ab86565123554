"""Stopping early with a checkpoint: on a stop signal (:mod:`thdpack.training.signals`: SIGTERM, SIGUSR1 as
``#SBATCH --signal=B:USR1@300`` in launch/slurm.sbatch sends it, a first SIGINT) or once
``trainer.exit_duration_mins`` have passed.

    stop = EarlyStop(exit_duration_mins=230)   # first thing in a run: the handler only sets a flag
    ...                                        # each step
    reason = stop.agreed()                     # every rank gets the same answer, at the end of the same step
    if reason:
        save(iteration); stop.record(run_dir, iteration, ckpt_dir, write=logging_rank); break

A signal reaches the ranks at different moments (one may be inside a collective): each rank only notes it, and the
ranks agree at the end of each step with one all-reduce of two host ints over gloo (the world group on CPU, a gloo
group beside NCCL on GPU: no device sync, ``benchmarks/stop_check.py`` measures it). Every rank then stops after the
same step, saves, and the run exits 0. A stop on SIGTERM, SIGUSR1 or the time leaves ``stopped_early.json`` in the
run directory, which tells launch/slurm.sbatch to requeue the job; one on SIGINT (a person asking it to stop)
does not.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from thdpack.megatron.host_group import host_group

from . import signals

__all__ = ["EXIT_SIGNAL", "MARKER", "EarlyStop"]

log = logging.getLogger("thdpack")

EXIT_SIGNAL = signal.SIGUSR1
MARKER = "stopped_early.json"


class EarlyStop:
    """Notes the stop signals from now on (those noted since ``python -m thdpack.train`` started count too) and
    measures the run's minutes (``exit_duration_mins``: stop once this many have passed; None: never).
    :meth:`close` restores the signals' previous handlers."""

    def __init__(self, exit_duration_mins: float | None = None):
        if exit_duration_mins is not None and not float(exit_duration_mins) > 0:
            raise ValueError(
                f"trainer.exit_duration_mins is {exit_duration_mins}: it must be a positive number of minutes "
                "(or null)"
            )
        self.exit_duration_mins = None if exit_duration_mins is None else float(exit_duration_mins)
        self.started = time.monotonic()
        signals.install()

    @property
    def signalled(self) -> bool:
        return signals.requested() is not None

    def agreed(self) -> str | None:
        """Why every rank stops after this step (a signal, or the time), or None; collective over the world."""
        late = self.exit_duration_mins is not None and self.minutes() >= self.exit_duration_mins
        flags = torch.tensor([signals.requested() or 0, int(late)], dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=host_group())
        signum, late = flags.tolist()
        if signum:
            name = signal.Signals(signum)
            return f"{name.name} ({signals.REASONS[name]})"
        if late:
            return f"trainer.exit_duration_mins={self.exit_duration_mins:g} passed"
        return None

    def minutes(self) -> float:
        return (time.monotonic() - self.started) / 60

    def record(
        self, run_dir: Path, iteration: int, reason: str, ckpt_dir, write: bool, saved: bool = True
    ) -> None:
        """Say why the run stops; ``write``: leave the marker (one rank) when there is a checkpoint to resume
        from, unless a person interrupted the run; ``saved``: whether this step's state was saved (else the
        checkpoint before it is the one to resume from). Collective: no rank exits before the marker is written
        (a launcher may end the others then)."""
        if ckpt_dir is None:
            log.warning(
                "stopping after iteration %d on %s without a checkpoint: checkpoint.dir is not set, so the run "
                "cannot resume",
                iteration,
                reason,
            )
        else:
            log.info(
                "stopping after iteration %d on %s: %s; the same command resumes from it",
                iteration,
                reason,
                f"checkpoint saved to {ckpt_dir}"
                if saved
                else f"the latest checkpoint in {ckpt_dir} is older",
            )
            if write and not reason.startswith(signal.SIGINT.name):
                marker = {"iteration": iteration, "reason": reason, "checkpoint_dir": str(ckpt_dir)}
                (Path(run_dir) / MARKER).write_text(json.dumps(marker) + "\n")
        dist.barrier()

    def close(self) -> None:
        signals.uninstall()
