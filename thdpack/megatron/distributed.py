"""``wrap_model``: a family's bare Megatron module made ready to train (device, bf16, data parallelism)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .runtime import Runtime

__all__ = ["check_overlap", "fuse_te_wgrad_accumulation", "sync_params", "te_wgrad_fusion", "wrap_model"]


def te_wgrad_fusion(model_cfg: Mapping, runtime: Runtime) -> bool:
    """Whether Transformer Engine's layers accumulate weight gradients into Megatron's gradient buffer inside their
    weight-gradient GEMMs (:func:`fuse_te_wgrad_accumulation`): on a GPU with the TE backend, unless the recipe
    sets megatron-core's own ``model.config.gradient_accumulation_fusion`` (``false`` turns it off, ``true`` leaves
    it to megatron-core, which then needs Apex for its output layer)."""
    own = (model_cfg.get("config") or {}).get("gradient_accumulation_fusion")
    return runtime.device == "cuda" and runtime.backend == "te" and own is None


def fuse_te_wgrad_accumulation(module) -> None:
    """Make every Transformer Engine layer of ``module`` add its weight gradient into the parameter's ``main_grad``
    (Megatron's gradient buffer: fp32 unless ``trainer.main_grads_dtype=bf16``) inside the weight-gradient GEMM,
    where it would otherwise return a bf16 gradient that Megatron's backward hook converts and adds in separate
    kernels.

    This is what ``TransformerConfig.gradient_accumulation_fusion`` does for TE layers (they read their
    ``fuse_wgrad_accumulation`` at every forward, and megatron-core's fused MLP reads its linear layers' flag when it
    builds its TE operations at the first forward); megatron-core ties that flag to Apex's
    ``fused_weight_gradient_mlp_cuda``, which only its own ``ColumnParallelLinear`` needs, so without Apex the TE
    layers would lose it too. Call it before the first forward.

    Grouped experts (TE's ``GroupedLinear``) keep the unfused path: no test isolates their gradients (two runs of
    the tiny MoE model route differently on a GPU, though not on CPU)."""
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule
    from transformer_engine.pytorch.module.grouped_linear import GroupedLinear

    for layer in module.modules():
        te_layer = isinstance(layer, TransformerEngineBaseModule) and not isinstance(layer, GroupedLinear)
        # a frozen layer (LoRA's base) has no weight gradient and no main_grad to accumulate into
        trained = any(p.requires_grad for p in layer.parameters(recurse=False))
        if te_layer and trained and hasattr(layer, "fuse_wgrad_accumulation"):
            layer.fuse_wgrad_accumulation = True


def wrap_model(
    module,
    config,
    runtime: Runtime,
    grad_reduce_in_fp32: bool = True,
    fuse_wgrad: bool = False,
    overlap_grad_reduce: bool = False,
    overlap_param_gather: bool = False,
):
    """``module`` (this rank's stage of the model) on the runtime's device, in bf16 through Megatron's
    ``Float16Module`` when ``runtime.precision`` says so, inside Megatron's ``DistributedDataParallel`` with fp32
    gradient buffers, sharded for the distributed optimizer. ``fuse_wgrad``: :func:`fuse_te_wgrad_accumulation`
    (decided by :func:`te_wgrad_fusion`).

    ``overlap_grad_reduce``: each gradient bucket's reduce-scatter starts as soon as the last micro-batch's backward
    has filled it, instead of after the whole backward. ``overlap_param_gather``: the distributed optimizer's
    updated shards are all-gathered bucket by bucket during the next forward (Megatron's forward pre-hooks)
    instead of right after the optimizer step; parameters read outside a forward need :func:`sync_params` first."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    if fuse_wgrad:
        fuse_te_wgrad_accumulation(module)
    if runtime.device == "cuda":
        module.cuda(torch.cuda.current_device())
    if runtime.bf16:
        from megatron.core.transformer.module import Float16Module

        module = Float16Module(config, module)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32,
        use_distributed_optimizer=True,
        overlap_grad_reduce=overlap_grad_reduce,
        overlap_param_gather=overlap_param_gather,
    )
    return DistributedDataParallel(config, ddp_config, module)


def check_overlap(trainer: Mapping, parallel: Mapping, device: str) -> None:
    """Refuse the communication overlap where it has not run: on a GPU it trained under data parallelism
    (llama3_1b, two H200s), and stopped at the second step with a bare ``AssertionError`` under tensor parallelism
    (llama3_8b, TP2 x DP2) and expert parallelism (Qwen3-30B-A3B shape, EP4) on four H200s
    (benchmarks/results/scale_h200x4_2026-11-27.md). On CPU every layout trains with it (tests)."""
    keys = [k for k in ("overlap_grad_reduce", "overlap_param_gather") if trainer.get(k) is True]
    tp, ep = int(parallel["tensor_model_parallel_size"]), int(parallel["expert_model_parallel_size"])
    if keys and device == "cuda" and (tp > 1 or ep > 1):
        raise ValueError(
            f"trainer.{keys[0]}=true with parallel.tensor_model_parallel_size={tp}, "
            f"expert_model_parallel_size={ep} on a GPU: with Transformer Engine it stopped at the second step "
            "(megatron-core's gradient buckets asserted) under tensor and expert parallelism; it is verified under "
            "data parallelism only. Set trainer.overlap_grad_reduce=false trainer.overlap_param_gather=false"
        )


def sync_params(model) -> None:
    """Finish the parameter all-gather that ``overlap_param_gather`` leaves to the next forward, so that the
    parameters read now (a checkpoint's, an export's) are the updated ones; nothing to do without it."""
    for chunk in model if isinstance(model, list | tuple) else [model]:
        if getattr(chunk, "use_forward_hook", False):
            chunk.start_param_sync(force_sync=True)
