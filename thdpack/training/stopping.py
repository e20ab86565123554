"""Stopping early with a checkpoint: on the scheduler's warning signal (SIGUSR1, ``#SBATCH --signal=B:USR1@300``
in launch/slurm.sbatch) or once ``trainer.exit_duration_mins`` have passed.

    stop = EarlyStop(exit_duration_mins=230)   # first thing in a run: the handler only sets a flag
    ...                                        # each step
    reason = stop.agreed()                     # every rank gets the same answer, at the end of the same step
    if reason:
        save(iteration); stop.record(run_dir, iteration, ckpt_dir, write=logging_rank); break

A signal reaches the ranks at different moments (one may be inside a collective): each rank only notes it, and the
ranks agree at the end of each step with one all-reduce of two host ints over gloo (the world group on CPU, a gloo
group beside NCCL on GPU: no device sync). Every rank then stops after the same step, saves, and the run exits 0
leaving ``stopped_early.json`` in the run directory, which tells launch/slurm.sbatch to requeue the job.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

__all__ = ["EXIT_SIGNAL", "MARKER", "EarlyStop"]

log = logging.getLogger("thdpack")

EXIT_SIGNAL = signal.SIGUSR1
MARKER = "stopped_early.json"


class EarlyStop:
    """Notes :data:`EXIT_SIGNAL` from now on and measures the run's minutes (``exit_duration_mins``: stop once
    this many have passed; None: never). :meth:`close` restores the signal's previous handler."""

    def __init__(self, exit_duration_mins: float | None = None):
        if exit_duration_mins is not None and not float(exit_duration_mins) > 0:
            raise ValueError(
                f"trainer.exit_duration_mins is {exit_duration_mins}: it must be a positive number of minutes "
                "(or null)"
            )
        self.exit_duration_mins = None if exit_duration_mins is None else float(exit_duration_mins)
        self.started = time.monotonic()
        self.signalled = False
        self._group = None
        self._previous = signal.signal(EXIT_SIGNAL, self._note)

    def _note(self, signum, frame) -> None:
        # Python runs this between bytecodes of the main thread, anywhere in a step: note it, nothing more.
        self.signalled = True

    def agreed(self) -> str | None:
        """Why every rank stops after this step (the signal, or the time), or None; collective over the world."""
        if self._group is None:
            self._group = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        late = self.exit_duration_mins is not None and self.minutes() >= self.exit_duration_mins
        flags = torch.tensor([int(self.signalled), int(late)], dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group)
        signalled, late = flags.tolist()
        if signalled:
            return f"{EXIT_SIGNAL.name} (the scheduler's warning)"
        if late:
            return f"trainer.exit_duration_mins={self.exit_duration_mins:g} passed"
        return None

    def minutes(self) -> float:
        return (time.monotonic() - self.started) / 60

    def record(self, run_dir: Path, iteration: int, reason: str, ckpt_dir, write: bool) -> None:
        """Say why the run stops; ``write``: leave the marker (one rank) when a checkpoint was saved to resume
        from. Collective: no rank exits before the marker is written (a launcher may end the others then)."""
        if ckpt_dir is None:
            log.warning(
                "stopping after iteration %d on %s without a checkpoint: checkpoint.dir is not set, so the run "
                "cannot resume",
                iteration,
                reason,
            )
        else:
            log.info(
                "stopping after iteration %d on %s: checkpoint saved to %s; the same command resumes from it",
                iteration,
                reason,
                ckpt_dir,
            )
            if write:
                marker = {"iteration": iteration, "reason": reason, "checkpoint_dir": str(ckpt_dir)}
                (Path(run_dir) / MARKER).write_text(json.dumps(marker) + "\n")
        dist.barrier()

    def close(self) -> None:
        signal.signal(EXIT_SIGNAL, self._previous)
