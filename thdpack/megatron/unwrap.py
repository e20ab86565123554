"""``unwrap_model``: the model inside the wrappers Megatron and torch put around it."""

from __future__ import annotations

__all__ = ["unwrap_model"]


def unwrap_model(model):
    """The model inside DDP / Float16Module-style wrappers (which keep it in ``.module``)."""
    while hasattr(model, "module"):
        model = model.module
    return model
