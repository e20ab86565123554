"""Transformer Engine core attention (GPU), imported only when asked for."""

from __future__ import annotations


def te_core_attention() -> type:
    """Megatron-core's `TEDotProductAttention` class (consumes `packed_seq_params` natively).

    Raises:
        ImportError: Transformer Engine is not installed (`pip install thdpack[gpu]`).
    """
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError as err:
        raise ImportError(
            "the 'te' attention backend needs Transformer Engine on a CUDA machine: "
            "install it with `pip install thdpack[gpu]` (or use backend='torch')"
        ) from err
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    return TEDotProductAttention
