"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``): its language model imported as Qwen2, its vision tower.

The model is two parts. The language model is a Qwen2 decoder (q/k/v biases) with multimodal RoPE (contiguous
frequency sections); thdpack runs it as Megatron's ``GPTModel`` (:mod:`thdpack.megatron.vlm`), its weights
converted by Qwen2's mapping (:func:`thdpack.hf.vl_checkpoint.language_model_name`). The vision tower and merger
stay transformers' own module (``Qwen2_5_VisionTransformerPretrainedModel``), built from ``vision_config`` and
loaded from the checkpoint's safetensors (:func:`load_vision_tower`): megatron-core 0.16.1 has no Qwen2.5-VL
vision encoder (window attention over merged 2x2 patch blocks, 2D rotary, RMSNorm, gated MLP), and the module is
the reference itself, so its output needs no parity check of its own. What the Qwen VL families share is
:mod:`thdpack.models.vl` (the family) and :mod:`thdpack.hf.vl_checkpoint` (config facts, the MRoPE id rule, the
checkpoint readers).

Tested with transformers 5.24.0 (CPU); the GPU host runs 5.17.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from thdpack.hf.checkpoint import HFCheckpoint
from thdpack.hf.vl_checkpoint import load_vision_state, text_import_config

from . import qwen2
from .vl import vl_family

__all__ = ["FAMILY", "build_vision_tower", "load_vision_tower", "qwen2_config"]


def build_vision_tower(config: Mapping, dtype=None):
    """transformers' ``Qwen2_5_VisionTransformerPretrainedModel`` for ``config["vision_config"]``, weights
    uninitialised (random). Attention is SDPA: per image (per window), as transformers runs it."""
    import torch
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    vision_config = Qwen2_5_VLConfig(vision_config=dict(config["vision_config"])).vision_config
    vision_config._attn_implementation = "sdpa"
    return Qwen2_5_VisionTransformerPretrainedModel._from_config(vision_config, dtype=dtype or torch.float32)


def load_vision_tower(directory: str | Path, dtype=None, device=None):
    """The checkpoint's vision tower and merger: :func:`build_vision_tower` with every tensor read from the
    directory's safetensors (:func:`thdpack.hf.vl_checkpoint.load_vision_state`: a missing, unexpected or
    misshapen tensor is named)."""
    config = HFCheckpoint.open(directory).config
    return load_vision_state(build_vision_tower(config, dtype), directory, device)


def qwen2_config(checkpoint: HFCheckpoint) -> dict:
    """The language model of a Qwen2.5-VL ``config.json`` as a ``Qwen2ForCausalLM`` ``config.json`` (what Qwen2's
    model group reads): the text keys, plain RoPE with the checkpoint's theta (the MRoPE sections are the VL
    family's), ``tie_word_embeddings`` from the top level."""
    return text_import_config(checkpoint.config, "Qwen2ForCausalLM", "qwen2")


FAMILY = vl_family(
    name="qwen2_5_vl",
    architectures=("Qwen2_5_VLForConditionalGeneration",),
    text=qwen2.FAMILY,
    text_import=qwen2_config,
    build_vision_tower=build_vision_tower,
    mrope_interleaved=False,  # contiguous frequency sections (temporal, height, width)
)
