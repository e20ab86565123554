"""RMSNorm with a zero-centred weight, ``x / rms(x) * (1 + weight)``, for Megatron's local (torch) layer spec.

Megatron's ``layernorm_zero_centered_gamma`` (TE's ``zero_centered_gamma``) is this norm, but the local spec's torch
norm refuses it (``WrappedTorchNorm`` asserts ``not config.layernorm_zero_centered_gamma``). The models that store
``weight`` centred on zero (Qwen3.5's and Qwen3-Next's ``RMSNorm``, Gemma's) compute it in float32 and cast the
product back: ``(x.float() * rsqrt(mean(x.float()^2) + eps) * (1 + weight.float())).type_as(x)``, as here.
"""

from __future__ import annotations

import torch

from .norm import build_sequence_parallel_norm

__all__ = ["ZeroCenteredRMSNorm", "ZeroCenteredRMSNormModule"]


class ZeroCenteredRMSNormModule(torch.nn.Module):
    """``x / rms(x) * (1 + weight)`` over the last dim, in float32; ``weight`` starts at zero."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


class ZeroCenteredRMSNorm:
    """A Megatron layer-spec norm (``WrappedTorchNorm``'s constructor arguments) building
    :class:`ZeroCenteredRMSNormModule`, its weight marked for sequence parallelism as Megatron's norms are
    (:func:`thdpack.megatron.norm.build_sequence_parallel_norm`)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_) -> torch.nn.Module:
        def build(config, hidden_size, eps):
            if config.normalization != "RMSNorm":
                raise ValueError(
                    f"ZeroCenteredRMSNorm is an RMSNorm; config.normalization is {config.normalization}"
                )
            return ZeroCenteredRMSNormModule(hidden_size, eps, dtype=config.params_dtype)

        return build_sequence_parallel_norm(build, config, hidden_size, eps)
