"""L1: a run that stops (``trainer.exit_interval``) or is killed (``kill -9`` mid-run, mid-save) resumes from its
latest complete checkpoint, and the resumed steps equal the uninterrupted run's to the last bit (fp32 on CPU):
loss, gradient norm and learning rate. Running the same command again is all it takes. On another parallel layout
(DP1 -> DP2, TP1 -> TP2, PP2 -> PP1) the resumed steps equal the uninterrupted run's up to the order of fp32
sums (LAYOUT_RTOL); what the saved format cannot reshard is refused before step 1, naming both layouts.

The uninterrupted runs are test_train.py's family runs (shared through the session's ``trained`` fixture).
A kill mid-save is made deterministic by checkpoint.py's THDPACK_TEST_KILL_BEFORE_RENAME hook: every rank
SIGKILLs itself after writing ``iter_XXXXXXX.partial/``, before renaming it.
"""

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from thdpack.megatron.checkpoint import KILL_BEFORE_RENAME, latest_iteration
from thdpack.training.resume import RUN_DIR_FILE

from .training import (
    FAMILIES,
    ITERS,
    Run,
    Started,
    family,
    finish,
    kill_group,
    run_train,
    start_train,
    wait_for_step,
)

pytestmark = [pytest.mark.functional, pytest.mark.cpu_only]


def checkpoint_files(ckpt: Path) -> list[str]:
    """What checkpoint.dir holds but the note of the run directory that trained into it (thdpack.training.resume)."""
    return sorted(p.name for p in ckpt.iterdir() if p.name != RUN_DIR_FILE)


def logged(run: Run, steps) -> list[tuple]:
    """What must match an uninterrupted run exactly: (step, loss, grad_norm, lr) of ``steps``."""
    by_step = {r["step"]: r for r in run.records}
    return [(s, by_step[s]["loss"], by_step[s]["grad_norm"], by_step[s]["lr"]) for s in steps]


@dataclass
class Interrupted:
    first: Run  # the run that stopped or was killed
    latest_after_first: int | None  # what the checkpoint tracker named then
    left_after_first: list[str]  # and what the checkpoint directory held
    resumed: Run  # the same command, run again
    ckpt: Path
    reference: Run  # the uninterrupted run


def interrupted(trained, tmp_path_factory, name, extra, stop=None, env=None) -> Interrupted:
    """Run family ``name`` with a checkpoint directory and ``extra`` overrides (the uninterrupted run started beside
    it, unless done); ``stop(started)`` (if given) ends it early; record the tracker; run the same command again."""
    overrides, nproc = family(name)
    trained.start(*overrides, nproc=nproc)
    root = tmp_path_factory.mktemp(name)
    ckpt = root / "ckpt"
    command = [*overrides, f"checkpoint.dir={ckpt}", *extra]
    started = start_train(command, root / "run", nproc, env=env)
    if stop is not None:
        stop(started)
    first = finish(started)
    latest, left = latest_iteration(ckpt), checkpoint_files(ckpt)
    resumed = run_train(command, root / "run", nproc)
    return Interrupted(first, latest, left, resumed, ckpt, trained(*overrides, nproc=nproc).check())


# --- trainer.exit_interval: stop after step 3 with a checkpoint, then run the same command -----------------------


@pytest.fixture(scope="module", params=["dense", "dense_tp2"])
def exited(request, trained, tmp_path_factory):
    return interrupted(trained, tmp_path_factory, request.param, ["trainer.exit_interval=3"])


def test_exit_interval_stops_after_its_step_with_a_checkpoint(exited):
    assert exited.first.check().steps == [1, 2, 3]
    assert exited.latest_after_first == 3


def test_resume_after_exit_interval_matches_the_uninterrupted_run_exactly(exited):
    assert f"resumed from {exited.ckpt} at iteration 3" in exited.resumed.check().output
    assert logged(exited.resumed, [4, 5, 6]) == logged(exited.reference, [4, 5, 6])
    assert logged(exited.first, [1, 2, 3]) == logged(exited.reference, [1, 2, 3])


# --- kill -9 mid-run: killed once step 4 is logged; the checkpoint of step 3 is the latest -----------------------


def kill_after_step_4(started):
    wait_for_step(started, 4)
    kill_group(started)


@pytest.fixture(scope="module")
def killed_mid_run(trained, tmp_path_factory):
    return interrupted(
        trained, tmp_path_factory, "dense", ["checkpoint.save_interval=3"], stop=kill_after_step_4
    )


