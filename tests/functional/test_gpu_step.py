"""GPU: whole training steps make no host-device sync in steady state.

A step is what the training loop runs per iteration: the loader's next global batch, thdpack's forward step under
Megatron's schedule (pack, CP shard, copies, forward, backward, the gradient reduction and the per-token division),
the optimizer step (:class:`thdpack.megatron.device_step.OptimizerStep`: gradient norm, clipping and the
non-finite skip on the device), the schedule, and the step's scalars handed to
:class:`thdpack.training.deferred.DeferredScalars`, whose values of the previous step are then read. Three such
steps run under ``torch.cuda.set_sync_debug_mode("error")``: any sync raises. (The sync debug mode does not see
``Event.synchronize``: the deferred read waits on the event of a step whose successor is already queued.)
"""

from __future__ import annotations

import os

import pytest

from .gpu import WITH_TE, steady_step_scalars

pytestmark = WITH_TE


def _run(model: str, extra: list[str]):
    from hydra import compose, initialize_config_dir

    from thdpack.training.loop import recipes_dir, setup_run

    os.environ.pop("MASTER_PORT", None)
    overrides = [
        f"model={model}",
        "dataset.seq_length=512",
        "dataset.micro_batch_size=4",
        "dataset.global_batch_size=16",
        "dataset.max_files=40",
        "trainer.train_iters=10",
        *extra,
    ]
    with initialize_config_dir(str(recipes_dir()), version_base="1.3"):
        return setup_run(compose("train", overrides=overrides))


@pytest.mark.parametrize(
    ("model", "extra"),
    [
        ("tiny_gpt", []),
        ("tiny_gpt", ["dataset.micro_batch_tokens=null"]),
        ("tiny_mrope", []),
        ("tiny_gpt", ["model.output_loss=megatron"]),
    ],
    ids=["dense_budget", "dense_samples", "mrope", "megatron_output_loss"],
)
def test_whole_training_steps_make_no_sync_in_steady_state(model, extra):
    from thdpack.training.loop import STEP_SCALARS, _shutdown

    run = _run(model, extra)
    try:
        assert run.optimizer_step.gated, run.optimizer_step.host_read_reason
        settled = steady_step_scalars(run)
        assert [step for step, _, _ in settled] == [3, 4, 5, 6]
        for _, values, _ in settled:
            record = dict(zip(STEP_SCALARS, values, strict=True))
            assert record["skipped"] == 0.0 and record["grad_norm"] > 0 and 0 < record["loss"] < 20
    finally:
        _shutdown()
