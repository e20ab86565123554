"""``wrap_model``: a family's bare Megatron module made ready to train (device, bf16, data parallelism)."""

from __future__ import annotations

import torch

from .runtime import Runtime

__all__ = ["wrap_model"]


def wrap_model(module, config, runtime: Runtime, grad_reduce_in_fp32: bool = True):
    """``module`` (this rank's stage of the model) on the runtime's device, in bf16 through Megatron's
    ``Float16Module`` when ``runtime.precision`` says so, inside Megatron's ``DistributedDataParallel`` with fp32
    gradient buffers, sharded for the distributed optimizer."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    if runtime.device == "cuda":
        module.cuda(torch.cuda.current_device())
    if runtime.bf16:
        from megatron.core.transformer.module import Float16Module

        module = Float16Module(config, module)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32, use_distributed_optimizer=True
    )
    return DistributedDataParallel(config, ddp_config, module)
