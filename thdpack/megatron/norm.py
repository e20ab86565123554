"""A torch LayerNorm/RMSNorm for Megatron's local layer spec that also works under sequence parallelism.

Megatron's local spec uses Apex's `FusedLayerNorm` when Apex imports and otherwise `WrappedTorchNorm`, which
asserts `not config.sequence_parallel`: it does not mark its weights. Under sequence parallelism each
tensor-parallel rank normalises its own slice of the sequence, so the norm's weight and bias get partial
gradients that `finalize_model_grads` must all-reduce over the tensor-parallel group; it does so for
parameters marked `sequence_parallel=True`, as Apex's and TE's norms mark theirs. `TorchNorm` builds the
same torch module as `WrappedTorchNorm` and marks it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

__all__ = ["TorchNorm", "build_sequence_parallel_norm", "use_torch_norm"]


def build_sequence_parallel_norm(
    build: Callable[..., torch.nn.Module], config, *args, **kwargs
) -> torch.nn.Module:
    """``build(config, *args, **kwargs)`` (a `WrappedTorchNorm`-style constructor), run with a copy of
    ``config`` that has sequence parallelism off, its parameters then marked ``sequence_parallel=True``.
    Without sequence parallelism, ``build`` as is."""
    if not config.sequence_parallel:
        return build(config, *args, **kwargs)
    config = copy.copy(config)  # shallow: TransformerConfig.__post_init__ does not run again
    config.sequence_parallel = False
    norm = build(config, *args, **kwargs)
    for param in norm.parameters():
        param.sequence_parallel = True
    return norm


class TorchNorm:
    """Megatron's `WrappedTorchNorm` (torch `LayerNorm` or `RMSNorm` per `config.normalization`), with
    sequence parallelism, and the zero-centred RMSNorm (`thdpack.megatron.zero_centered_norm`) where
    `config.layernorm_zero_centered_gamma` asks for it. Same constructor arguments; returns the torch module."""

    def __new__(cls, config, *args, **kwargs) -> torch.nn.Module:
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        if config.layernorm_zero_centered_gamma:
            from .zero_centered_norm import ZeroCenteredRMSNorm

            return ZeroCenteredRMSNorm(config, *args, **kwargs)
        return build_sequence_parallel_norm(WrappedTorchNorm, config, *args, **kwargs)


def use_torch_norm(layer_spec) -> None:
    """Replace `WrappedTorchNorm` by :class:`TorchNorm` in a transformer-layer spec, in place: the input
    and pre-MLP norms and the attention's query/key norms. Apex's norm, where the spec has it, stays."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    holders = [layer_spec.submodules, getattr(layer_spec.submodules.self_attention, "submodules", None)]
    for holder in holders:
        for name in ("input_layernorm", "pre_mlp_layernorm", "q_layernorm", "k_layernorm", "kv_layernorm"):
            if getattr(holder, name, None) is WrappedTorchNorm:
                setattr(holder, name, TorchNorm)
