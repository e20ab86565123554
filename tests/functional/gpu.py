"""The GPU tests' marks: ``pytest -m gpu`` selects them, and each skips cleanly (CI has no GPU) where the hardware
or library it needs is missing."""

from __future__ import annotations

import importlib.util

import pytest
import torch

ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

WITH_TE = [
    *ON_GPU,
    pytest.mark.skipif(
        importlib.util.find_spec("transformer_engine") is None, reason="needs Transformer Engine"
    ),
]

FP8_CORES = pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9), reason="needs FP8 tensor cores"
)
