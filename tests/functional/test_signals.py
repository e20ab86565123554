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
- a second run on a checkpoint.dir that a running run holds is refused before step 1, naming its host and pid.

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
    finish,
    group_members,
    living,
    start,
    start_train,
    wait_for_exit,
    wait_for_output,
    wait_for_step,
)

pytestmark = [pytest.mark.functional, pytest.mark.cpu_only]

LONG = ["trainer.train_iters=5000", "trainer.lr_warmup_iters=1"]
# steps of about half a second on two cores: a second SIGINT sent once the first is noted lands in the same step
SLOW_STEPS = ["dataset.global_batch_size=32", "dataset.micro_batch_size=4"]


@dataclass
class Stopped:
    run: Run
    ckpt: Path
    left: set[int] = field(default_factory=set)  # processes of the run still running once it ended
    info: dict = field(default_factory=dict)


def launcher(nproc: int, root: Path, ckpt: Path) -> Started:
    """launch/torchrun.sh with ``nproc`` ranks, from ``root`` (its run directory: outputs/signals)."""
    argv = ["bash", str(REPO_ROOT / "launch/torchrun.sh"), str(nproc), *FAST, *LONG, f"checkpoint.dir={ckpt}"]
    env = {"PYTHON": sys.executable, "THDPACK_RUN_STAMP": "signals"}
    return start(argv, root / "outputs/signals", env=env, cwd=root)


def _end(started: Started, ckpt: Path, watched: set[int] = frozenset(), **info) -> Stopped:
    """Wait for the run; note what of its process group (and of ``watched``) still runs then; reap it."""
    wait_for_exit(started)
    time.sleep(0.5)  # what dies with its parent gets its signal at once: a moment to go
    left = group_members(started.process.pid) | living(watched)
    for pid in living(watched):
        os.kill(pid, signal.SIGKILL)
    return Stopped(finish(started), ckpt, left, info)


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, Stopped]:
    """Every case of the module, started together (independent runs), each signalled after its step 2."""
    names = ("term", "ctrl_c", "int_twice", "launcher", "writer")
    root = {name: tmp_path_factory.mktemp(name) for name in names}
    ckpt = {name: root[name] / "ckpt" for name in names}
    writers_file = root["writer"] / "children"
    started = {
        "term": start_train([*LONG, f"checkpoint.dir={ckpt['term']}"], root["term"] / "run"),
        "ctrl_c": launcher(1, root["ctrl_c"], ckpt["ctrl_c"]),
        "int_twice": start_train(
            [*LONG, *SLOW_STEPS, f"checkpoint.dir={ckpt['int_twice']}"], root["int_twice"] / "run"
        ),
        "writer": start_train(
            [*LONG, "checkpoint.save_interval=1", f"checkpoint.dir={ckpt['writer']}"],
            root["writer"] / "run",
            env={FORKED_CHILDREN: str(writers_file)},
        ),
        "launcher": launcher(2, root["launcher"], ckpt["launcher"]),
    }
    done = {}

    # the first save's writers are held for 60 s: the trainer is killed meanwhile
    deadline = time.monotonic() + 120
    while not (writers_file.exists() and writers_file.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)  # every writer of the save has started
    writers = {int(pid) for pid in writers_file.read_text().split()} if writers_file.exists() else set()
    os.kill(started["writer"].process.pid, signal.SIGKILL)  # the trainer alone, not its process group
    done["writer"] = _end(started["writer"], ckpt["writer"], watched=writers, writers=writers)

    # signals as soon as each case is at its step 2 (the stopped runs free the cores for the next ones)
    wait_for_step(started["ctrl_c"], 2)
    ctrl_c_processes = descendants(started["ctrl_c"].process.pid)
    os.killpg(started["ctrl_c"].process.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
    wait_for_step(started["int_twice"], 2)
    os.kill(started["int_twice"].process.pid, signal.SIGINT)
    wait_for_output(started["int_twice"], "SIGINT: saving a checkpoint after this step")
    os.kill(started["int_twice"].process.pid, signal.SIGINT)
    wait_for_step(started["launcher"], 2)
    ranks = descendants(started["launcher"].process.pid)
    os.kill(started["launcher"].process.pid, signal.SIGUSR1)
    # a second run on the checkpoint.dir that the SIGTERM case holds, then SIGTERM to that case
    wait_for_step(started["term"], 2)
    second = start_train([*LONG, f"checkpoint.dir={ckpt['term']}"], root["term"] / "second")
    done["ctrl_c"] = _end(started["ctrl_c"], ckpt["ctrl_c"], watched=ctrl_c_processes)
    done["int_twice"] = _end(started["int_twice"], ckpt["int_twice"])
    done["launcher"] = _end(started["launcher"], ckpt["launcher"], watched=ranks, seen=ranks)
    second = _end(second, ckpt["term"])
    os.kill(started["term"].process.pid, signal.SIGTERM)
    done["term"] = _end(started["term"], ckpt["term"], second=second.run, pid=started["term"].process.pid)
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
    assert cases["term"].left == set()


def test_a_second_run_on_the_same_checkpoint_dir_is_refused_before_step_1_naming_the_first(cases):
    term = cases["term"]
    second = term.info["second"]
    assert second.returncode == 2
    assert second.steps == []
    assert (
        f"checkpoint.dir {term.ckpt} is in use by pid {term.info['pid']} on host {socket.gethostname()}"
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
    assert stopped.left == set()


def test_a_run_stopped_by_a_person_does_not_ask_slurm_to_requeue_it(cases):
    assert not (cases["ctrl_c"].run.run_dir / MARKER).exists()


def test_a_second_sigint_stops_at_once_without_a_checkpoint(cases):
    stopped = cases["int_twice"]
    assert stopped.run.returncode == 130
    assert "a second SIGINT: stopping at once, without a checkpoint" in stopped.run.output
    assert "Traceback" not in stopped.run.output
    assert latest_iteration(stopped.ckpt) is None
    assert stopped.left == set()


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
    assert launcher.left == set()


def test_a_trainer_killed_mid_save_takes_its_checkpoint_writer_with_it(cases):
    writer = cases["writer"]
    assert writer.run.returncode == -9
    assert writer.info["writers"], "no checkpoint writer was forked"
    assert writer.left == set()
    assert latest_iteration(writer.ckpt) is None
    assert sorted(p.name for p in writer.ckpt.iterdir() if p.name.startswith("iter_")) == [
        "iter_0000001.partial"
    ]
