"""The one error a recipe that cannot run raises at start-up (every check module raises it), and how the entry
points end on it: the message alone, once, and exit code 2."""

from __future__ import annotations

import os
import sys
import time
from typing import NoReturn

__all__ = ["ConfigError", "exit_with"]

RANK0_GRACE_S = 3.0


class ConfigError(ValueError):
    """A recipe that cannot run; the message names the keys and what to change.

    ``every_rank``: the message may differ between ranks (what one GPU has free), so every rank prints its own;
    otherwise every rank finds the same error and only rank 0 prints it.
    """

    def __init__(self, message: str, *, every_rank: bool = False):
        super().__init__(message)
        self.every_rank = every_rank


def exit_with(error: ConfigError | str, program: str = "thdpack") -> NoReturn:
    """Print ``error`` on stderr (under torchrun: by rank 0 only, unless ``every_rank``) and exit with code 2."""
    rank = os.environ.get("RANK", "0")
    if rank == "0" or getattr(error, "every_rank", False):
        prefix = f"{program}: " if rank == "0" else f"{program} (rank {rank}): "
        print(f"{prefix}{error}", file=sys.stderr, flush=True)
    else:
        # torchrun ends every rank once one exits: the others leave rank 0 the time to print first
        time.sleep(RANK0_GRACE_S)
    raise SystemExit(2)
