"""L1: the launchers in launch/ train end to end on this host: launch/torchrun.sh (one node) and launch/slurm.sbatch
(many nodes) through stand-ins for SLURM's srun and scontrol (tests/functional/scripts/slurm_standin/) that start
each "node" here. Each runs 2 steps of tiny_gpt on 2 gloo ranks from a scratch directory, so that the run
directory is the launchers' default one (outputs/<stamp>), and leaves a log per rank.
"""

import json
import os
import sys
from pathlib import Path

import pytest

from .conftest import SCRIPTS_DIR, free_port
from .training import FAST, REPO_ROOT, Run, finish, start

pytestmark = [pytest.mark.functional, pytest.mark.cpu_only]

TWO_STEPS = [*FAST, "trainer.train_iters=2", "trainer.lr_warmup_iters=1"]


def launch(argv, cwd: Path, run_dir: Path, env: dict[str, str]) -> Run:
    return finish(start(["bash", *map(str, argv)], run_dir, env={"PYTHON": sys.executable, **env}, cwd=cwd))


def rank_logs(logs: Path) -> list[Path]:
    """torchrun's per-rank logs under ``logs``: <run id>_<random>/attempt_0/<local rank>/stdout.log."""
    return sorted(logs.glob("*/attempt_0/*/stdout.log"))


@pytest.fixture(scope="module")
def slurm_job(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("slurm")
    env = {
        "PATH": f"{SCRIPTS_DIR / 'slurm_standin'}{os.pathsep}{os.environ['PATH']}",
        "SLURM_JOB_ID": "4242",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "node[1-2]",
        "GPUS_PER_NODE": "1",
        "PORT": str(free_port()),
    }
    return launch([REPO_ROOT / "launch/slurm.sbatch", *TWO_STEPS], cwd, cwd / "outputs/slurm-4242", env)


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
def torchrun_job(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("torchrun")
    env = {"THDPACK_RUN_STAMP": "l1-stamp"}
    return launch([REPO_ROOT / "launch/torchrun.sh", 2, *TWO_STEPS], cwd, cwd / "outputs/l1-stamp", env)


def test_torchrun_script_trains_on_one_node(torchrun_job):
    torchrun_job.check()
    assert torchrun_job.steps == [1, 2]
    assert json.loads((torchrun_job.run_dir / "summary.json").read_text())["world_size"] == 2


def test_torchrun_script_writes_a_log_per_rank(torchrun_job):
    found = rank_logs(torchrun_job.check().run_dir / "logs")
    assert [p.parent.name for p in found] == ["0", "1"]
    assert "step 2" in found[0].read_text()


@pytest.fixture(scope="module")
def torchrun_bad_recipe(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("torchrun_bad")
    env = {"THDPACK_RUN_STAMP": "bad", "CUDA_VISIBLE_DEVICES": ""}
    argv = [REPO_ROOT / "launch/torchrun.sh", *TWO_STEPS, "trainer.on_nonfinite=ignore"]
    return launch(argv, cwd, cwd / "outputs/bad", env)


def test_torchrun_script_starts_one_process_without_a_gpu(torchrun_bad_recipe):
    assert "thdpack: 1 process(es)" in torchrun_bad_recipe.output


def test_torchrun_script_exits_with_torchruns_code(torchrun_bad_recipe):
    assert torchrun_bad_recipe.returncode == 1
    assert "trainer.on_nonfinite is 'ignore'" in torchrun_bad_recipe.output
