"""Stopping early (thdpack.training.stopping.EarlyStop) in one gloo process: SIGUSR1 only notes the request, the
end-of-step agreement turns it (or the elapsed time) into a reason, and the marker that launch/slurm.sbatch reads
is left only where a checkpoint was saved. The whole path under the SLURM script (signal -> save -> exit ->
requeue -> resume) runs in tests/functional/test_launch.py.
"""

import json
import os
import signal

import pytest
import torch.distributed as dist

from thdpack.training.stopping import EXIT_SIGNAL, MARKER, EarlyStop


@pytest.fixture
def world(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def stop(world):
    made = []

    def make(**kwargs) -> EarlyStop:
        made.append(EarlyStop(**kwargs))
        return made[-1]

    yield make
    for each in made:
        each.close()


def test_without_a_signal_or_a_time_limit_the_run_goes_on(stop):
    assert stop().agreed() is None


def test_sigusr1_stops_after_the_step(stop):
    early = stop()
    os.kill(os.getpid(), signal.SIGUSR1)
    assert early.signalled
    assert early.agreed() == "SIGUSR1 (the scheduler's warning)"


def test_exit_duration_mins_stops_once_passed(stop):
    early = stop(exit_duration_mins=1e-9)
    assert early.agreed() == "trainer.exit_duration_mins=1e-09 passed"


@pytest.mark.parametrize("minutes", [0, -5])
def test_exit_duration_mins_must_be_positive(minutes):
    with pytest.raises(ValueError, match=f"trainer.exit_duration_mins is {minutes}: it must be a positive"):
        EarlyStop(exit_duration_mins=minutes)


def test_the_marker_names_the_step_the_reason_and_the_checkpoint(stop, tmp_path):
    stop().record(tmp_path, 7, "SIGUSR1 (the scheduler's warning)", tmp_path / "ckpt", write=True)
    assert json.loads((tmp_path / MARKER).read_text()) == {
        "iteration": 7,
        "reason": "SIGUSR1 (the scheduler's warning)",
        "checkpoint_dir": str(tmp_path / "ckpt"),
    }


def test_no_marker_without_a_checkpoint_to_resume_from(stop, tmp_path):
    stop().record(tmp_path, 7, "SIGUSR1 (the scheduler's warning)", None, write=True)
    assert not (tmp_path / MARKER).exists()


def test_close_gives_the_signal_back_to_its_previous_handler(world):
    previous = signal.getsignal(EXIT_SIGNAL)
    EarlyStop().close()
    assert signal.getsignal(EXIT_SIGNAL) is previous


@pytest.mark.parametrize(
    ("sig", "reason"),
    [
        (signal.SIGTERM, "SIGTERM (a request to terminate)"),
        (signal.SIGINT, "SIGINT (an interrupt; a second one stops at once)"),
    ],
)
def test_sigterm_and_a_first_sigint_stop_after_the_step(stop, sig, reason):
    early = stop()
    os.kill(os.getpid(), sig)
    assert early.agreed() == reason


def test_a_second_sigint_stops_at_once(stop):
    from thdpack.training.signals import StopNow

    stop()
    os.kill(os.getpid(), signal.SIGINT)
    with pytest.raises(StopNow, match="a second SIGINT: stopping at once, without a checkpoint"):
        os.kill(os.getpid(), signal.SIGINT)
        signal.getsignal(signal.SIGINT)  # the handler runs between bytecodes: here at the latest


def test_a_signal_noted_before_the_loop_starts_counts(world):
    from thdpack.training import signals

    signals.install()  # what python -m thdpack.train does before its imports
    os.kill(os.getpid(), signal.SIGUSR1)
    early = EarlyStop()
    try:
        assert early.agreed() == "SIGUSR1 (the scheduler's warning)"
    finally:
        early.close()
        signals.uninstall()


def test_no_marker_when_a_person_interrupted_the_run(stop, tmp_path):
    reason = "SIGINT (an interrupt; a second one stops at once)"
    stop().record(tmp_path, 7, reason, tmp_path / "ckpt", write=True)
    assert not (tmp_path / MARKER).exists()
