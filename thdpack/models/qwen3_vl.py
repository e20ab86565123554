"""Qwen3-VL (dense, ``Qwen3VLForConditionalGeneration``): its language model imported as Qwen3, its vision tower
with DeepStack.

Against Qwen2.5-VL (:mod:`thdpack.models.qwen2_5_vl`), per transformers' ``modeling_qwen3_vl.py``:

* the language model is a Qwen3 decoder (q/k RMSNorm, no q/k/v bias, ``head_dim`` free of hidden / heads),
  imported as ``Qwen3ForCausalLM`` (:func:`qwen3_config`);
* MRoPE interleaves its frequency sections (``Qwen3VLTextRotaryEmbedding.recomposition_frequencies``: frequency
  ``j`` follows height when ``j % 3 == 1``, width when ``j % 3 == 2``, within ``3 * section``): transformers
  applies it whatever ``rope_parameters.mrope_interleaved`` says, and so does thdpack
  (:func:`thdpack.megatron.mrope.mrope_frequencies`, ``mrope_interleaved=True``);
* the vision tower (``Qwen3VLVisionModel``: patch embedding, learned position embeddings interpolated to each
  image's grid, full attention per image, 2D rotary) stays transformers' module, loaded from the checkpoint; it
  also returns DeepStack feature maps, one per ``vision_config.deepstack_visual_indexes`` entry, added after the
  first decoder layers (:mod:`thdpack.megatron.deepstack`);
* video positions use timestamps; thdpack supports still images only (the image rule is the same as Qwen2.5-VL's:
  :func:`thdpack.hf.vl_checkpoint.rope_index`), and a sample with video tokens is refused.

Qwen3-VL-MoE (``Qwen3VLMoeForConditionalGeneration``) reuses all of this around a Qwen3-MoE language model
(:mod:`thdpack.models.qwen3_vl_moe`). Tested with transformers 5.24.0 (CPU).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from thdpack.hf.checkpoint import HFCheckpoint, HFConfigError
from thdpack.hf.vl_checkpoint import load_vision_state, text_config, text_import_config

from . import qwen3
from .vl import vl_family

__all__ = ["FAMILY", "build_vision_tower", "deepstack_layers", "load_vision_tower", "qwen3_config"]

# transformers' Qwen3VLVisionConfig default, for a config.json that leaves the key out.
DEFAULT_DEEPSTACK_INDEXES = (8, 16, 24)


def deepstack_layers(checkpoint: HFCheckpoint) -> int:
    """How many decoder layers get DeepStack features: ``len(vision_config.deepstack_visual_indexes)``."""
    config = checkpoint.config
    vision = config.get("vision_config") or {}
    indexes = vision.get("deepstack_visual_indexes", DEFAULT_DEEPSTACK_INDEXES)
    layers = int(text_config(config)["num_hidden_layers"])
    depth = int(vision.get("depth", 27))
    if len(indexes) > layers or any(not 0 <= int(i) < depth for i in indexes):
        raise HFConfigError(
            f"{checkpoint.path}: vision_config.deepstack_visual_indexes {list(indexes)}: "
            f"each must be a vision block (0..{depth - 1}), and there can be at most num_hidden_layers "
            f"({layers}) of them (one per decoder layer from the first)"
        )
    return len(indexes)


def build_vision_tower(config: Mapping, dtype=None):
    """transformers' ``Qwen3VLVisionModel`` for ``config["vision_config"]``, weights uninitialised (random).
    Attention is SDPA: per image, as transformers runs it."""
    import torch
    from transformers import Qwen3VLConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    vision_config = Qwen3VLConfig(vision_config=dict(config["vision_config"])).vision_config
    vision_config._attn_implementation = "sdpa"
    return Qwen3VLVisionModel._from_config(vision_config, dtype=dtype or torch.float32)


def load_vision_tower(directory: str | Path, dtype=None, device=None):
    """The checkpoint's vision tower, merger and DeepStack mergers: :func:`build_vision_tower` with every tensor
    read from the directory's safetensors (:func:`thdpack.hf.vl_checkpoint.load_vision_state`)."""
    config = HFCheckpoint.open(directory).config
    return load_vision_state(build_vision_tower(config, dtype), directory, device)


def qwen3_config(checkpoint: HFCheckpoint) -> dict:
    """The language model of a Qwen3-VL ``config.json`` as a ``Qwen3ForCausalLM`` ``config.json`` (what Qwen3's
    model group reads): the text keys, plain RoPE with the checkpoint's theta (the MRoPE sections and their
    interleaving are the VL family's), ``tie_word_embeddings`` from the top level."""
    return text_import_config(checkpoint.config, "Qwen3ForCausalLM", "qwen3")


FAMILY = vl_family(
    name="qwen3_vl",
    architectures=("Qwen3VLForConditionalGeneration",),
    text=qwen3.FAMILY,
    text_import=qwen3_config,
    build_vision_tower=build_vision_tower,
    mrope_interleaved=True,
    deepstack_layers=deepstack_layers,
)
