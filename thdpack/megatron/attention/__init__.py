"""Core-attention modules for THD batches: `te` (Transformer Engine, GPU) and `torch` (ours)."""

from __future__ import annotations

CORE_ATTENTION_BACKENDS = ("torch", "te")


def get_core_attention(backend: str) -> type:
    """The `core_attention` module class for a Megatron layer spec.

    Args:
        backend: `"torch"` (`TorchTHDAttention`: varlen / flash-attn / SDPA, CPU or GPU) or `"te"`
            (Megatron's `TEDotProductAttention`; needs Transformer Engine).
    """
    if backend == "torch":
        from thdpack.megatron.attention.torch_attention import TorchTHDAttention

        return TorchTHDAttention
    if backend == "te":
        from thdpack.megatron.attention.te import te_core_attention

        return te_core_attention()
    raise ValueError(f"unknown attention backend {backend!r}; choose one of {CORE_ATTENTION_BACKENDS}")


__all__ = ["CORE_ATTENTION_BACKENDS", "get_core_attention"]
