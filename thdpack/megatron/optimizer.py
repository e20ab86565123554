"""The optimizer side of a step: Megatron's distributed Adam and its schedule from a recipe's ``trainer`` group,
the gradient finalisation Megatron's schedules call (per-token division on the device), and the optimizer step
with the update held back on a non-finite gradient norm."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

__all__ = ["build_optimizer", "finalize_grads_per_token", "warmup_from_first_step"]


def build_optimizer(trainer: Mapping, model, config):
    """Megatron's distributed Adam (``get_megatron_optimizer``) and ``OptimizerParamScheduler`` (warmup, then
    decay to ``min_lr`` over ``lr_decay_iters``; stepped once per iteration)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from .optimizer_precision import optimizer_precision_kwargs

    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=float(trainer["lr"]),
            min_lr=float(trainer["min_lr"]),
            weight_decay=float(trainer["weight_decay"]),
            adam_beta1=float(trainer["adam_beta1"]),
            adam_beta2=float(trainer["adam_beta2"]),
            clip_grad=float(trainer["clip_grad"]),
            bf16=config.bf16,
            params_dtype=config.params_dtype,
            use_distributed_optimizer=True,
            **optimizer_precision_kwargs(trainer),
        ),
        [model],
    )
    decay_iters = trainer.get("lr_decay_iters") or trainer["train_iters"]
    init_lr, warmup_steps = warmup_from_first_step(float(trainer["lr"]), int(trainer["lr_warmup_iters"]))
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=init_lr,
        max_lr=float(trainer["lr"]),
        min_lr=float(trainer["min_lr"]),
        lr_warmup_steps=warmup_steps,
        lr_decay_steps=int(decay_iters),
        lr_decay_style=trainer["lr_decay_style"],
        start_wd=float(trainer["weight_decay"]),
        end_wd=float(trainer["weight_decay"]),
        wd_incr_steps=int(decay_iters),
        wd_incr_style="constant",
    )
    # What Megatron's schedules call around the micro-batches: gradient all-reduce/reduce-scatter only after
    # the last one, and the per-token division by the step's token count (calculate_per_token_loss).
    config.no_sync_func = model.no_sync
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_grads_per_token
    return optimizer, scheduler


def warmup_from_first_step(lr: float, warmup_iters: int) -> tuple[float, int]:
    """``(init_lr, lr_warmup_steps)`` for ``OptimizerParamScheduler`` so that iteration ``k`` of a warmup of
    ``warmup_iters`` updates with ``lr * k / warmup_iters``: the first update is not zero and iteration
    ``warmup_iters`` is the first at ``lr``. Megatron's own warmup (``init_lr=0``, ``lr_warmup_steps=warmup_iters``)
    gives iteration 1 the rate ``init_lr`` (the scheduler is at step 0 then): its update does nothing."""
    if warmup_iters <= 1:
        return lr, 0
    return lr / warmup_iters, warmup_iters - 1


def finalize_grads_per_token(model, num_tokens=None, **kwargs) -> None:
    """Megatron's ``finalize_model_grads``, with the division by the global batch's token count done on the
    device: megatron-core 0.16.1's ``megatron/core/distributed/finalize_model_grads.py::finalize_model_grads``
    tests ``num_tokens > 0`` on the host (``if num_tokens > 0: scaling = 1.0 / num_tokens``), one host-device
    sync per step. A step with no counted token leaves the gradients as they are (they are zero), as Megatron's
    test does."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(model, None, **kwargs)
    if num_tokens is None:
        return
    if ps.get_pipeline_model_parallel_world_size() > 1:  # the count is known on the last stage only
        dist.broadcast(
            num_tokens,
            src=ps.get_pipeline_model_parallel_last_rank(),
            group=ps.get_pipeline_model_parallel_group(),
        )
    dist.all_reduce(num_tokens, group=ps.get_data_parallel_group(with_context_parallel=True))
    scale = 1.0 / num_tokens.clamp(min=1).to(torch.float32)
    for chunk in model:
        chunk.scale_gradients(scale)