def test_kill_mid_run_leaves_the_last_saved_checkpoint_latest(killed_mid_run):
    assert killed_mid_run.first.returncode == -9
    assert 4 in killed_mid_run.first.steps
    # steps 5 and 6 (about 0.3 s) stand between the kill and the next save, at step 6
    assert killed_mid_run.latest_after_first == 3


def test_resume_after_kill_mid_run_matches_the_uninterrupted_run_exactly(killed_mid_run):
    resumed = killed_mid_run.resumed.check()
    assert f"resumed from {killed_mid_run.ckpt} at iteration 3" in resumed.output
    assert logged(resumed, [4, 5, 6]) == logged(killed_mid_run.reference, [4, 5, 6])


def test_resume_keeps_one_metrics_record_per_step(killed_mid_run):
    # the killed run logged step 4 and the resumed run logged it again
    assert killed_mid_run.resumed.check().steps == [1, 2, 3, 4, 5, 6]


# --- kill -9 mid-save: killed between writing the checkpoint of step 4 and renaming it ---------------------------


@pytest.fixture(scope="module")
def killed_mid_save(trained, tmp_path_factory):
    return interrupted(
        trained, tmp_path_factory, "dense", ["checkpoint.save_interval=2"], env={KILL_BEFORE_RENAME: "4"}
    )


def test_kill_mid_save_leaves_the_previous_checkpoint_latest(killed_mid_save):
    assert killed_mid_save.first.returncode == -9
    assert killed_mid_save.first.steps == [1, 2, 3, 4]
    assert killed_mid_save.latest_after_first == 2
    assert killed_mid_save.left_after_first == [
        "iter_0000002",
        "iter_0000004.partial",  # every file written, never renamed: not a checkpoint
        "latest_checkpointed_iteration.txt",
        "thdpack.lock",  # stale: the next start on this host takes it over
    ]


def test_the_resumed_run_replaces_the_half_written_checkpoint(killed_mid_save):
    killed_mid_save.resumed.check()
    left = checkpoint_files(killed_mid_save.ckpt)
    assert left == ["iter_0000002", "iter_0000004", "iter_0000006", "latest_checkpointed_iteration.txt"]


def test_resume_after_kill_mid_save_matches_the_uninterrupted_run_exactly(killed_mid_save):
    resumed = killed_mid_save.resumed.check()
    assert f"resumed from {killed_mid_save.ckpt} at iteration 2" in resumed.output
    assert logged(resumed, [3, 4, 5, 6]) == logged(killed_mid_save.reference, [3, 4, 5, 6])
    assert latest_iteration(killed_mid_save.ckpt) == 6


def test_starting_a_finished_run_again_keeps_its_checkpoint(killed_mid_save, tmp_path):
    # Nothing to train: the checkpoint of step 6 must stay as it is (it was once deleted to be written again, and a
    # kill in that save left the tracker naming a missing directory). The hook would kill a save of step 6.
    command = [*family("dense")[0], f"checkpoint.dir={killed_mid_save.ckpt}", "checkpoint.save_interval=2"]
    again = run_train(command, tmp_path / "run", env={KILL_BEFORE_RENAME: "6"}).check()
    assert f"resumed from {killed_mid_save.ckpt} at iteration 6" in again.output
    assert (
        f"nothing to train: the checkpoint in {killed_mid_save.ckpt} is at iteration 6 and " in again.output
    )
    assert "saved checkpoint" not in again.output
    assert latest_iteration(killed_mid_save.ckpt) == 6


# --- another parallel layout: stop after step 3 on one layout, resume on another ---------------------------------

# Measured (fp32, CPU, gloo): losses differ by at most 9.5e-8 relative, gradient norms by 9.7e-7 (sums taken in
# another order: other micro-batch splits, TP partial sums); the learning rate is the same number.
LAYOUT_RTOL = {"loss": 1e-6, "grad_norm": 1e-5}
LAYOUT_CHANGES = {  # name: (saved family, resumed family, resumed ranks)
    "dp1_to_dp2": ("dense", "dense", 2),
    "tp1_to_tp2": ("dense", "dense_tp2", 2),
    "pp2_to_pp1": ("dense_pp2", "dense", 1),
}


STOPPED = [("dense",), ("dense_pp2",), ("dense", "checkpoint.optimizer_format=dp_reshardable")]


