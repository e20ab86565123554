"""Qwen3-VL (dense) from a Hugging Face directory: its language model as a Qwen3 import, its vision tower with
DeepStack.

Against Qwen2.5-VL (:mod:`thdpack.hf.qwen2_5_vl`), per transformers' ``modeling_qwen3_vl.py``:

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
(:mod:`thdpack.hf.qwen3_vl_moe`). Tested with transformers 5.24.0 (CPU).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from . import vl_checkpoint
from .config import HFConfigError

__all__ = [
    "ARCHITECTURES",
    "FAMILY",
    "build_vision_tower",
    "deepstack_layers",
    "load_language_model",
    "load_vision_tower",
    "model_group",
    "qwen3_config",
]

ARCHITECTURES = ("Qwen3VLForConditionalGeneration",)
# The model family that builds the model and loads its weights (thdpack.megatron.families resolves the name).
FAMILY = "thdpack.hf.vlm_family:QWEN3_VL"
MROPE_INTERLEAVED = True
# transformers' Qwen3VLVisionConfig default, for a config.json that leaves the key out.
DEFAULT_DEEPSTACK_INDEXES = (8, 16, 24)


def deepstack_layers(config: Mapping) -> int:
    """How many decoder layers get DeepStack features: ``len(vision_config.deepstack_visual_indexes)``."""
    vision = config.get("vision_config") or {}
    indexes = vision.get("deepstack_visual_indexes", DEFAULT_DEEPSTACK_INDEXES)
    layers = int(vl_checkpoint.text_config(config)["num_hidden_layers"])
    depth = int(vision.get("depth", 27))
    if len(indexes) > layers or any(not 0 <= int(i) < depth for i in indexes):
        raise HFConfigError(
            f"{config.get('_path', 'config.json')}: vision_config.deepstack_visual_indexes {list(indexes)}: "
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
    config = vl_checkpoint.read_vl_config(directory)
    return vl_checkpoint.load_vision_state(build_vision_tower(config, dtype), directory, device)


def qwen3_config(config: Mapping) -> dict:
    """The language model of a Qwen3-VL ``config.json`` as a ``Qwen3ForCausalLM`` ``config.json`` (what the
    Qwen3 import reads): the text keys, plain RoPE with the checkpoint's theta (the MRoPE sections and their
    interleaving are the VL family's), ``tie_word_embeddings`` from the top level."""
    return vl_checkpoint.text_import_config(config, "Qwen3ForCausalLM", "qwen3")


def model_group(config: Mapping, *, seq_length: int, tp: int = 1) -> dict:
    """The recipe's model group of a Qwen3-VL checkpoint: the Qwen3 import's group of its language model, with
    multimodal RoPE (``mrope_section``) and the Qwen3-VL family (:data:`FAMILY`, :mod:`thdpack.hf.vlm_family`:
    interleaved MRoPE and DeepStack, both fixed by the checkpoint); ``freeze_vision`` true."""
    deepstack_layers(config)  # refuse a DeepStack layout the decoder cannot hold before anything is built
    group = vl_checkpoint.vl_model_group(
        config, seq_length=seq_length, tp=tp, import_config=qwen3_config, label="Qwen3-VL"
    )
    group.update(name="hf_qwen3_vl", family=FAMILY)
    return group


def load_language_model(gpt, directory: str | Path) -> int:
    """Load a Qwen3-VL checkpoint's language model into ``gpt`` (this rank's bare ``GPTModel`` chunk) with the
    Qwen3 import (per-rank slices; vocabulary padding never predicted). Returns the tensors loaded."""
    return vl_checkpoint.load_language_model(gpt, directory, qwen3_config)
