"""Where this process runs (:class:`Runtime`) and its process groups: ``torch.distributed`` from the torchrun
environment, then Megatron's model-parallel groups and seeded RNG streams. NCCL on CUDA; gloo on CPU through
:mod:`thdpack.megatron.cpu`."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["PRECISIONS", "Runtime", "init_distributed", "resolve_runtime", "serialize_cuda_connections"]

PRECISIONS = ("bf16", "fp32", "fp8")
BACKENDS = ("te", "torch")


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
        """bf16 weights (Megatron's ``Float16Module``): bf16 and fp8 runs."""
        return self.precision in ("bf16", "fp8")

    @property
    def params_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16 else torch.float32


def serialize_cuda_connections(tensor_parallel_size: int, context_parallel_size: int = 1) -> str | None:
    """Under tensor or context parallelism, one hardware queue to the GPU (``CUDA_DEVICE_MAX_CONNECTIONS=1``), as
    Megatron-LM's argument checks require and Transformer Engine asks for ("to guarantee overlapping TP and SP
    collectives with the backward GEMMs"): a layer's collective is then queued before the GEMM that can run beside
    it. Read when the CUDA context is created: call before anything touches the GPU. A value the user set is kept;
    returns a warning when it is not 1. Nothing to do without either."""
    if tensor_parallel_size <= 1 and context_parallel_size <= 1:
        return None
    value = os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    if value != "1":
        return (
            f"CUDA_DEVICE_MAX_CONNECTIONS={value} under tensor or context parallelism: Transformer Engine overlaps "
            "their collectives with the GEMMs only with 1 (thdpack sets 1 when it is unset)"
        )
    return None


def resolve_runtime(
    precision: str = "auto", backend: str = "auto", device: str | None = None, fp8_recipe: str | None = None
) -> Runtime:
    """``auto`` settings made concrete: bf16 and TE on CUDA; fp32 and torch on CPU.

    ``precision`` is the recipe's ``trainer.precision``, ``backend`` its ``model.attention_backend``; ``device``
    defaults to CUDA when a GPU is visible, else CPU; ``fp8_recipe`` is ``trainer.fp8_recipe`` (fp8 only)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if precision == "auto":
        precision = "bf16" if device == "cuda" else "fp32"
    if precision not in PRECISIONS:
        raise ValueError(f"trainer.precision is '{precision}': it must be auto, bf16, fp32 or fp8")
    if backend == "auto":
        backend = "te" if device == "cuda" else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"model.attention_backend is '{backend}': it must be auto, te or torch")
    return Runtime(device, precision, backend, fp8_recipe if precision == "fp8" else None)


def init_distributed(
    runtime: Runtime,
    *,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    seed: int = 0,
) -> None:
    """``torch.distributed`` from the torchrun environment (a single process without it), then Megatron's
    model-parallel groups and seeded RNG streams. NCCL on CUDA, gloo on CPU. After this call the parallel sizes
    are ``megatron.core.parallel_state``'s to tell."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if (
        "TORCHELASTIC_RUN_ID" in os.environ
        or "MASTER_PORT" not in os.environ
        or os.environ["WORLD_SIZE"] != "1"
    ):
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    else:
        # One process started without torchrun: a port of its own, not one a process before it (the same test
        # session, a parent that trained in-process) left in the environment and may still hold
        os.environ["MASTER_PORT"] = str(_free_port())
    sizes = dict(
        tensor_model_parallel_size=int(tensor_model_parallel_size),
        pipeline_model_parallel_size=int(pipeline_model_parallel_size),
        context_parallel_size=int(context_parallel_size),
        expert_model_parallel_size=int(expert_model_parallel_size),
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
