"""L1: the launchers in launch/ train end to end on this host: launch/torchrun.sh (one node) and launch/slurm.sbatch
(many nodes) through stand-ins for SLURM's srun and scontrol (tests/functional/scripts/slurm_standin/) that start
each "node" here. Each runs 2 steps of tiny_gpt on 2 gloo ranks from a scratch directory, so that the run
directory is the launchers' default one (outputs/<stamp>), and leaves a log per rank.

Time limits: SIGUSR1 sent to the SLURM script (what ``#SBATCH --signal=B:USR1@300`` does) makes every rank save
after its current step and exit 0; the script requeues the job (``scontrol requeue``, recorded by the stand-in), and
the job started again resumes, its steps equal to an uninterrupted run's. ``trainer.exit_duration_mins`` stops a
run the same way from inside.
"""

import json
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from thdpack.megatron.checkpoint import latest_iteration
from thdpack.training.stopping import MARKER

from .conftest import SCRIPTS_DIR, free_port
from .training import FAST, REPO_ROOT, Run, Started, finish, start, start_train, wait_for_step

pytestmark = [pytest.mark.functional, pytest.mark.cpu_only]

TWO_STEPS = [*FAST, "trainer.train_iters=2", "trainer.lr_warmup_iters=1"]
LONGER = ["trainer.train_iters=8", "trainer.lr_warmup_iters=1"]  # the signal comes after step 2 of 8


def launch(argv, cwd: Path, run_dir: Path, env: dict[str, str]) -> Started:
    return start(["bash", *map(str, argv)], run_dir, env={"PYTHON": sys.executable, **env}, cwd=cwd)


def rank_logs(logs: Path) -> list[Path]:
    """torchrun's per-rank logs under ``logs``: <run id>_<random>/attempt_0/<local rank>/stdout.log."""
    return sorted(logs.glob("*/attempt_0/*/stdout.log"))


def slurm_env(job_id: str, **extra: str) -> dict[str, str]:
    """A two-"node" job of one GPU a node, with the stand-ins first on the path."""
    return {
        "PATH": f"{SCRIPTS_DIR / 'slurm_standin'}{os.pathsep}{os.environ['PATH']}",
        "SLURM_JOB_ID": job_id,
        "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "node[1-2]",
        "GPUS_PER_NODE": "1",
        "PORT": str(free_port()),
        **extra,
    }


@pytest.fixture(scope="module")
def launched(tmp_path_factory, trained) -> dict[str, Started]:
    """The module's jobs that nothing interrupts, started together (independent runs), and the uninterrupted run
    of the requeued job's recipe: ``name -> started job``."""
    started = {}
    cwd = tmp_path_factory.mktemp("slurm")
    started["slurm"] = launch(
        [REPO_ROOT / "launch/slurm.sbatch", *TWO_STEPS], cwd, cwd / "outputs/slurm-4242", slurm_env("4242")
    )
    cwd = tmp_path_factory.mktemp("torchrun")
    env = {"THDPACK_RUN_STAMP": "l1-stamp"}
    started["torchrun"] = launch(
        [REPO_ROOT / "launch/torchrun.sh", 2, *TWO_STEPS], cwd, cwd / "outputs/l1-stamp", env
    )
    cwd = tmp_path_factory.mktemp("torchrun_bad")
    env = {"THDPACK_RUN_STAMP": "bad", "CUDA_VISIBLE_DEVICES": ""}
    argv = [REPO_ROOT / "launch/torchrun.sh", *TWO_STEPS, "trainer.on_nonfinite=ignore"]
    started["torchrun_bad"] = launch(argv, cwd, cwd / "outputs/bad", env)
    root = tmp_path_factory.mktemp("exit_duration")
    # 1e-6 minutes: passed once the first step ends (start-up alone takes seconds)
    overrides = ["trainer.exit_duration_mins=1e-6", f"checkpoint.dir={root / 'ckpt'}", *LONGER]
    started["exit_duration"] = start_train(overrides, root / "run")
    trained.start(*LONGER, nproc=2)
    return started


@pytest.fixture(scope="module")
def slurm_job(launched):
    return finish(launched["slurm"])


def test_slurm_script_trains_over_two_nodes(slurm_job):
    slurm_job.check()
    assert slurm_job.steps == [1, 2]
    assert json.loads((slurm_job.run_dir / "summary.json").read_text())["world_size"] == 2


def test_slurm_script_writes_a_log_per_rank(slurm_job):
    logs = slurm_job.check().run_dir / "logs"
    per_node = [rank_logs(logs / f"node{n}") for n in (0, 1)]
    assert [len(found) for found in per_node] == [1, 1]  # one rank a node
    assert any("step 2" in found[0].read_text() for found in per_node)  # the logging rank's


@pytest.fixture(scope="module")
def torchrun_job(launched):
    return finish(launched["torchrun"])


def test_torchrun_script_trains_on_one_node(torchrun_job):
    torchrun_job.check()
    assert torchrun_job.steps == [1, 2]
    assert json.loads((torchrun_job.run_dir / "summary.json").read_text())["world_size"] == 2


