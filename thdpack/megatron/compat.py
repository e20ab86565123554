"""Megatron-core without Transformer Engine, on any device: what the torch backend needs.

`moe_utils.RouterGatingLinearFunction` tests the module global `te_general_gemm is not None`
(megatron-core 0.16.1 transformer/moe/moe_utils.py:1192), but defines that global only inside its
`try: from megatron.core.extensions.transformer_engine import ...` (moe_utils.py:34), so an MoE router without
TE raises `NameError` on a GPU as on a CPU. Defining it as None selects the router's plain `torch.mm` path,
which is what Megatron means to run without TE.
"""

from __future__ import annotations

__all__ = ["define_te_general_gemm"]


def define_te_general_gemm() -> None:
    """Define `megatron.core.transformer.moe.moe_utils.te_general_gemm = None` where it is missing (no TE);
    with Transformer Engine the module's own definition stays."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
