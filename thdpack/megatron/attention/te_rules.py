"""Start-up rules of Transformer Engine's attention for sliding windows and attention sinks under context
parallelism, as TE (2.20.0.dev0, ``attention/dot_product_attention/context_parallel.py``,
``attn_forward_func_with_cp``) asserts them mid-step: a sliding window needs ``cp_comm_type`` ``a2a`` or
``all_gather``; a learnable softmax (sinks) needs ``a2a`` and TE's fused (cuDNN) attention. Megatron's default
``cp_comm_type`` is ``p2p``. thdpack's torch attention gathers K and V whole and computes both exactly under any
context parallelism, so these rules bind the ``te`` backend only."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["check_te_context_parallel"]


def check_te_context_parallel(recipe: Mapping, what: str) -> None:
    """Raise ``ValueError`` naming ``model.config.cp_comm_type`` when the resolved ``recipe`` runs ``what`` (a
    family's windows or sinks, in words) on the ``te`` backend under context parallelism with a
    ``cp_comm_type`` TE refuses for them."""
    model, parallel = recipe["model"], recipe["parallel"]
    if model["attention_backend"] != "te" or int(parallel["context_parallel_size"]) == 1:
        return
    config = model.get("config") or {}
    comm = config.get("cp_comm_type") or "p2p"
    windows = config.get("window_size") is not None
    sinks = config.get("softmax_type", "vanilla") != "vanilla"
    allowed = ("a2a",) if sinks else ("a2a", "all_gather") if windows else None
    if allowed and comm not in allowed:
        needs = "attention sinks (learnable softmax)" if sinks else "sliding windows"
        raise ValueError(
            f"model.config.cp_comm_type is {comm!r}: {what} on attention_backend=te with "
            f"parallel.context_parallel_size={parallel['context_parallel_size']} need cp_comm_type in {list(allowed)} "
            f"(Transformer Engine computes {needs} under context parallelism with those only); set "
            f"+model.config.cp_comm_type={allowed[0]}, or model.attention_backend=torch, or context_parallel_size=1"
        )
