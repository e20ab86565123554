"""What a resumed run says (thdpack.training.resume) and the warmup's first step (thdpack.megatron.optimizer):
megatron-core's ``OptimizerParamScheduler`` keeps a checkpoint's schedule on resume, so a recipe whose schedule
changed is warned about with what the rest of the run will do; a complete run has nothing to train; the metrics of
an earlier attempt in another run directory start the new one's."""

import json

import pytest
import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from thdpack.megatron.optimizer import warmup_from_first_step
from thdpack.training.resume import RUN_DIR_FILE, continue_metrics, nothing_to_train, schedule_changes


def scheduler(train_iters: int, lr=1e-3, min_lr=1e-4, warmup=2, style="cosine") -> OptimizerParamScheduler:
    """The scheduler as thdpack.megatron.optimizer.build_optimizer builds it."""
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    init_lr, steps = warmup_from_first_step(lr, warmup)
    return OptimizerParamScheduler(
        optimizer, init_lr, lr, min_lr, steps, train_iters, style, 0.0, 0.0, train_iters, "constant"
    )


def rates(s: OptimizerParamScheduler, iters: int) -> list[float]:
    """The rate each iteration's update applies (the schedule moves after the update)."""
    out = []
    for _ in range(iters):
        out.append(s.optimizer.param_groups[0]["lr"])
        s.step(increment=1)
    return out


@pytest.mark.parametrize(("warmup", "first"), [(4, [2.5e-4, 5e-4, 7.5e-4, 1e-3]), (1, [1e-3]), (0, [1e-3])])
def test_warmup_updates_from_the_first_iteration_and_reaches_lr_at_its_last(warmup, first):
    assert rates(scheduler(10, warmup=warmup), len(first)) == pytest.approx(first, rel=1e-12)


def test_the_decay_after_warmup_ends_above_min_lr_on_the_last_iteration():
    lrs = rates(scheduler(10, warmup=2), 10)
    assert lrs[1] == 1e-3 and all(a > b for a, b in zip(lrs[1:], lrs[2:], strict=False))
    assert lrs[-1] > 1e-4


def test_raising_train_iters_on_resume_warns_that_the_checkpoints_schedule_continues_at_min_lr():
    saved = scheduler(20)
    saved.step(increment=20)
    resumed = scheduler(40)
    recipe = resumed.state_dict()
    resumed.load_state_dict(saved.state_dict())
    message = schedule_changes(recipe, resumed.state_dict(), iteration=20, train_iters=40)
    assert message.startswith(
        "the learning-rate schedule differs from the checkpoint's, and the checkpoint's"
    )
    assert "trainer.lr_decay_iters (null: train_iters) 20 in the checkpoint, 40 in the recipe" in message
    assert "iterations 21-40 train at min_lr 0.0001" in message
    assert rates(resumed, 1) == [1e-4]  # what megatron-core does, as said
    assert schedule_changes(recipe, resumed.state_dict(), iteration=40, train_iters=40) is None  # all done


def test_the_same_schedule_resumes_without_a_word():
    saved, resumed = scheduler(20), scheduler(20)
    recipe = resumed.state_dict()
    resumed.load_state_dict(saved.state_dict())
    assert schedule_changes(recipe, resumed.state_dict(), iteration=10, train_iters=20) is None


def test_a_complete_run_has_nothing_to_train():
    assert nothing_to_train("ckpt", 20, 20) == (
        "nothing to train: the checkpoint in ckpt is at iteration 20 and trainer.train_iters=20; raise "
        "trainer.train_iters to train further (no checkpoint is saved)"
    )
    assert nothing_to_train("ckpt", 19, 20) is None


def test_a_run_resumed_in_a_new_directory_continues_the_earlier_metrics(tmp_path):
    ckpt, first, second = tmp_path / "ckpt", tmp_path / "first", tmp_path / "second"
    assert continue_metrics(str(ckpt), first, 0) is None
    first.mkdir()
    lines = [json.dumps({"step": s, "loss": 1.0}) for s in (1, 2, 3, 4)]
    (first / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert continue_metrics(str(ckpt), second, 3) == first.resolve()
    assert (second / "metrics.jsonl").read_text() == "\n".join(lines[:3]) + "\n"  # step 4 is trained again
    assert (ckpt / RUN_DIR_FILE).read_text() == f"{second.resolve()}\n"


def test_a_run_resumed_in_its_own_directory_copies_nothing(tmp_path):
    ckpt, run = tmp_path / "ckpt", tmp_path / "run"
    continue_metrics(str(ckpt), run, 0)
    assert continue_metrics(str(ckpt), run, 3) is None
    assert not (run / "metrics.jsonl").exists()
