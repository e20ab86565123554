"""The vision-language model families (``model=hf model.pretrained=<a Qwen2.5-VL, Qwen3-VL or Qwen3-VL-MoE
directory>``): how the training loop builds :class:`~thdpack.megatron.vlm.VisionLanguageModel` with the checkpoint's
weights (the language model through the text import of its family module, the vision tower from the checkpoint's
safetensors) and calls it on a micro-batch whose images ride beside the packed row (``pixel_values``, ``image_grid_thw``:
carried, not packed; ``vision_index``: packed and CP-sharded with the tokens).

The model group of such a directory names its family (:data:`thdpack.hf.qwen2_5_vl.FAMILY`,
:data:`thdpack.hf.qwen3_vl.FAMILY`, :data:`thdpack.hf.qwen3_vl_moe.FAMILY`, through the registry's
``"package.module:ATTRIBUTE"`` form, as :mod:`thdpack.hf.family` for text checkpoints): the weights are loaded
here, so the ``hf`` family's loader never runs for it. Like :mod:`thdpack.hf.family`, a module of :mod:`thdpack.hf` that imports :mod:`thdpack.megatron` at
module level, imported only when a recipe names it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

from thdpack.megatron.families import ModelFamily
from thdpack.megatron.vlm import (
    VISION_KEYS,
    VisionLanguageModel,
    build_language_model,
    vlm_batch_transform,
    vlm_forward,
)

from .vl_checkpoint import read_vl_config, vl_module

__all__ = ["QWEN2_5_VL", "QWEN3_VL", "QWEN3_VL_MOE", "build_vlm", "check_vlm_recipe"]

log = logging.getLogger("thdpack")


def build_vlm(
    model: Mapping, config, vocab_size: int, max_sequence_length: int, runtime
) -> VisionLanguageModel:
    """This rank's :class:`VisionLanguageModel` from the recipe's model group (``pretrained``: the Hugging Face
    directory; ``freeze_vision``, default true), with the checkpoint's weights: the language model through its
    family module's text import, the vision tower (first pipeline stage only) from its safetensors. The family
    module fixes what the checkpoint decides: Qwen3-VL's interleaved MRoPE and DeepStack layers, Qwen3-VL-MoE's fused
    experts (read per expert-parallel rank). On the host,
    bare: loaded here, before the loop wraps the model and the optimizer copies its parameters (as
    :mod:`thdpack.hf.family`)."""
    directory = model.get("pretrained")
    if not directory:
        raise ValueError(
            "the vision-language families need model.pretrained (a Qwen2.5-VL, Qwen3-VL or Qwen3-VL-MoE Hugging Face "
            "directory)"
        )
    hf = read_vl_config(directory)
    family = vl_module(hf, f"{directory}/config.json")
    language_model = build_language_model(
        model,
        config,
        vocab_size,
        max_sequence_length,
        runtime,
        mrope_interleaved=family.MROPE_INTERLEAVED,
    )
    loaded = family.load_language_model(language_model, directory)
    log.info("loaded %d language-model tensors of %s into this rank's model", loaded, directory)
    visual = family.load_vision_tower(directory, dtype=torch.float32) if language_model.pre_process else None
    return VisionLanguageModel(
        config,
        language_model,
        visual,
        freeze_vision=bool(model.get("freeze_vision", True)),
        deepstack_layers=family.deepstack_layers(hf),
    )


def check_vlm_recipe(cfg: Mapping) -> None:
    """The VL families' start-up rule (``ModelFamily.check``): under pipeline parallelism the first stage, which
    runs the vision tower, holds every DeepStack layer (Qwen3-VL; :func:`thdpack.megatron.deepstack.
    check_deepstack_split`). Raises ``ValueError`` naming the key."""
    from thdpack.megatron.deepstack import check_deepstack_split
    from thdpack.megatron.parallel_layout import first_stage_layers

    model, pp = cfg["model"], int(cfg["parallel"]["pipeline_model_parallel_size"])
    if pp <= 1 or not model.get("pretrained"):
        return
    hf = read_vl_config(model["pretrained"])
    layers = vl_module(hf).deepstack_layers(hf)
    check_deepstack_split(first_stage_layers(model.get("config") or {}, pp), layers, pp)


_MODEL_KEYS = (
    "pretrained",
    "freeze_vision",
    "position_embedding_type",
    "rotary_base",
    "rope_scaling",
    "share_embeddings_and_output_weights",
    "te_op_fuser",
)


def _vl_family(name: str) -> ModelFamily:
    """The VL families differ only in the checkpoint module their ``config.json`` selects
    (:mod:`thdpack.hf.vl_checkpoint`): one build, forward, batch hook and recipe check."""
    return ModelFamily(
        name=name,
        build=build_vlm,
        forward=vlm_forward,
        model_keys=_MODEL_KEYS,
        transform=vlm_batch_transform,
        carry_keys=VISION_KEYS,
        check=check_vlm_recipe,
    )


QWEN2_5_VL = _vl_family("qwen2_5_vl")
QWEN3_VL = _vl_family("qwen3_vl")
QWEN3_VL_MOE = _vl_family("qwen3_vl_moe")
