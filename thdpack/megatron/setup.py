"""Megatron-core from a recipe: process groups, ``TransformerConfig``, the model, the optimizer and its schedule.

Each function takes the recipe's groups (``model``, ``parallel``, ``trainer``; plain mappings or OmegaConf) and
returns Megatron-core objects; :mod:`thdpack.train` calls them in order. On CUDA: NCCL, bf16 by default,
Transformer Engine attention. On CPU: gloo through :mod:`thdpack.megatron.cpu`, fp32, thdpack's torch attention.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import math
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger("thdpack")

ACTIVATIONS = ("silu", "gelu", "relu", "squared_relu")
MODEL_KEYS = (
    "attention_backend",
    "position_embedding_type",
    "rotary_base",
    "vocab_size",
    "share_embeddings_and_output_weights",
    "attention_mask_type",
    "output_loss",
    "config",
)


@dataclass(frozen=True)
class Runtime:
    """Where this process runs: ``device`` ("cuda" or "cpu"), ``precision`` ("bf16", "fp32" or "fp8": bf16
    weights and TE's FP8 GEMMs with ``fp8_recipe``, :mod:`thdpack.megatron.fp8`) and the attention ``backend``
    ("te" or "torch")."""

    device: str
    precision: str
    backend: str
    fp8_recipe: str | None = None

    @property
    def bf16(self) -> bool:
        return self.precision in ("bf16", "fp8")

    @property
    def params_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16 else torch.float32


def resolve_runtime(model: Mapping, trainer: Mapping) -> Runtime:
    """``auto`` settings made concrete: CUDA when a GPU is visible, bf16 and TE there; CPU, fp32, torch else."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    precision = trainer.get("precision", "auto")
    if precision == "auto":
        precision = "bf16" if device == "cuda" else "fp32"
    if precision not in ("bf16", "fp32", "fp8"):
        raise ValueError(f"trainer.precision is '{precision}': it must be auto, bf16, fp32 or fp8")
    backend = model.get("attention_backend", "auto")
    if backend == "auto":
        backend = "te" if device == "cuda" else "torch"
    if backend not in ("te", "torch"):
        raise ValueError(f"model.attention_backend is '{backend}': it must be auto, te or torch")
    return Runtime(device, precision, backend, trainer.get("fp8_recipe") if precision == "fp8" else None)


def init_distributed(parallel: Mapping, seed: int, runtime: Runtime) -> None:
    """``torch.distributed`` from the torchrun environment (a single process without it), then Megatron's
    model-parallel groups and seeded RNG streams. NCCL on CUDA, gloo on CPU."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    sizes = dict(
        tensor_model_parallel_size=int(parallel["tensor_model_parallel_size"]),
        pipeline_model_parallel_size=int(parallel["pipeline_model_parallel_size"]),
        context_parallel_size=int(parallel["context_parallel_size"]),
        expert_model_parallel_size=int(parallel["expert_model_parallel_size"]),
    )
    if runtime.device == "cpu":
        from .cpu import initialize_model_parallel_cpu

        initialize_model_parallel_cpu(**sizes, seed=seed)
        return
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    parallel_state.initialize_model_parallel(**sizes)
    model_parallel_cuda_manual_seed(seed)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def transformer_config(model: Mapping, parallel: Mapping, runtime: Runtime):
    """Megatron's ``TransformerConfig`` from ``model.config`` (Megatron's own key names) and the parallel sizes.

    thdpack sets what its step needs: per-token loss, variable sequence lengths under pipeline parallelism (the
    packed token count changes per micro-batch), and fused RoPE when packing with Transformer Engine (the unfused
    THD RoPE syncs twice per layer and loops over samples in Python).
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    from .fp8 import fp8_config

    unknown = sorted(set(model) - set(MODEL_KEYS) - {"name"})
    if unknown:
        raise ValueError(f"model has unknown keys {unknown}: known keys are {list(MODEL_KEYS)}")
    kwargs = dict(model.get("config") or {})
    activation = kwargs.pop("activation_func", "gelu")
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"model.config.activation_func is '{activation}': it must be one of {list(ACTIVATIONS)}"
        )
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    unknown = sorted(set(kwargs) - fields)
    if unknown:
        raise ValueError(
            f"model.config has keys that megatron.core TransformerConfig does not know: {unknown}"
        )
    tp, pp = int(parallel["tensor_model_parallel_size"]), int(parallel["pipeline_model_parallel_size"])
    sequence_parallel = bool(parallel.get("sequence_parallel", False)) and tp > 1
    if pp > 1 and not kwargs.get("num_moe_experts"):
        # megatron-core 0.16 accepts variable_seq_lengths only with this dispatcher, experts or not
        kwargs["moe_token_dispatcher_type"] = "alltoall"
    on_cpu = runtime.device == "cpu"
    bf16 = runtime.bf16
    gated = bool(kwargs.get("gated_linear_unit", False))
    fused = dict(
        # Megatron fuses the bias with gelu or swiglu (silu, gated) only
        bias_activation_fusion=not on_cpu and (activation == "gelu" or (activation == "silu" and gated)),
        masked_softmax_fusion=not on_cpu,
        # Megatron's output layer fuses the weight-gradient accumulation with Apex's extension only
        gradient_accumulation_fusion=importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None,
        persist_layer_norm=not on_cpu,
        apply_rope_fusion=runtime.backend == "te",
    )
    return TransformerConfig(
        **{**fused, **kwargs},
        **fp8_config(runtime.precision, runtime.fp8_recipe),
        activation_func=_activation(activation),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=int(parallel["context_parallel_size"]),
        expert_model_parallel_size=int(parallel["expert_model_parallel_size"]),
        sequence_parallel=sequence_parallel,
        calculate_per_token_loss=True,
        variable_seq_lengths=pp > 1,
        bf16=bf16,
        params_dtype=runtime.params_dtype,
        pipeline_dtype=runtime.params_dtype,
        use_cpu_initialization=on_cpu,
    )


