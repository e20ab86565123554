"""``model.te_op_fuser``: the MLP as Transformer Engine's fused operations (megatron-core's ``TEFusedMLP``).

``TEFusedMLP`` runs RMSNorm, FC1, the activation and FC2 as one ``transformer_engine.pytorch.ops.Sequential``, which
fuses the activation with the FP8 cast of FC2's input; its parameters and state-dict keys are the plain MLP's.
It holds those TE operations in a tuple, outside the module tree, so state they keep of their own is not in
checkpoints: under FP8 delayed scaling, their amax history restarts when a run resumes.

Recipe key: ``model.te_op_fuser`` (auto | true | false); ``auto`` is true with the ``te`` backend, a dense MLP, an
activation TE's operations have (megatron-core maps gelu, silu and relu; not Gemma 3's tanh GELU) and no FP8
scaling history.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["check_te_op_fuser", "resolve_te_op_fuser"]


def _experts(model: Mapping):
    return (model.get("config") or {}).get("num_moe_experts")


# The activations megatron-core's TEFusedMLP maps to TE operations (_make_activation_op).
FUSED_ACTIVATIONS = ("gelu", "silu", "relu")


def _activation(model: Mapping) -> str:
    return (model.get("config") or {}).get("activation_func", "gelu")


def _keeps_scaling_history(trainer: Mapping) -> bool:
    return trainer.get("precision") == "fp8" and trainer.get("fp8_recipe", "delayed") == "delayed"


def resolve_te_op_fuser(model: Mapping, trainer: Mapping, backend: str) -> bool | str:
    """``model.te_op_fuser`` with ``auto`` made concrete for the resolved ``backend`` and ``trainer`` (its
    precision resolved); any other value as given (:func:`check_te_op_fuser` judges it)."""
    value = model.get("te_op_fuser", False)
    if value != "auto":
        return value
    fusible = _activation(model) in FUSED_ACTIVATIONS
    return backend == "te" and not _experts(model) and fusible and not _keeps_scaling_history(trainer)


def check_te_op_fuser(model: Mapping, trainer: Mapping, backend: str) -> list[str]:
    """Start-up check of a resolved ``model.te_op_fuser``: raises ``ValueError`` naming the key for a value that
    cannot run; returns warnings for one that runs but does not resume exactly."""
    value = model.get("te_op_fuser", False)
    if value not in (True, False):
        raise ValueError(
            f"model.te_op_fuser is {value!r}: it must be true, false or auto (true with attention_backend=te, a "
            "dense MLP and no FP8 delayed scaling)"
        )
    if not value:
        return []
    if backend != "te":
        raise ValueError(
            "model.te_op_fuser=true runs the MLP as Transformer Engine's fused operations: it needs "
            f"model.attention_backend=te (here {backend})"
        )
    if _experts(model):
        raise ValueError(
            f"model.te_op_fuser=true fuses a dense MLP: this model has experts (model.config.num_moe_experts="
            f"{_experts(model)}); set model.te_op_fuser=false"
        )
    if _activation(model) not in FUSED_ACTIVATIONS:
        raise ValueError(
            f"model.te_op_fuser=true fuses the MLP's activation as a Transformer Engine operation: megatron-core has "
            f"{list(FUSED_ACTIVATIONS)}, not model.config.activation_func={_activation(model)!r}; set "
            "model.te_op_fuser=false"
        )
    if _keeps_scaling_history(trainer):
        return [
            "model.te_op_fuser=true with FP8 delayed scaling: the fused MLP's scaling history is not in checkpoints "
            "(megatron-core's TEFusedMLP keeps its TE operations outside the module tree), so a resumed run restarts "
            "it; model.te_op_fuser=false resumes it exactly"
        ]
    return []
