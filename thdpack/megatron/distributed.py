"""``wrap_model``: a family's bare Megatron module made ready to train (device, bf16, data parallelism)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .runtime import Runtime

__all__ = [
    "check_tp_comm_overlap",
    "fuse_te_wgrad_accumulation",
    "run_forward_pre_hooks",
    "sync_params",
    "te_wgrad_fusion",
    "wrap_model",
]


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
    bucket_size: int | None = None,
):
    """``module`` (this rank's stage of the model) on the runtime's device, in bf16 through Megatron's
    ``Float16Module`` when ``runtime.precision`` says so, inside Megatron's ``DistributedDataParallel`` with fp32
    gradient buffers, sharded for the distributed optimizer. ``fuse_wgrad``: :func:`fuse_te_wgrad_accumulation`
    (decided by :func:`te_wgrad_fusion`).

    ``overlap_grad_reduce``: each gradient bucket's reduce-scatter starts as soon as the last micro-batch's backward
    has filled it, instead of after the whole backward. ``overlap_param_gather``: the distributed optimizer's
    updated shards are all-gathered bucket by bucket during the next forward (Megatron's forward pre-hooks)
    instead of right after the optimizer step; parameters read outside a forward need :func:`sync_params` first.
    ``bucket_size``: parameters per gradient bucket (megatron-core's ``--ddp-bucket-size``; None: its default)."""
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
        bucket_size=bucket_size,
    )
    return DistributedDataParallel(config, ddp_config, module)


def check_tp_comm_overlap(config: Mapping) -> None:
    """Refuse ``model.config.tp_comm_overlap``: Transformer Engine overlaps tensor-parallel communication through
    userbuffers that megatron-core's trainer initialises for one ``[seq_length x micro_batch_size, hidden]``
    shape (``initialize_ub``) before the model is built. thdpack does not initialise them, and its packed
    micro-batches change length from one to the next; unrefused, the first forward fails inside TE."""
    if config.get("tp_comm_overlap"):
        raise ValueError(
            "model.config.tp_comm_overlap=true: Transformer Engine's tensor-parallel communication overlap needs "
            "userbuffers of one fixed micro-batch shape, which thdpack does not set up (packed micro-batches vary "
            "in length). Remove the key; trainer.overlap_grad_reduce and overlap_param_gather overlap the "
            "data-parallel communication"
        )


def sync_params(model) -> None:
    """Finish the parameter all-gather that ``overlap_param_gather`` leaves to the next forward, so that the
    parameters read now (a checkpoint's, an export's) are the updated ones; nothing to do without it."""
    for chunk in model if isinstance(model, list | tuple) else [model]:
        if getattr(chunk, "use_forward_hook", False):
            chunk.start_param_sync(force_sync=True)


def run_forward_pre_hooks(module, *args) -> None:
    """Run what calling ``module(*args)`` would run before its forward, for code that reads ``module``'s own
    parameters without calling it (a fused loss reading the output layer's weight, an adapter reading its
    ``ParameterDict``). Megatron-core's overlapped parameter all-gather (``overlap_param_gather``) waits for a
    module's updated parameters in such a hook: unreached, the parameters read are the step before's, and the
    next optimizer step stops on its bare ``assert self.param_gather_handle is None``. Without the overlap, or
    outside DDP, the module has no such hook and this does nothing."""
    for hook_id, hook in list(module._forward_pre_hooks.items()):
        if hook_id in module._forward_pre_hooks_with_kwargs:
            hook(module, args, {})
        else:
            hook(module, args)