def _activation(name: str):
    import torch.nn.functional as F

    if name == "squared_relu":
        return lambda x: torch.pow(F.relu(x), 2)
    return {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}[name]


def padded_vocab_size(model: Mapping, tokenizer_vocab: int, tp: int) -> int:
    """``model.vocab_size``, or the tokenizer's rounded up to a multiple of ``128 * tp`` (Megatron's rule)."""
    size = model.get("vocab_size")
    if size is None:
        multiple = 128 * tp
        return -(-tokenizer_vocab // multiple) * multiple
    size = int(size)
    if size < tokenizer_vocab:
        raise ValueError(
            f"model.vocab_size is {size} but the tokenizer has {tokenizer_vocab} ids: raise it or set it to null"
        )
    if size % tp:
        raise ValueError(f"model.vocab_size {size} is not divisible by tensor_model_parallel_size {tp}")
    return size


def build_model(
    model: Mapping,
    config,
    vocab_size: int,
    max_sequence_length: int,
    runtime: Runtime,
    grad_reduce_in_fp32: bool = True,
):
    """This rank's ``GPTModel`` (bf16 through Megatron's ``Float16Module``) in Megatron's
    ``DistributedDataParallel`` with fp32 gradient buffers (bf16 with ``grad_reduce_in_fp32=False``), sharded for
    the distributed optimizer."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from .models import build_gpt_model
    from .output_loss import resolve_output_loss, use_output_loss

    module = build_gpt_model(
        config,
        vocab_size,
        max_sequence_length,
        backend=runtime.backend,
        position_embedding_type=model.get("position_embedding_type", "rope"),
        rotary_base=int(model.get("rotary_base", 10000)),
        share_embeddings_and_output_weights=bool(model.get("share_embeddings_and_output_weights", False)),
    )
    use_output_loss(module, resolve_output_loss(model, runtime.device))
    if runtime.device == "cuda":
        module.cuda(torch.cuda.current_device())
    if runtime.bf16:
        from megatron.core.transformer.module import Float16Module

        module = Float16Module(config, module)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32, use_distributed_optimizer=True
    )
    return DistributedDataParallel(config, ddp_config, module)


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
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=float(trainer["lr"]),
        min_lr=float(trainer["min_lr"]),
        lr_warmup_steps=int(trainer["lr_warmup_iters"]),
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


def finalize_grads_per_token(model, num_tokens=None, **kwargs) -> None:
    """Megatron's ``finalize_model_grads``, with the division by the global batch's token count done on the
    device: megatron-core (0.16) tests ``num_tokens > 0`` on the host, one host-device sync per step. A step
    with no counted token leaves the gradients as they are (they are zero), as Megatron's test does."""
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


@torch.no_grad()
def optimizer_step(optimizer) -> tuple[bool, float]:
    """Megatron's optimizer step with the update held back when the global gradient norm is not finite.

    Returns ``(updated, grad_norm)``. The norm is the one Megatron computes for clipping (one all-reduce and one
    host read per step, as in ``optimizer.step()``); a non-finite norm leaves every parameter as it was, so the
    caller can stop or skip the step.
    """
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    found_inf = optimizer.prepare_grads()
    grad_norm = float(optimizer.get_grad_norm())
    if found_inf or not math.isfinite(grad_norm):
        return False, grad_norm
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        params = sub.get_parameters()
        if sub.config.clip_grad > 0.0 and params:
            clip_grad_by_total_norm_fp32(params, max_norm=sub.config.clip_grad, total_norm=grad_norm)
    return bool(optimizer.step_with_ready_grads()), grad_norm
