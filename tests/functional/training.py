"""Running the training product in tests: ``python -m thdpack.train`` as one process or as torchrun ranks (gloo on
CPU), in a run directory of the test's, and reading back what it wrote.

    run = run_train(["parallel=tp2", "trainer.train_iters=6"], tmp_path / "tp2", nproc=2)
    run.check()                      # fails the test with the output's tail unless the run exited 0
    run.losses                       # per-step losses from metrics.jsonl

Every run gets the ``FAST`` overrides first (a small corpus, short rows, small batches), so one costs about
7 s on two CPU cores, almost all of it start-up; a test's overrides come after them and win.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

FAST = (
    "dataset.max_files=20",  # 214 samples of the embedded corpus instead of ~5000 (start-up)
    "dataset.seq_length=256",
    "dataset.global_batch_size=8",
    "dataset.micro_batch_size=2",
    # packed micro-batches hold micro_batch_size samples, as padded ones do: the two compute the same sums
    "dataset.micro_batch_tokens=null",
    "trainer.progress_bar=false",
)

_attempts = itertools.count()


@dataclass
class Run:
    """A finished (or killed) run: its directory, exit code, combined output of every rank, and the records of
    metrics.jsonl as the run left it (a resumed run appends to the same file)."""

    run_dir: Path
    returncode: int
    output: str
    records: list[dict]

    @property
    def steps(self) -> list[int]:
        return [r["step"] for r in self.records]

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in self.records]

    def check(self) -> Run:
        """Fail the calling test, showing the output's tail, unless the run exited 0."""
        if self.returncode != 0:
            pytest.fail(f"training in {self.run_dir} exited with {self.returncode}\n{tail(self.output)}")
        return self


def command(overrides, nproc: int = 1) -> list[str]:
    """``python -m thdpack.train`` (one process) or torchrun with ``nproc`` ranks on this host."""
    if nproc == 1:
        return [sys.executable, "-m", "thdpack.train", *overrides]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return [*launcher, "-m", "thdpack.train", *overrides]


def environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This checkout's thdpack first on the path, one thread a rank (CI machines have few cores)."""
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("THDPACK_RUN_STAMP", None)
    return {**env, **(extra or {})}


@dataclass
class Started:
    """A run under way: its process (the leader of its own process group), directory and log file."""

    process: subprocess.Popen
    run_dir: Path
    log_path: Path


def start_train(overrides, run_dir: Path, nproc: int = 1, env: dict[str, str] | None = None) -> Started:
    """Start a run in ``run_dir`` (``hydra.run.dir``) and return at once; its output goes to a log file beside
    ``run_dir``."""
    return start(command([*FAST, *overrides, f"hydra.run.dir={run_dir}"], nproc), run_dir, env)


def start(
    argv: list[str], run_dir: Path, env: dict[str, str] | None = None, cwd: Path = REPO_ROOT
) -> Started:
    """Start ``argv`` (a training command or a launcher) that trains into ``run_dir``."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log_path = run_dir.with_name(f"{run_dir.name}.{next(_attempts)}.log")
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            argv, cwd=cwd, env=environment(env), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    return Started(process, run_dir, log_path)


def finish(run: Started, timeout: float = 180) -> Run:
    """Wait for the run (SIGKILL at ``timeout``), then SIGKILL what is left of its process group: a rank killed
    mid-run orphans the Manager process that Megatron's checkpoint writer spawned, which otherwise lives on."""
    deadline, note = time.monotonic() + timeout, ""
    # Not reaped yet (WNOWAIT): the group's id stays ours until the group is killed.
    while not os.waitid(os.P_PID, run.process.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG):
        if time.monotonic() > deadline:
            note = f"\n[killed: still running after {timeout} s]"
            break
        time.sleep(0.05)
    kill_group(run)
    run.process.wait()
    return Run(
        run.run_dir, run.process.returncode, run.log_path.read_text() + note, read_metrics(run.run_dir)
    )


def export_runs(trained: dict, roots: dict) -> dict:
    """``python -m thdpack.export <root>/ckpt <root>/out`` for every run of ``trained`` that succeeded, all started
    together, then waited for: ``{key: Run}`` (a failed run has no entry)."""
    exporting = {
        key: start(
            [sys.executable, "-m", "thdpack.export", str(roots[key] / "ckpt"), str(roots[key] / "out")],
            roots[key] / "out",
        )
        for key, run in trained.items()
        if run.returncode == 0
    }
    return {key: finish(export) for key, export in exporting.items()}


