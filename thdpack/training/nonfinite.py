"""Non-finite steps (a held-back update, :class:`thdpack.megatron.device_step.OptimizerStep`) once the host learns
of them: ``trainer.on_nonfinite=error`` stops at the first, ``skip`` goes on until ``trainer.max_consecutive_skips``
updates in a row were held back (the run has diverged), then stops.

While updates are being held back the weights are those that gave a non-finite step: no checkpoint is written
from them (:attr:`NonfiniteGuard.unsaveable` says why). When the run stops on a non-finite step, the tracked
checkpoint of the iteration just before the first held-back step holds the weights that gave it: it is set aside
as ``iter_XXXXXXX.nonfinite`` (kept, never resumed from) and the tracker moves back to the checkpoint before it.
"""

from __future__ import annotations

import logging

import torch.distributed as dist

__all__ = ["NonfiniteGuard"]

log = logging.getLogger("thdpack")


class NonfiniteGuard:
    def __init__(self, mode: str, max_consecutive_skips: int, checkpoint_dir):
        self.mode, self.limit, self.directory = mode, int(max_consecutive_skips), checkpoint_dir
        self.streak = 0  # updates held back in a row, up to the last step settled
        self.first = None  # the first step of that streak

    @property
    def unsaveable(self) -> str | None:
        """Why the current state must not be saved, or None."""
        if not self.streak:
            return None
        return (
            f"its last {self.streak} update(s) were held back (non-finite, from step {self.first} on): the weights "
            "that gave them are not kept"
        )

    def settled(self, step: int, message: str | None) -> None:
        """Step ``step`` is known: ``message`` says how it was not finite, None when it was. Raises
        FloatingPointError when the run stops on it."""
        if message is None:
            self.streak, self.first = 0, None
            return
        self.streak += 1
        self.first = self.first or step
        if self.mode == "error":
            self._stop(message + " (trainer.on_nonfinite=skip drops such updates and goes on)")
        if self.streak >= self.limit:
            self._stop(
                f"{message}: {self.streak} updates in a row held back (trainer.max_consecutive_skips={self.limit}), "
                "the run has diverged"
            )
        log.warning("%s: update skipped", message)

    def _stop(self, message: str) -> None:
        raise FloatingPointError(message + self._set_aside())

    def _set_aside(self) -> str:
        """Every rank settles the same step (the norm is global): rank 0 moves the files, the others hear of it."""
        from thdpack.megatron.checkpoint import set_aside
        from thdpack.megatron.checkpoint_dir import tracked_iteration
        from thdpack.megatron.host_group import broadcast_host

        note = ""
        before = self.first - 1
        if (
            dist.get_rank() == 0
            and self.directory is not None
            and tracked_iteration(self.directory) == before
        ):
            aside, latest = set_aside(self.directory, before, "nonfinite")
            now = f"iteration {latest}" if latest is not None else "none"
            note = (
                f". The checkpoint of iteration {before} holds the weights that gave step {self.first}: set aside "
                f"as {aside} (never resumed from; the latest checkpoint is now {now})"
            )
        return broadcast_host(note)