def test_torchrun_script_writes_a_log_per_rank(torchrun_job):
    found = rank_logs(torchrun_job.check().run_dir / "logs")
    assert [p.parent.name for p in found] == ["0", "1"]
    assert "step 2" in found[0].read_text()


@pytest.fixture(scope="module")
def torchrun_bad_recipe(launched):
    return finish(launched["torchrun_bad"])


def test_torchrun_script_starts_one_process_without_a_gpu(torchrun_bad_recipe):
    assert "thdpack: 1 process(es)" in torchrun_bad_recipe.output


def test_torchrun_script_ends_a_recipe_that_cannot_run_with_its_message_once_and_code_2(torchrun_bad_recipe):
    assert torchrun_bad_recipe.returncode == 2
    assert torchrun_bad_recipe.output.count("trainer.on_nonfinite is 'ignore'") == 1
    assert "ChildFailedError" not in torchrun_bad_recipe.output
    assert "Traceback" not in torchrun_bad_recipe.output


# --- time limits: signal -> save -> exit -> requeue -> resume ------------------------------------------------------


@dataclass
class Requeued:
    stopped: Run  # the job that got SIGUSR1
    marker: dict | None  # what it left in its run directory
    latest: int | None  # and in its checkpoint directory
    requeues: list[str]  # what scontrol was asked, then
    resumed: Run  # the same job started again, as SLURM does after a requeue
    requeues_after: list[str]  # what scontrol was asked by the end


@pytest.fixture(scope="module")
def requeued_job(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("slurm_requeue")
    scontrol_log, ckpt, run_dir = cwd / "scontrol.log", cwd / "ckpt", cwd / "outputs/slurm-4243"
    scontrol_log.touch()
    argv = ["bash", REPO_ROOT / "launch/slurm.sbatch", *FAST, *LONGER, f"checkpoint.dir={ckpt}"]
    env = {"PYTHON": sys.executable, **slurm_env("4243", SCONTROL_LOG=str(scontrol_log))}
    started = start(list(map(str, argv)), run_dir, env=env, cwd=cwd)
    wait_for_step(started, 2)
    os.kill(started.process.pid, signal.SIGUSR1)  # to the batch script only, as --signal=B:USR1 sends it
    stopped = finish(started)
    marker = json.loads((run_dir / MARKER).read_text()) if (run_dir / MARKER).exists() else None
    latest, requeues = latest_iteration(ckpt), scontrol_log.read_text().splitlines()
    resumed = finish(start(list(map(str, argv)), run_dir, env={**env, "SLURM_RESTART_COUNT": "1"}, cwd=cwd))
    return Requeued(stopped, marker, latest, requeues, resumed, scontrol_log.read_text().splitlines())


def test_sigusr1_stops_the_job_after_a_step_with_a_checkpoint(requeued_job):
    stopped = requeued_job.stopped.check()  # exit 0
    last = stopped.steps[-1]
    assert 2 <= last < 8 and stopped.steps == list(range(1, last + 1))
    assert requeued_job.latest == last
    assert requeued_job.marker == {
        "iteration": last,
        "reason": "SIGUSR1 (the scheduler's warning)",
        "checkpoint_dir": str(requeued_job.stopped.run_dir.parent.parent / "ckpt"),
    }


def test_the_stopped_job_requeues_itself(requeued_job):
    assert requeued_job.requeues == ["requeue 4243"]
    assert "requeueing job 4243 to resume" in requeued_job.stopped.output


def test_the_requeued_job_resumes_where_the_stopped_one_saved(requeued_job):
    resumed = requeued_job.resumed.check()
    assert f"at iteration {requeued_job.latest}" in resumed.output
    assert resumed.steps == list(range(1, 9))  # one record a step, in the run directory both attempts share


def test_the_requeued_job_continues_the_uninterrupted_run_exactly(requeued_job, trained):
    reference = trained(*LONGER, nproc=2).check()
    kept = ("step", "loss", "grad_norm", "lr")
    assert [[r[k] for k in kept] for r in requeued_job.resumed.records] == [
        [r[k] for k in kept] for r in reference.records
    ]


def test_a_job_that_finishes_neither_requeues_nor_leaves_a_marker(requeued_job):
    assert requeued_job.requeues_after == ["requeue 4243"]  # the stopped job's only
    assert not (requeued_job.resumed.run_dir / MARKER).exists()


@pytest.fixture(scope="module")
def out_of_time(launched):
    run = finish(launched["exit_duration"])
    return run, run.run_dir.parent / "ckpt"


def test_exit_duration_mins_stops_after_the_step_with_a_checkpoint(out_of_time):
    run, ckpt = out_of_time
    assert run.check().steps == [1]
    assert latest_iteration(ckpt) == 1
    assert (
        json.loads((run.run_dir / MARKER).read_text())["reason"] == "trainer.exit_duration_mins=1e-06 passed"
    )
    assert json.loads((run.run_dir / "summary.json").read_text())["stopped_early"] == (
        "trainer.exit_duration_mins=1e-06 passed"
    )
