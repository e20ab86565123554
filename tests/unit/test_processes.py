"""No process of a run outlives it (thdpack.training.processes): a child forked by a trainer (megatron-core's
checkpoint writer forks this way) dies when the trainer is killed with SIGKILL, and a rank started by torchrun gets
SIGTERM (save, then exit) when torchrun dies. Real processes: a parent that kills itself."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

REPO = Path(__file__).resolve().parents[2]


def gone(pid: int, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


def run_parent(code: str, tmp_path: Path) -> int:
    """Run ``code`` in a parent process that prints its child's pid and SIGKILLs itself; return the child's pid.
    (Output to a file: a child that lives on would hold a pipe open.)"""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = tmp_path / "parent.out"
    with open(out, "w") as f:
        parent = subprocess.run(
            [sys.executable, "-c", code], stdout=f, stderr=subprocess.STDOUT, env=env, timeout=60
        )
    assert parent.returncode == -9, out.read_text()
    return int(out.read_text().split()[-1])


def test_a_forked_child_dies_when_its_parent_is_killed(tmp_path):
    child = run_parent(
        "import multiprocessing, os, signal, time\n"
        "from thdpack.training.processes import forks_die_with_this_process\n"
        "forks_die_with_this_process()\n"
        "p = multiprocessing.get_context('fork').Process(target=time.sleep, args=(60,)); p.start()\n"
        "print(p.pid, flush=True); time.sleep(0.2); os.kill(os.getpid(), signal.SIGKILL)\n",
        tmp_path,
    )
    assert gone(child)


def test_without_it_a_forked_child_outlives_its_killed_parent(tmp_path):
    child = run_parent(
        "import multiprocessing, os, signal, time\n"
        "p = multiprocessing.get_context('fork').Process(target=time.sleep, args=(60,)); p.start()\n"
        "print(p.pid, flush=True); time.sleep(0.2); os.kill(os.getpid(), signal.SIGKILL)\n",
        tmp_path,
    )
    try:
        assert not gone(child, within=1.0)
    finally:
        os.kill(child, 9)


def test_a_rank_started_by_torchrun_is_asked_to_stop_when_torchrun_dies(tmp_path):
    ready, noted = tmp_path / "ready", tmp_path / "noted"
    rank = (
        "import pathlib, time\n"
        "from thdpack.training import processes, signals\n"
        "processes.start_of_run()\n"
        f"pathlib.Path({str(ready)!r}).touch()\n"
        "deadline = time.monotonic() + 30\n"
        "while signals.requested() is None and time.monotonic() < deadline: time.sleep(0.02)\n"
        f"pathlib.Path({str(noted)!r}).write_text(str(signals.requested()))\n"
    )
    child = run_parent(
        "import os, pathlib, signal, subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, '-c', {rank!r}], env={{**os.environ, 'TORCHELASTIC_RUN_ID': 'x'}})\n"
        f"while not pathlib.Path({str(ready)!r}).exists(): time.sleep(0.02)\n"
        "print(p.pid, flush=True); os.kill(os.getpid(), signal.SIGKILL)\n",
        tmp_path,
    )
    assert gone(child, within=10)
    assert noted.read_text() == "15"  # SIGTERM: the rank saves after its step and exits
