"""A Hugging Face decoder-only checkpoint run as megatron-core's ``GPTModel``: the ``gpt`` family's model with the
checkpoint's weights loaded into it, and a run's checkpoint mapped back to the checkpoint's tensors.

A family module declares what is its own (name, architectures, ``model_group``, mapping) and
:func:`decoder_family` makes the rest of its :class:`~thdpack.models.family.ModelFamily`:

    FAMILY = decoder_family("mistral", ("MistralForCausalLM",), model_group, llama.MAPPING)

A family whose layers or checkpoint differ from Llama's says how (:class:`Extras`: Gemma 3's layers and RoPE,
gpt-oss's checkpoint tensors).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from thdpack.hf.checkpoint import HFCheckpoint
from thdpack.hf.mapping import Rule
from thdpack.megatron.step import gpt_forward

from . import gpt
from .family import ModelFamily, ModelGroup

__all__ = ["MODEL_KEYS", "Extras", "decoder_family", "load_pretrained"]

log = logging.getLogger("thdpack")

# The model-group keys of a checkpoint's family besides the gpt family's.
MODEL_KEYS = (*gpt.MODEL_KEYS, "pretrained", "rope_scaling", "freeze_vision", "accept_unknown_config_keys")


@dataclass(frozen=True)
class Extras:
    """What a decoder family does beyond Llama's (every field optional):

    layers: ``(spec, backend) -> spec``: its transformer layer, from the backend's Megatron layer spec.
    setup: ``(chunk, model) -> None``: on each built chunk, what the weights do not carry (``model``: the recipe's
        model group); by default RoPE's frequencies from ``rotary_base`` and ``rope_scaling``.
    tensors: ``reader -> reader``: the checkpoint's tensors as the mapping names them (:func:`load_pretrained`).
    written: ``(tensors, kept) -> tensors``: the export's HF tensors (by the mapping) as the checkpoint stores them.
    check: the family's start-up rules (``ModelFamily.check``).
    model_keys: model-group keys of its own.
    """

    layers: Callable[[Any, str], Any] | None = None
    setup: Callable[[Any, Mapping], None] | None = None
    tensors: Callable[[Any], Any] | None = None
    written: Callable[[dict, HFCheckpoint], dict] | None = None
    check: Callable[[Mapping], None] | None = None
    model_keys: tuple[str, ...] = ()


def _rotary_frequencies(chunk, model: Mapping) -> None:
    from thdpack.hf.load import set_rotary_frequencies

    set_rotary_frequencies(chunk, model["rotary_base"], model.get("rope_scaling"))


def load_pretrained(module, mapping: Iterable[Rule], model: Mapping, tensors=None, setup=None) -> int:
    """Load ``model["pretrained"]``'s weights (``model``: the recipe's model group) into ``module`` (this rank's
    chunk, or a list of chunks; DDP / Float16Module wrappers are looked through) by ``mapping``, set its RoPE
    frequencies (the group's ``rotary_base`` and ``rope_scaling``) and mask its padded vocabulary rows. Returns
    the number of tensors loaded on this rank. ``tensors``: ``reader -> reader``, the checkpoint's tensors as the
    mapping names them (e.g. :class:`~thdpack.hf.vl_checkpoint.LanguageModelReader`); None: as stored.
    ``setup``: ``(chunk, model) -> None`` instead of the RoPE frequencies (a family's :class:`Extras`)."""
    from thdpack.hf.load import load_weights, never_predict_padding
    from thdpack.megatron.unwrap import unwrap_model

    checkpoint = HFCheckpoint.open(model["pretrained"])
    vocab = int(checkpoint.config["vocab_size"])
    loaded = 0
    for chunk in module if isinstance(module, (list, tuple)) else [module]:
        chunk = unwrap_model(chunk)
        reader = checkpoint.tensors()
        loaded += load_weights(chunk, reader if tensors is None else tensors(reader), mapping, vocab)
        (setup or _rotary_frequencies)(chunk, model)
        never_predict_padding(chunk, vocab)
    return loaded


def decoder_family(
    name: str,
    architectures: tuple[str, ...],
    model_group: ModelGroup,
    mapping: tuple[Rule, ...],
    extras: Extras = Extras(),  # noqa: B008 - frozen dataclass
) -> ModelFamily:
    """The family of a decoder-only ``GPTModel`` checkpoint: ``model_group`` reads its ``config.json``,
    ``mapping`` its tensors (both ways), ``extras`` what differs from Llama."""

    def build(model: Mapping, config, vocab_size: int, max_sequence_length: int, runtime):
        if not model.get("freeze_vision", True):
            raise ValueError(
                f"model.freeze_vision=false trains a vision tower, but {model['pretrained']} is a text checkpoint "
                "(no vision tower): leave model.freeze_vision at true"
            )
        edit = {}
        if extras.layers is not None:
            edit["edit_spec"] = lambda spec: extras.layers(spec, runtime.backend)
        module = gpt.build(model, config, vocab_size, max_sequence_length, runtime, **edit)
        loaded = load_pretrained(module, mapping, model, extras.tensors, extras.setup)
        log.info("loaded %d tensors of %s into this rank's model", loaded, model["pretrained"])
        return module

    def export(iteration_dir: Path, kept: HFCheckpoint):
        from thdpack.hf.checkpoint_hf import checkpoint_hf_tensors

        tensors = checkpoint_hf_tensors(
            iteration_dir, kept.directory, mapping, int(kept.config["vocab_size"])
        )
        return extras.written(tensors, kept) if extras.written else tensors

    return ModelFamily(
        name=name,
        build=build,
        forward=gpt_forward,
        model_keys=MODEL_KEYS + extras.model_keys,
        check=extras.check,
        architectures=architectures,
        model_group=model_group,
        mapping=mapping,
        export=export,
    )