def kill_group(run: Started) -> None:
    """``kill -9`` the run and every process of its group (those it started); call it before reaping the run."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(run.process.pid, signal.SIGKILL)


def run_train(overrides, run_dir: Path, nproc: int = 1, env=None, timeout: float = 180) -> Run:
    """Run to the end (or to ``timeout``) and return the :class:`Run`; check it with ``.check()``."""
    return finish(start_train(overrides, run_dir, nproc, env), timeout)


def wait_for_step(run: Started, step: int, timeout: float = 120) -> None:
    """Return as soon as metrics.jsonl holds ``step``; fail if the run ends or ``timeout`` passes first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if step in [r["step"] for r in read_metrics(run.run_dir)]:
            return
        if run.process.poll() is not None:
            break
        time.sleep(0.01)
    kill_group(run)
    pytest.fail(f"the run never logged step {step}\n{tail(run.log_path.read_text())}")


def descendants(pid: int) -> set[int]:
    """The processes started by ``pid`` and by them, now (from /proc: also those in other process groups)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def group_members(pgid: int) -> set[int]:
    """The running processes of process group ``pgid`` (a leader that ended but is not reaped is left out)."""
    members = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid and fields[0] != "Z":
                    members.add(int(entry.name))
    return members


def ended(run: Started) -> bool:
    """Whether the run's first process has ended (not reaping it: its process group stays ours)."""
    return os.waitid(os.P_PID, run.process.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None


def wait_for_exit(run: Started, timeout: float = 180) -> bool:
    """Wait until the run's first process ends (not reaped); False at ``timeout``."""
    deadline = time.monotonic() + timeout
    while not ended(run):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def living(pids) -> set[int]:
    """Those of ``pids`` still running (a zombie, ended but not yet reaped, counts as ended)."""
    alive = set()
    for pid in pids:
        with contextlib.suppress(OSError, IndexError):
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                alive.add(pid)
    return alive


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:  # a line being written right now
            break
    return records


def tail(output: str, lines: int = 60) -> str:
    return "--- last output ---\n" + "\n".join(output.splitlines()[-lines:])


# The recipe families of the L1 suite: name -> (overrides, ranks). Each trains packed and padded (except under
# context parallelism, which needs packing) for ITERS steps.
ITERS = 6
FAMILIES = {
    "dense": (("model=tiny_gpt",), 1),
    "dense_tp2": (("model=tiny_gpt", "parallel=tp2"), 2),
    "dense_pp2": (("model=tiny_gpt", "parallel=pp2"), 2),
    "moe_ep2": (("model=tiny_moe", "parallel=ep2"), 2),
    "mrope_cp2": (("model=tiny_mrope", "parallel=cp2"), 2),
}


def family(name: str, packed: bool = True) -> tuple[tuple[str, ...], int]:
    """``(overrides, nproc)`` of a family's run: the same tuple wherever a test asks, so ``trained`` shares it."""
    overrides, nproc = FAMILIES[name]
    packing = f"dataset.pack_sequences_in_batch={str(packed).lower()}"
    return (*overrides, f"trainer.train_iters={ITERS}", packing), nproc


@contextlib.contextmanager
def run_in_process(overrides):
    """The default recipe with ``overrides`` set up in this process (the GPU tests: the device's own run, no
    subprocess): yields the set-up run, shuts its process groups down after."""
    from hydra import compose, initialize_config_dir

    from thdpack.training.loop import _shutdown, recipes_dir, setup_run

    os.environ.pop("MASTER_PORT", None)
    with initialize_config_dir(str(recipes_dir()), version_base="1.3"):
        run = setup_run(compose("train", overrides=list(overrides)))
    try:
        yield run
    finally:
        _shutdown()


def steps_in_process(overrides, steps: int, inspect=None) -> list[dict]:
    """Train ``steps`` steps of :func:`run_in_process`'s run; each step's scalars by name (``loss``,
    ``grad_norm``, ...). ``inspect`` is called with the set-up run before the first step."""
    from thdpack.training.deferred import DeferredScalars
    from thdpack.training.loop import STEP_SCALARS, step_scalars, train_step

    with run_in_process([f"trainer.train_iters={steps}", *overrides]) as run:
        if inspect is not None:
            inspect(run)
        scalars = DeferredScalars(run.runtime.device, lag=0)
        for step in range(1, steps + 1):
            reports, outcome = train_step(run, run.data.next_step())
            scalars.push(step, step_scalars(reports, outcome, True, run.step.loss))
        return [dict(zip(STEP_SCALARS, values, strict=True)) for _, values, _ in scalars.drain()]
