"""L1: a run stopped by a signal, as a cluster or a person stops it, with real processes on CPU (tiny_gpt, 5000 steps
so that each signal comes long before the end):

- SIGTERM (SLURM's time limit or preemption, Kubernetes): a checkpoint of the step under way, exit 0, the requeue
  marker; a second SIGINT stops at once, exit 130, no checkpoint, no traceback;
- Ctrl-C at a terminal (SIGINT to launch/torchrun.sh's process group, the terminal's foreground group) reaches the
  rank once: a checkpoint of the step under way, exit 0, no requeue marker (a person stopped it);
- SIGUSR1 sent to launch/torchrun.sh reaches both ranks through the script: both save the same step and exit 0,
  and no process of the run is left;
- megatron-core's forked checkpoint writer dies with its trainer when the trainer is killed with SIGKILL mid-save
  (processes.py's test hook holds the writer for 60 s, so the save is under way when the kill comes);
- a second run on a checkpoint.dir that a running run holds (the one stuck in its save) is refused before step 1,
  naming its host and pid.

The processes of each case are looked at before the test reaps them: a run's process group (and, for the launcher,
every process it started, torchrun being in a group of its own) must be empty once its first process has ended.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from thdpack.megatron.checkpoint import latest_iteration
from thdpack.training.processes import FORKED_CHILDREN
from thdpack.training.stopping import MARKER

from .training import (
    FAST,
    REPO_ROOT,
    Run,
    Started,
    descendants,
    ended,
    finish,
    group_members,
    living,
    read_metrics,
    start,
    start_train,
    wait_for_exit,
)

pytestmark = [pytest.mark.functional, pytest.mark.cpu_only]

LONG = ["trainer.train_iters=5000", "trainer.lr_warmup_iters=1"]


@dataclass
class Stopped:
    run: Run
    ckpt: Path
    left: dict[int, str] = field(default_factory=dict)  # processes of the run still running once it ended
    info: dict = field(default_factory=dict)


def launcher(nproc: int, root: Path, ckpt: Path) -> Started:
    """launch/torchrun.sh with ``nproc`` ranks, from ``root`` (its run directory: outputs/signals)."""
    argv = ["bash", str(REPO_ROOT / "launch/torchrun.sh"), str(nproc), *FAST, *LONG, f"checkpoint.dir={ckpt}"]
    env = {"PYTHON": sys.executable, "THDPACK_RUN_STAMP": "signals"}
    return start(argv, root / "outputs/signals", env=env, cwd=root)


def _end(started: Started, ckpt: Path, watched: set[int] = frozenset(), **info) -> Stopped:
    """Wait for the run; note what of its process group (and of ``watched``) still runs 5 s later (what dies with
    its parent gets its signal at once; a loaded machine may take a moment to end it); reap it."""
    wait_for_exit(started)
    deadline = time.monotonic() + 5
    while (left := group_members(started.process.pid) | living(watched)) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = {pid: _command(pid) for pid in left}
    for pid in living(watched):
        os.kill(pid, signal.SIGKILL)
    return Stopped(finish(started), ckpt, left, info)


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    except OSError:
        return "(ended)"


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, Stopped]:
    """Every case of the module, started together (independent runs), each signalled as soon as it is at its
    step 2 (a run that waits for its signal burns the cores the others start on)."""
    names = ("term", "ctrl_c", "int_twice", "launcher", "writer")
    root = {name: tmp_path_factory.mktemp(name) for name in names}
    ckpt = {name: root[name] / "ckpt" for name in names}
    writers_file = root["writer"] / "children"
    started = {
        "term": start_train([*LONG, f"checkpoint.dir={ckpt['term']}"], root["term"] / "run"),
        "ctrl_c": launcher(1, root["ctrl_c"], ckpt["ctrl_c"]),
        "int_twice": start_train([*LONG, f"checkpoint.dir={ckpt['int_twice']}"], root["int_twice"] / "run"),
        "writer": start_train(
            [*LONG, "checkpoint.save_interval=1", f"checkpoint.dir={ckpt['writer']}"],
            root["writer"] / "run",
            env={FORKED_CHILDREN: str(writers_file)},
        ),
        "launcher": launcher(2, root["launcher"], ckpt["launcher"]),
    }
    watched: dict[str, set[int]] = {}

    def at_step_2(name: str) -> bool:
        return 2 in [r["step"] for r in read_metrics(started[name].run_dir)]

    def first_sigint_noted() -> bool:
        return "SIGINT: saving a checkpoint after this step" in started["int_twice"].log_path.read_text()

    def writers() -> set[int]:
        return {int(pid) for pid in writers_file.read_text().split()} if writers_file.exists() else set()

    def stop_ctrl_c():
        watched["ctrl_c"] = descendants(started["ctrl_c"].process.pid)
        os.killpg(started["ctrl_c"].process.pid, signal.SIGINT)  # what a terminal does on Ctrl-C

    def stop_launcher():
        watched["launcher"] = descendants(started["launcher"].process.pid)
        os.kill(started["launcher"].process.pid, signal.SIGUSR1)

    second = {}

    def refuse_a_second_run():  # the writer's trainer holds its checkpoint.dir, stuck in its first save
        time.sleep(0.2)  # every writer of that save has started
        watched["writer"] = writers()
        second["run"] = start_train([*LONG, f"checkpoint.dir={ckpt['writer']}"], root["writer"] / "second")

    # (when, what), in order for each run; the second SIGINT comes once the first is noted: within the step or
    # the save after it (about a second in all)
    steps = {
        "term": [(lambda: at_step_2("term"), lambda: os.kill(started["term"].process.pid, signal.SIGTERM))],
        "ctrl_c": [(lambda: at_step_2("ctrl_c"), stop_ctrl_c)],
        "int_twice": [
            (
                lambda: at_step_2("int_twice"),
                lambda: os.kill(started["int_twice"].process.pid, signal.SIGINT),
            ),
            (first_sigint_noted, lambda: os.kill(started["int_twice"].process.pid, signal.SIGINT)),
        ],
        "launcher": [(lambda: at_step_2("launcher"), stop_launcher)],
        "writer": [
            (lambda: bool(writers()), refuse_a_second_run),
            (lambda: ended(second["run"]), lambda: None),
            # the trainer alone, not its process group (its writer is in it)
            (lambda: True, lambda: os.kill(started["writer"].process.pid, signal.SIGKILL)),
        ],
    }
    deadline = time.monotonic() + 300
    while any(steps.values()) and time.monotonic() < deadline:
        for todo in steps.values():
            while todo and todo[0][0]():
                todo.pop(0)[1]()
        time.sleep(0.02)
    done = {name: _end(run, ckpt[name], watched=watched.get(name, set())) for name, run in started.items()}
    done["writer"].info = {"writers": watched.get("writer", set()), "pid": started["writer"].process.pid}
    done["writer"].info["second"] = _end(second["run"], ckpt["writer"]).run if second else None
    done["launcher"].info = {"seen": watched.get("launcher", set())}
    return done


def test_sigterm_saves_the_step_under_way_and_exits_0(cases):
    term = cases["term"]
    last = term.run.check().steps[-1]
    assert 2 <= last < 5000 and term.run.steps == list(range(1, last + 1))
    assert latest_iteration(term.ckpt) == last
    assert "stopping after iteration" in term.run.output and "SIGTERM" in term.run.output


def test_sigterm_leaves_the_marker_that_requeues_a_slurm_job(cases):
    term = cases["term"]
    marker = json.loads((term.run.run_dir / MARKER).read_text())
    assert marker["reason"] == "SIGTERM (a request to terminate)"
    assert marker["iteration"] == term.run.steps[-1]


def test_a_run_stopped_by_sigterm_leaves_no_process(cases):
    assert cases["term"].left == {}


def test_a_second_run_on_the_same_checkpoint_dir_is_refused_before_step_1_naming_the_first(cases):
    first = cases["writer"]
    second = first.info["second"]
    assert second.returncode == 2
    assert second.steps == []
    assert (
        f"checkpoint.dir {first.ckpt} is in use by pid {first.info['pid']} on host {socket.gethostname()}"
        in (second.output)
    )
    assert "Traceback" not in second.output


def test_ctrl_c_at_the_torchrun_script_saves_the_step_under_way_and_exits_0(cases):
    stopped = cases["ctrl_c"]
    last = stopped.run.check().steps[-1]
    assert 2 <= last < 5000
    assert latest_iteration(stopped.ckpt) == last
    assert "second SIGINT" not in stopped.run.output  # one Ctrl-C reached the rank once
    assert "Traceback" not in stopped.run.output
    assert stopped.left == {}


def test_a_run_stopped_by_a_person_does_not_ask_slurm_to_requeue_it(cases):
    assert not (cases["ctrl_c"].run.run_dir / MARKER).exists()


def test_a_second_sigint_stops_at_once_without_a_checkpoint(cases):
    stopped = cases["int_twice"]
    assert stopped.run.returncode == 130
    assert "a second SIGINT: stopping at once, without a checkpoint" in stopped.run.output
    assert "Traceback" not in stopped.run.output
    assert latest_iteration(stopped.ckpt) is None
    assert stopped.left == {}


def test_sigusr1_to_the_torchrun_script_saves_every_rank_at_the_same_step_and_exits_0(cases):
    launcher = cases["launcher"]
    last = launcher.run.check().steps[-1]
    assert 2 <= last < 5000
    assert latest_iteration(launcher.ckpt) == last
    ranks = launcher.run.output.count(f"stopping after iteration {last} on SIGUSR1")
    assert ranks == 1  # the logging rank says it; both ranks saved that step (one checkpoint, world 2)
    manifest = json.loads((launcher.ckpt / f"iter_{last:07d}" / "manifest.json").read_text())
    assert manifest["writer"]["world"] == 2


def test_no_process_of_the_torchrun_script_outlives_it(cases):
    launcher = cases["launcher"]
    assert len(launcher.info["seen"]) >= 3  # torchrun and its two ranks were seen
    assert launcher.left == {}


def test_a_trainer_killed_mid_save_takes_its_checkpoint_writer_with_it(cases):
    writer = cases["writer"]
    assert writer.run.returncode == -9
    assert writer.info["writers"], "no checkpoint writer was forked"
    assert writer.left == {}
    assert latest_iteration(writer.ckpt) is None
    assert sorted(p.name for p in writer.ckpt.iterdir() if p.name.startswith("iter_")) == [
        "iter_0000001.partial"
    ]
