"""The ``qwen2_5_vl`` model family (``model=hf model.pretrained=<a Qwen2.5-VL directory>``): how the training loop
builds :class:`~thdpack.megatron.vlm.VisionLanguageModel` (weights included: the language model through the
Qwen2 import, the vision tower from the checkpoint's safetensors) and calls it on a micro-batch whose images ride
beside the packed row (``pixel_values``, ``image_grid_thw``: carried, not packed; ``vision_index``: packed and
CP-sharded with the tokens)."""

from __future__ import annotations

from .families import ModelFamily
from .vlm import VISION_KEYS, build_vlm, vlm_batch_transform, vlm_forward

__all__ = ["QWEN2_5_VL"]

QWEN2_5_VL = ModelFamily(
    name="qwen2_5_vl",
    build=build_vlm,
    forward=vlm_forward,
    model_keys=(
        "pretrained",
        "freeze_vision",
        "position_embedding_type",
        "rotary_base",
        "rope_scaling",
        "share_embeddings_and_output_weights",
    ),
    transform=vlm_batch_transform,
    carry_keys=VISION_KEYS,
)
