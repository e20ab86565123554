"""No process of a run outlives it: each process of a training run dies with the one that started it (Linux's
``PR_SET_PDEATHSIG``), also when that one is killed with SIGKILL and can clean nothing up.

- a process megatron-core forks to write checkpoint shards (or any other fork of a rank) gets SIGKILL when its rank
  ends: half-written files are in ``iter_XXXXXXX.partial/``, which the next start removes;
- a rank started by torchrun gets SIGTERM when torchrun ends: it saves after its current step and exits
  (:mod:`thdpack.training.signals`), as on any SIGTERM;
- launch/torchrun.sh has torchrun get SIGKILL when the script ends (``setpriv --pdeathsig``).

Elsewhere than Linux these do nothing.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

__all__ = [
    "FORKED_CHILDREN",
    "die_with_parent",
    "forks_die_with_this_process",
    "launched_by_torchrun",
    "start_of_run",
]

_PR_SET_PDEATHSIG = 1
# For tests only: THDPACK_TEST_FORKED_CHILDREN=<file> makes each forked child of a rank append its pid to the file,
# then wait 60 s before going on (tests/functional/test_signals.py: the trainer killed while its writer runs).
FORKED_CHILDREN = "THDPACK_TEST_FORKED_CHILDREN"
_installed = False


def die_with_parent(sig: int, parent: int | None = None) -> bool:
    """Have this process receive ``sig`` when its parent (the thread that forked it) ends; ``parent``: its pid
    as the caller knew it (a parent that ended before the call sends ``sig`` at once). False off Linux."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), sig)
    return True


def forks_die_with_this_process() -> None:
    """Every child this process forks from now on (multiprocessing's fork context: megatron-core's checkpoint
    writers) gets SIGKILL when this process ends."""
    global _installed
    if _installed or not sys.platform.startswith("linux"):
        return
    parent = {}

    def before() -> None:
        parent["pid"] = os.getpid()

    def in_child() -> None:
        die_with_parent(signal.SIGKILL, parent.get("pid"))
        record = os.environ.get(FORKED_CHILDREN)
        if record:
            with open(record, "a") as f:
                f.write(f"{os.getpid()}\n")
            time.sleep(60)

    os.register_at_fork(before=before, after_in_child=in_child)
    _installed = True


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


def start_of_run() -> None:
    """What ``python -m thdpack.train`` does first: note the stop signals, tie its forks' lives to its own, and,
    started by torchrun, its own to torchrun's."""
    from . import signals

    signals.install()
    forks_die_with_this_process()
    if launched_by_torchrun():
        die_with_parent(signal.SIGTERM, os.getppid())
