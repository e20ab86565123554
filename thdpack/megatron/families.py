"""Model families: how a recipe's ``model.family`` builds its Megatron model and calls it on a micro-batch.

A family is data (:class:`ModelFamily`): a ``build`` function (the recipe's model group, Megatron's
``TransformerConfig``, the padded vocabulary size, the longest sequence and the :class:`~thdpack.megatron.runtime.
Runtime` in; this rank's pipeline stage of the model out, bare: the training loop wraps it for data parallelism),
a ``forward`` (the model and :class:`~thdpack.megatron.batch.ModelInputs` in, the output the loss takes out), the
model-group keys it reads, and the batch hook a family may need (a VLM: MRoPE ids from image grids, images
carried beside the packed row). ``FAMILIES`` maps names to families; registering one
(:func:`register_family`, or a ``"package.module:ATTRIBUTE"`` entry, imported when first named) needs no edit of
the setup code. ``gpt`` (dense, MoE, MRoPE ``GPTModel``) is built in.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from .batch import BatchTransform, ModelInputs
    from .runtime import Runtime

__all__ = [
    "COMMON_MODEL_KEYS",
    "FAMILIES",
    "GPT",
    "ModelFamily",
    "get_family",
    "gpt_forward",
    "register_family",
]

# Keys of a recipe's model group that every family shares (the rest are the family's own, ModelFamily.model_keys).
COMMON_MODEL_KEYS = ("name", "family", "attention_backend", "vocab_size", "attention_mask_type", "config")


@dataclass(frozen=True)
class ModelFamily:
    """One family of models the training loop can build and call.

    Attributes:
        name: the recipe's ``model.family``.
        build: ``(model, config, vocab_size, max_sequence_length, runtime) -> module``: this rank's pipeline
            stage, on the host, not yet wrapped (``model`` is the recipe's model group).
        forward: ``(model, inputs) -> output``: one micro-batch through the (wrapped) model; the output is what
            the loss takes (per-token losses ``[b, s]`` for :class:`~thdpack.megatron.loss.TokenLoss`).
        model_keys: the model-group keys ``build`` reads besides :data:`COMMON_MODEL_KEYS`.
        transform: the family's batch hook (``BatchConfig.transform``), or None.
        carry_keys: batch entries that are not token-aligned and that ``forward`` takes from
            ``inputs.extra`` (``BatchConfig.carry_keys``).
        check: ``(recipe) -> None``: the family's own start-up rules on the resolved recipe (raises
            ``ValueError`` naming the key and the rule), or None.
    """

    name: str
    build: Callable[[Mapping, Any, int, int, Runtime], Any]
    forward: Callable[[Any, ModelInputs], torch.Tensor]
    model_keys: tuple[str, ...] = ()
    transform: BatchTransform | None = None
    carry_keys: tuple[str, ...] = ()
    check: Callable[[Mapping], None] | None = None


def gpt_forward(model, inputs: ModelInputs):
    """``GPTModel.forward`` on a micro-batch: packed (``packed_seq_params``, the MoE ``padding_mask``, ``[3, 1,
    T]`` MRoPE ids) or padded (a ``[B, 1, 1, S]`` attention mask); per-token losses on the last stage."""
    return model(
        inputs.tokens,
        inputs.position_ids,
        inputs.attention_mask,
        labels=inputs.labels,
        loss_mask=inputs.loss_mask,  # the fused output loss's per-token weights (thdpack.megatron.output_loss)
        packed_seq_params=inputs.packed_seq_params,
        padding_mask=inputs.padding_mask,
    )


def _build_gpt(model: Mapping, config, vocab_size: int, max_sequence_length: int, runtime: Runtime):
    from .models import build_gpt_model
    from .output_loss import resolve_output_loss, use_output_loss

    module = build_gpt_model(
        config,
        vocab_size,
        max_sequence_length,
        backend=runtime.backend,
        position_embedding_type=model.get("position_embedding_type", "rope"),
        rotary_base=int(model.get("rotary_base", 10000)),
        share_embeddings_and_output_weights=bool(model.get("share_embeddings_and_output_weights", False)),
        te_op_fuser=model.get("te_op_fuser") is True,  # "auto" is resolved with the recipe
    )
    use_output_loss(module, resolve_output_loss(model, runtime.device))
    return module


GPT = ModelFamily(
    name="gpt",
    build=_build_gpt,
    forward=gpt_forward,
    model_keys=(
        "position_embedding_type",
        "rotary_base",
        "share_embeddings_and_output_weights",
        "output_loss",
        "te_op_fuser",
    ),
)

FAMILIES: dict[str, ModelFamily | str] = {"gpt": GPT}


def register_family(family: ModelFamily) -> ModelFamily:
    """Add ``family`` to :data:`FAMILIES` under its name (replacing one of that name); returns it."""
    if not isinstance(family, ModelFamily):
        raise TypeError(f"register_family takes a ModelFamily, got a {type(family).__name__}")
    FAMILIES[family.name] = family
    return family


def get_family(name: str) -> ModelFamily:
    """The family a recipe's ``model.family`` names: a registered name, or ``"package.module:ATTRIBUTE"``."""
    entry = FAMILIES.get(name, name if ":" in str(name) else None)
    if entry is None:
        raise ValueError(
            f"model.family is '{name}': known families are {sorted(FAMILIES)} (register another with "
            "thdpack.megatron.families.register_family, or name it as 'package.module:ATTRIBUTE')"
        )
    if isinstance(entry, str):
        module, _, attribute = entry.partition(":")
        family = getattr(importlib.import_module(module), attribute, None)
        if not isinstance(family, ModelFamily):
            raise ValueError(
                f"model.family '{name}' names {entry}, which is a {type(family).__name__}, not a "
                "thdpack.megatron.families.ModelFamily"
            )
        FAMILIES[name] = family
        return family
    return entry
