"""The label convention of the packer, the collator and the step: which labels are no target."""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["IGNORE_INDEX", "no_target"]

IGNORE_INDEX = -100  # "no target" in labels (HF's and Megatron-Bridge's convention; thdpack's default)


def no_target(labels: torch.Tensor | np.ndarray, ignore_index: int = IGNORE_INDEX):
    """Where ``labels`` (a tensor or a numpy array) hold no target: every negative label (``ignore_index``, or -1
    from another convention) and ``ignore_index`` itself where it is not negative. Same type and shape, bool."""
    out = labels < 0
    if ignore_index >= 0:
        out |= labels == ignore_index
    return out
