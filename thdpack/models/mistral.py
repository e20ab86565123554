"""Mistral (``MistralForCausalLM``): Llama's decoder and tensors under its own name; its ``sliding_window`` is
accepted where it never bites (rows no longer than the window, :func:`thdpack.models.llama.window_within_rows`)."""

from __future__ import annotations

from thdpack.hf.config_keys import ConfigReader

from . import llama
from .decoder import decoder_family

__all__ = ["FAMILY", "model_group"]


def model_group(r: ConfigReader, *, seq_length: int, tp: int) -> dict:
    """Mistral's model group (:class:`~thdpack.models.family.ModelGroup`): Llama's, model_type ``mistral``."""
    group = llama.decoder_group(r, "mistral", llama.decoder_config(r, "mistral"), tp)
    llama.window_within_rows(r, seq_length)
    return group


FAMILY = decoder_family("mistral", ("MistralForCausalLM",), model_group, llama.MAPPING)
