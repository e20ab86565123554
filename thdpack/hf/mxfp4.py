"""MXFP4 (OCP microscaling FP4) tensors as gpt-oss checkpoints store their experts: ``<name>_blocks`` and
``<name>_scales`` (transformers' ``integrations/mxfp4.py``, ``convert_moe_packed_tensors``).

A quantised tensor ``[..., R, C]`` is cut along its last dimension into blocks of 32 values: ``blocks`` (uint8
``[..., R, C / 32, 16]``) holds each block's 32 FP4 (E2M1) codes two to a byte, the low nibble first, and
``scales`` (uint8 ``[..., R, C / 32]``) each block's power of two, biased by 127 (E8M0). A value is
``FP4[code] * 2 ** (scale - 127)``: exact in fp32 (and in bf16), so dequantising loses nothing.
"""

from __future__ import annotations

import torch

__all__ = ["FP4_VALUES", "dequantize_mxfp4"]

# The 16 E2M1 codes: sign bit 3, then 2 exponent bits and 1 mantissa bit.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``blocks`` ``[..., G, 16]`` and ``scales`` ``[..., G]`` as the values ``[..., G * 32]`` in ``dtype``
    (transformers' ``convert_moe_packed_tensors`` before its final transpose)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(
            f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)}: blocks [..., G, 16] with scales "
            "[..., G] expected"
        )
    lut = torch.tensor(FP4_VALUES, dtype=dtype)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).to(torch.int64)  # low nibble first
    values = lut[codes].flatten(-2)  # [..., G, 32]
    exponents = scales.to(torch.int32)[..., None] - 127
    return torch.ldexp(values, exponents).to(dtype).flatten(-2)
