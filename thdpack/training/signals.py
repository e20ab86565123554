"""Signals that ask a run to stop: noted from the moment ``python -m thdpack.train`` starts, acted on at the end of a
step (:class:`thdpack.training.stopping.EarlyStop` turns them into one decision for every rank).

- SIGTERM (what SLURM sends at a time limit or preemption without ``--signal``, and Kubernetes at eviction), SIGUSR1
  (``#SBATCH --signal=B:USR1@300``) and a first SIGINT (Ctrl-C): save a checkpoint after the current step and exit 0;
- a second SIGINT: stop at once (:class:`StopNow`), without a save.

A handler runs between two bytecodes of the main thread, anywhere in a step (also inside a collective): it only
notes the signal.
"""

from __future__ import annotations

import logging
import signal

__all__ = ["REASONS", "STOP_SIGNALS", "StopNow", "install", "requested", "uninstall"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
REASONS = {
    signal.SIGUSR1: "the scheduler's warning",
    signal.SIGTERM: "a request to terminate",
    signal.SIGINT: "an interrupt; a second one stops at once",
}


class StopNow(KeyboardInterrupt):
    """A second SIGINT: the run stops where it is."""


class _Requests:
    def __init__(self):
        self.first: int | None = None  # the first stop signal noted
        self.interrupts = 0
        self.installs = 0
        self.previous: dict = {}

    def note(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            self.interrupts += 1
            if self.interrupts > 1:
                raise StopNow("a second SIGINT: stopping at once, without a checkpoint")
        if self.first is None:
            self.first = signum
            logging.getLogger("thdpack").info(
                "%s: saving a checkpoint after this step, then stopping", signal.Signals(signum).name
            )


_requests = _Requests()


def install() -> None:
    """Note :data:`STOP_SIGNALS` from now on (nested calls count; :func:`uninstall` undoes one)."""
    if _requests.installs == 0:
        _requests.previous = {sig: signal.signal(sig, _requests.note) for sig in STOP_SIGNALS}
    _requests.installs += 1


def uninstall() -> None:
    """Undo one :func:`install`; the last gives every signal its previous handler back and forgets what was noted."""
    _requests.installs -= 1
    if _requests.installs == 0:
        for sig, handler in _requests.previous.items():
            signal.signal(sig, handler)
        _requests.first, _requests.interrupts = None, 0


def requested() -> int | None:
    """The first stop signal received since :func:`install` (its number), or None."""
    return _requests.first
