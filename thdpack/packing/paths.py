"""Which of the packer's two paths a tensor takes: numpy on the host, torch kernels where the tensor lives."""

from __future__ import annotations

import torch

__all__ = ["numpy_path"]


def numpy_path(t: torch.Tensor) -> bool:
    """True for a host tensor: numpy reads it (at a batch's sizes its per-call overhead is several times lower
    than torch's CPU kernels'). A tensor on a device is worked on there by the torch twins, which also run on
    host tensors: the tests route host tensors through them by replacing this function."""
    return t.is_cpu
