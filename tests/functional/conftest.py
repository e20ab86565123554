"""Shared helpers for L1 (multi-process) tests.

`run_torchrun` launches a script under `torchrun` on this host and fails the calling test with the
tail of the output when the script fails or hangs. Use the fixture of the same name in tests:

    def test_tp2(run_torchrun):
        out = run_torchrun("cpu_parallel_smoke.py", nproc=2, args=["--layout", "tp2"])
        assert "loss" in out

Scripts live in tests/functional/scripts/; they run with gloo on CPU unless they say otherwise.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS_DIR = Path(__file__).parent / "scripts"
REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port on localhost that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(
    script: str | Path,
    nproc: int = 2,
    args: list[str] | tuple[str, ...] = (),
    timeout: float = 120,
    env: dict[str, str] | None = None,
    tail_lines: int = 80,
    check: bool = True,
) -> str:
    """Run `python -m torch.distributed.run --nproc_per_node=nproc script *args` on one node.

    script: a path, or a file name under tests/functional/scripts/.
    env: extra environment variables; OMP_NUM_THREADS=1 and PYTHONUNBUFFERED=1 are set by default
        (CI machines have few cores, and ranks that each spawn a full thread pool crawl).
    Returns the combined stdout and stderr of all ranks. Fails the test, showing the last
    `tail_lines` lines, if the exit code is not 0 (unless `check` is false: a script that runs several
    cases, each test then looks for its own) or the run takes longer than `timeout` seconds (then the
    whole process group, workers included, is killed).
    """
    path = Path(script)
    if not path.is_absolute() and not path.exists():
        path = SCRIPTS_DIR / path
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--nnodes=1",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(path),
        *map(str, args),
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    process = subprocess.Popen(
        command,
        cwd=REPO_ROOT,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # own process group, for the last-resort SIGKILL in _stop
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        output = _stop(process)
        pytest.fail(
            f"{path.name} {' '.join(map(str, args))} timed out after {timeout}s\n{_tail(output, tail_lines)}"
        )
    if check and process.returncode != 0:
        pytest.fail(
            f"{path.name} {' '.join(map(str, args))} exited with {process.returncode}\n{_tail(output, tail_lines)}"
        )
    return output


def _stop(process: subprocess.Popen) -> str:
    """Stop torchrun and its workers; return what they printed. Workers run in their own sessions,
    so only torchrun can stop them: SIGTERM first (torchrun then terminates its workers), SIGKILL
    to the whole group if that does not end it."""
    process.send_signal(signal.SIGTERM)
    try:
        return process.communicate(timeout=30)[0]
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        return process.communicate()[0]


def _tail(output: str, lines: int) -> str:
    kept = output.splitlines()[-lines:]
    return "--- last output ---\n" + "\n".join(kept)


@pytest.fixture(name="run_torchrun")
def run_torchrun_fixture():
    """The `run_torchrun` helper, as a fixture."""
    return run_torchrun


# runs under way at once from trained.ahead: two one-rank runs fill two cores, two-rank runs overlap
AHEAD = 2


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """`trained(*overrides, nproc=1) -> Run`: `python -m thdpack.train` (tests/functional/training.py), run once
    per session and configuration, so that tests of one configuration (and other modules) share the run.
    `trained.start(*overrides, nproc=1)` starts it and returns at once (a fixture that has runs of its own to wait
    for lets it go on beside them); `trained(...)` then waits for it. `trained.ahead((overrides, nproc), ...)`
    queues runs that a module's tests will ask for, in that order: they start as runs finish, AHEAD under way at
    most."""
    from .training import finish, start_train

    runs, started, queued = {}, {}, []

    def start(*overrides: str, nproc: int = 1) -> None:
        key = (tuple(overrides), nproc)
        if key not in runs and key not in started:
            started[key] = start_train(overrides, tmp_path_factory.mktemp("train") / "run", nproc=nproc)

    def top_up() -> None:
        while queued and len(started) < AHEAD:
            overrides, nproc = queued.pop(0)
            start(*overrides, nproc=nproc)

    def ahead(*keys: tuple[tuple[str, ...], int]) -> None:
        queued.extend(k for k in keys if k not in runs and k not in started and k not in queued)
        top_up()

    def get(*overrides: str, nproc: int = 1):
        key = (overrides, nproc)
        if key not in runs:
            start(*overrides, nproc=nproc)
            if key in queued:
                queued.remove(key)
            runs[key] = finish(started.pop(key))
            top_up()
        return runs[key]

    get.start, get.ahead = start, ahead
    return get
