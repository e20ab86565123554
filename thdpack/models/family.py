"""The one declared form of a model family: what thdpack needs to build a model, call it on a packed micro-batch,
and (for a Hugging Face architecture) read its checkpoint and write it back.

A family is data, :class:`ModelFamily`; its module in :mod:`thdpack.models` declares it as ``FAMILY`` and the
registry (:mod:`thdpack.models.registry`) finds it there: by ``config.json``'s ``architectures`` for
``model.pretrained=DIR``, by name for the recipe's ``model.family``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from thdpack.hf.checkpoint import HFCheckpoint
    from thdpack.hf.config_keys import ConfigReader
    from thdpack.hf.mapping import Rule
    from thdpack.megatron.batch import BatchTransform, ModelInputs
    from thdpack.megatron.runtime import Runtime

__all__ = ["COMMON_MODEL_KEYS", "ModelFamily", "ModelGroup"]

# Keys of a recipe's model group that every family shares (the rest are the family's own, ModelFamily.model_keys).
COMMON_MODEL_KEYS = ("name", "family", "attention_backend", "vocab_size", "attention_mask_type", "config")


class ModelGroup(Protocol):
    """A family's ``model_group``: ``config.json`` (through ``reader``) as the recipe's model group for rows of up to
    ``seq_length`` tokens under tensor parallelism ``tp``."""

    def __call__(self, reader: ConfigReader, *, seq_length: int, tp: int) -> dict[str, Any]: ...


@dataclass(frozen=True)
class ModelFamily:
    """One family of models.

    Every family has:
        name: the recipe's ``model.family`` (a checkpoint's family is set there by the registry).
        build: ``(model, config, vocab_size, max_sequence_length, runtime) -> module``: this rank's pipeline stage
            from the recipe's model group ``model`` and Megatron's ``TransformerConfig``, on the host, not yet
            wrapped. A checkpoint's family loads the weights here: before the loop wraps the model and the
            distributed optimizer takes its fp32 copies (weights loaded later would never reach those).
        forward: ``(model, inputs) -> output``: one micro-batch (:class:`~thdpack.megatron.batch.ModelInputs`)
            through the wrapped model; the output is what the loss takes (per-token losses ``[b, s]``).
        model_keys: the model-group keys ``build`` reads besides :data:`COMMON_MODEL_KEYS`.
        transform: forward extras: the batch hook on the reader's host batch before packing (MRoPE ids from image
            grids, images checked), or None.
        carry_keys: forward extras: batch entries that are not token-aligned, carried beside the packed row to
            ``inputs.extra`` (a VL family's images and grids).
        check: ``(recipe) -> None``: start-up rules on the resolved recipe (raise ``ValueError`` naming the key
            and the rule), or None.

    A Hugging Face architecture's family also has:
        architectures: the ``config.json`` ``architectures`` it imports (the registry's key).
        model_group: :class:`ModelGroup`, ``(reader, seq_length=, tp=) -> group``: ``config.json`` (read
            through ``reader``, a :class:`~thdpack.hf.config_keys.ConfigReader`) as the recipe's model group: Megatron
            ``TransformerConfig`` settings under ``config``, RoPE, vocabulary, tied embeddings, the family's own
            keys. Raises :class:`~thdpack.hf.checkpoint.HFConfigError` for a value thdpack cannot compute exactly;
            a key it does not read is refused afterwards by the reader unless harmless.
        mapping: the HF <-> Megatron tensors of its (language) model as data, one
            :class:`~thdpack.hf.mapping.Rule` per Megatron tensor with its kind of merge (QKV, gated MLP,
            replicated, row, vocabulary; per expert), for :mod:`thdpack.hf.load` and the export.
        export: ``(iteration_dir, kept) -> tensors``: a run's distributed checkpoint as the HF tensors to write
            (names, dtypes and bits as saved); ``kept``: the run's ``hf/`` directory
            (:func:`thdpack.hf.directory.keep_with_checkpoint`) as an :class:`~thdpack.hf.checkpoint.HFCheckpoint`.
    """

    name: str
    build: Callable[[Mapping, Any, int, int, Runtime], Any]
    forward: Callable[[Any, ModelInputs], torch.Tensor]
    model_keys: tuple[str, ...] = ()
    transform: BatchTransform | None = None
    carry_keys: tuple[str, ...] = ()
    check: Callable[[Mapping], None] | None = None
    architectures: tuple[str, ...] = ()
    model_group: ModelGroup | None = None
    mapping: tuple[Rule, ...] = ()
    export: Callable[[Path, HFCheckpoint], dict[str, torch.Tensor]] | None = None

    def __post_init__(self):
        hf = (self.model_group, self.export)
        if self.architectures and None in hf or not self.architectures and hf != (None, None):
            raise ValueError(
                f"family '{self.name}': a Hugging Face architecture's family has architectures, model_group and "
                "export; a family without architectures has neither"
            )
