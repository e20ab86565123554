"""GPU: the recipe's training step in steady state makes no host-device sync on the packed path.

The step is thdpack's forward step under Megatron's schedule (pack, CP shard, copies, forward, backward, the
gradient reduction and the per-token division, ``thdpack.megatron.optimizer.finalize_grads_per_token``) followed by
Megatron's optimizer step. The first part runs under ``torch.cuda.set_sync_debug_mode("error")``: any sync
raises. Megatron's optimizer step reads the global gradient norm back to the host for clipping
(``get_grad_norm``): that one sync per step is Megatron's and is counted here, so that a new one cannot slip in.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        importlib.util.find_spec("transformer_engine") is None, reason="needs Transformer Engine"
    ),
]

# Megatron's optimizer step: the gradient norm read back for clipping (megatron.core.optimizer.clip_grads).
OPTIMIZER_SYNCS = 1


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
    [("tiny_gpt", []), ("tiny_gpt", ["dataset.micro_batch_tokens=null"]), ("tiny_mrope", [])],
    ids=["dense_budget", "dense_samples", "mrope"],
)
def test_packed_step_makes_no_sync_in_steady_state(model, extra):
    from thdpack.megatron.optimizer import optimizer_step
    from thdpack.training.loop import _shutdown, forward_backward, train_step
    from thdpack.training.profiling import catch_syncs

    run = _run(model, extra)
    try:
        for _ in range(3):  # warm-up: plan caches, allocator, cuDNN/TE autotuning
            train_step(run, run.data.next_step())
        for _ in range(2):
            batches = run.data.next_step()
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                losses = forward_backward(run, batches)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            with catch_syncs() as sites:
                updated, _ = optimizer_step(run.optimizer)
            assert updated
            assert len(sites) == OPTIMIZER_SYNCS, sites
            run.scheduler.step(increment=1)
            assert losses and all(torch.isfinite(r["lm loss"]).all() for r in losses)
    finally:
        _shutdown()