@pytest.fixture(scope="module")
def stopped_at_3(tmp_path_factory):
    """``get(family, *extra) -> checkpoint directory`` of the family's run stopped after step 3, run once; the
    first call starts every run of STOPPED together (independent runs)."""
    runs = {}

    def start(name: str, *extra: str):
        overrides, nproc = family(name)
        root = tmp_path_factory.mktemp(f"{name}_stopped")
        command = [*overrides, f"checkpoint.dir={root / 'ckpt'}", "trainer.exit_interval=3", *extra]
        return start_train(command, root / "run", nproc), root / "ckpt"

    def get(name: str, *extra: str) -> Path:
        if not runs:
            started = {key: start(*key) for key in {*STOPPED, (name, *extra)}}
            for (name_, *extra_), (run, ckpt) in started.items():
                runs[name_, tuple(extra_)] = finish(run), ckpt
        if (name, extra) not in runs:
            run, ckpt = start(name, *extra)
            runs[name, extra] = finish(run), ckpt
        run, ckpt = runs[name, extra]
        run.check()
        return ckpt

    return get


def resume_on(saved_ckpt: Path, name: str, nproc: int, root: Path, *extra: str) -> Started:
    """Start family ``name`` on ``nproc`` ranks from a copy of ``saved_ckpt`` (the original stays at step 3)."""
    ckpt = root / "ckpt"
    shutil.copytree(saved_ckpt, ckpt)
    overrides = [*FAMILIES[name][0], f"trainer.train_iters={ITERS}", "dataset.pack_sequences_in_batch=true"]
    return start_train([*overrides, f"checkpoint.dir={ckpt}", *extra], root / "run", nproc)


@pytest.fixture(scope="module")
def relaid(stopped_at_3, trained, tmp_path_factory):
    """``get(change) -> (resumed run, uninterrupted run on the saved layout)`` for a LAYOUT_CHANGES entry, run once;
    the first call runs every change (and the uninterrupted runs not done yet) together (independent runs)."""
    runs = {}

    def get(change: str) -> tuple[Run, Run]:
        if not runs:
            for saved, _, _ in LAYOUT_CHANGES.values():
                trained.start(*family(saved)[0], nproc=family(saved)[1])
            started = {
                name: resume_on(stopped_at_3(saved), resumed, nproc, tmp_path_factory.mktemp(name))
                for name, (saved, resumed, nproc) in LAYOUT_CHANGES.items()
            }
            for name, run in started.items():
                saved = LAYOUT_CHANGES[name][0]
                runs[name] = finish(run), trained(*family(saved)[0], nproc=family(saved)[1]).check()
        return runs[change]

    return get


@pytest.mark.parametrize("change", sorted(LAYOUT_CHANGES))
def test_resume_on_another_layout_continues_the_uninterrupted_run(relaid, change):
    resumed, reference = relaid(change)
    assert " at iteration 3" in resumed.check().output
    assert resumed.steps == [
        1,
        2,
        3,
        4,
        5,
        6,
    ]  # the saved run's steps 1-3 start the new run directory's metrics
    by_step = {r["step"]: r for r in reference.records}
    for record in resumed.records:
        expected = by_step[record["step"]]
        for key, rtol in LAYOUT_RTOL.items():
            assert record[key] == pytest.approx(expected[key], rel=rtol, abs=0), (record["step"], key)
        assert record["lr"] == expected["lr"]


@pytest.mark.parametrize("change", sorted(LAYOUT_CHANGES))
def test_resume_on_another_layout_says_the_random_streams_are_reseeded(relaid, change):
    resumed, _ = relaid(change)
    assert "random streams do not carry over and are re-seeded from trainer.seed + iteration (1237)" in (
        resumed.check().output
    )


def test_a_tp_change_keeps_the_checkpoints_padded_vocabulary(relaid):
    # tp 1 pads the tokenizer's vocabulary to 384 rows (a multiple of 128), tp 2 would pad it to 512
    resumed, _ = relaid("tp1_to_tp2")
    assert "vocabulary: 384 rows as in the checkpoint" in resumed.check().output


def test_dp_reshardable_is_refused_on_another_tp_naming_both_layouts(stopped_at_3, tmp_path):
    saved = stopped_at_3("dense", "checkpoint.optimizer_format=dp_reshardable")
    refused = finish(resume_on(saved, "dense_tp2", 2, tmp_path))
    assert refused.returncode != 0
    assert refused.steps == []
    assert (
        "was saved on world 1 = dp 1 x tp 1 x pp 1 x cp 1 (ep 1) with checkpoint.optimizer_format=dp_reshardable"
        in refused.output
    )
    assert "this run is world 2 = dp 1 x tp 2 x pp 1 x cp 1 (ep 1) (tp changed)" in refused.output
