"""The ``hf`` model family: megatron-core's ``GPTModel`` as the ``gpt`` family builds it, with a Hugging Face
checkpoint's weights loaded into it before the training loop wraps it and the optimizer copies it.

A recipe with ``model.pretrained`` names this family (``thdpack.hf.config.HF_FAMILY``, through the registry's
``"package.module:ATTRIBUTE"`` form); its model group comes from the checkpoint's config.json
(:func:`thdpack.hf.config.pretrained_model_group`). With :mod:`thdpack.hf.vlm_family` (Qwen2.5-VL directories),
the modules of :mod:`thdpack.hf` that import :mod:`thdpack.megatron` at module level: they are imported only when
a recipe names them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from thdpack.megatron.families import GPT, ModelFamily, gpt_forward

from .load import load_pretrained

__all__ = ["HF"]

log = logging.getLogger("thdpack")


def _build(model: Mapping, config, vocab_size: int, max_sequence_length: int, runtime):
    if not model.get("freeze_vision", True):
        raise ValueError(
            f"model.freeze_vision=false trains a vision tower, but {model['pretrained']} is a text checkpoint "
            "(no vision tower): leave model.freeze_vision at true"
        )
    module = GPT.build(model, config, vocab_size, max_sequence_length, runtime)
    # Here, before the loop wraps the model (Float16Module, DDP) and the distributed optimizer takes its fp32
    # main parameters from it: weights loaded later would never reach those (tests/unit/test_hf_import.py).
    loaded = load_pretrained(module, model["pretrained"])
    log.info("loaded %d tensors of %s into this rank's model", loaded, model["pretrained"])
    return module


HF = ModelFamily(
    name="hf",
    build=_build,
    forward=gpt_forward,
    model_keys=(*GPT.model_keys, "pretrained", "rope_scaling", "freeze_vision"),
)
