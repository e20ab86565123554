"""Megatron's ``TransformerConfig`` and the padded vocabulary size from a recipe's ``model`` and ``parallel``
groups (plain mappings or OmegaConf)."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from collections.abc import Mapping

import torch

from .runtime import Runtime

__all__ = ["ACTIVATIONS", "padded_vocab_size", "transformer_config"]

ACTIVATIONS = ("silu", "gelu", "relu", "squared_relu", "gelu_tanh", "quick_gelu")


def transformer_config(model: Mapping, parallel: Mapping, runtime: Runtime):
    """Megatron's ``TransformerConfig`` from ``model.config`` (Megatron's own key names) and the parallel sizes.

    thdpack sets what its step needs: per-token loss, variable sequence lengths under pipeline parallelism (the
    packed token count changes per micro-batch), and fused RoPE when packing with Transformer Engine (the unfused
    THD RoPE syncs twice per layer and loops over samples in Python).
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(model.get("config") or {})
    _plain_window_keys(kwargs)
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
        # megatron-core 0.16.1 accepts variable_seq_lengths only with this dispatcher, experts or not
        # (TransformerConfig.__post_init__ raises for allgather, transformer_config.py:1827)
        kwargs["moe_token_dispatcher_type"] = "alltoall"
    on_cpu = runtime.device == "cpu"
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
    from .fp8 import fp8_config

    # trainer.precision=fp8 (model.config.fp8 / fp8_recipe, Megatron's own keys, win where given); an fp8 run's
    # model rebuilt on CPU (python -m thdpack.export) has its bf16 weights and no FP8 GEMM
    precision = runtime.precision if runtime.device == "cuda" else "bf16"
    fp8 = {k: v for k, v in fp8_config(precision, runtime.fp8_recipe).items() if k not in kwargs}
    return TransformerConfig(
        **{**fused, **kwargs},
        **fp8,
        activation_func=_activation(activation),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=int(parallel["context_parallel_size"]),
        expert_model_parallel_size=int(parallel["expert_model_parallel_size"]),
        sequence_parallel=sequence_parallel,
        calculate_per_token_loss=True,
        variable_seq_lengths=pp > 1,
        bf16=runtime.bf16,
        params_dtype=runtime.params_dtype,
        pipeline_dtype=runtime.params_dtype,
        use_cpu_initialization=on_cpu,
    )


def _plain_window_keys(kwargs: dict) -> None:
    """``window_size`` as the tuple and ``window_attn_skip_freq`` as the list Megatron and TE compare with
    (a recipe holds them as OmegaConf or JSON lists)."""
    if kwargs.get("window_size") is not None:
        kwargs["window_size"] = tuple(int(v) for v in kwargs["window_size"])
    freq = kwargs.get("window_attn_skip_freq")
    if freq is not None and not isinstance(freq, int):
        kwargs["window_attn_skip_freq"] = [int(v) for v in freq]


def _activation(name: str):
    import torch.nn.functional as F

    if name == "squared_relu":
        return lambda x: torch.pow(F.relu(x), 2)
    if name == "gelu_tanh":  # transformers' gelu_pytorch_tanh (Gemma)
        return functools.partial(F.gelu, approximate="tanh")
    if name == "quick_gelu":  # x * sigmoid(1.702 x): gpt-oss's gate (megatron-core's quick_gelu, uncompiled)
        return _quick_gelu
    return {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}[name]


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


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
