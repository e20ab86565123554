"""Qwen2.5-VL from a Hugging Face directory: its language model as a Qwen2 import, its vision tower.

The model is two parts. The language model is a Qwen2 decoder (q/k/v biases) with multimodal RoPE (contiguous
frequency sections); thdpack runs it as Megatron's ``GPTModel`` (:mod:`thdpack.megatron.vlm`), its weights
converted by the HF import engine (:func:`thdpack.hf.vl_checkpoint.language_model_name`). The vision tower and
merger stay transformers' own module (``Qwen2_5_VisionTransformerPretrainedModel``), built from ``vision_config``
and loaded from the checkpoint's safetensors (:func:`load_vision_tower`): megatron-core 0.16.1 has no Qwen2.5-VL
vision encoder (window attention over merged 2x2 patch blocks, 2D rotary, RMSNorm, gated MLP), and the module is
the reference itself, so its output needs no parity check of its own. What the VL families share (config facts,
the MRoPE id rule, the checkpoint readers) is :mod:`thdpack.hf.vl_checkpoint`.

Tested with transformers 5.24.0 (CPU); the GPU host runs 5.17.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from . import vl_checkpoint

__all__ = [
    "ARCHITECTURES",
    "FAMILY",
    "build_vision_tower",
    "deepstack_layers",
    "load_language_model",
    "load_vision_tower",
    "model_group",
    "qwen2_config",
]

ARCHITECTURES = ("Qwen2_5_VLForConditionalGeneration",)
# The model family that builds the model and loads its weights (thdpack.megatron.families resolves the name).
FAMILY = "thdpack.hf.vlm_family:QWEN2_5_VL"
MROPE_INTERLEAVED = False  # contiguous frequency sections (temporal, height, width)


def deepstack_layers(config: Mapping) -> int:
    """Qwen2.5-VL has no DeepStack: 0 decoder layers get vision features."""
    return 0


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
    config = vl_checkpoint.read_vl_config(directory)
    return vl_checkpoint.load_vision_state(build_vision_tower(config, dtype), directory, device)


def qwen2_config(config: Mapping) -> dict:
    """The language model of a Qwen2.5-VL ``config.json`` as a ``Qwen2ForCausalLM`` ``config.json`` (what the
    Qwen2 import reads): the text keys, plain RoPE with the checkpoint's theta (the MRoPE sections are the VL
    family's), ``tie_word_embeddings`` from the top level."""
    return vl_checkpoint.text_import_config(config, "Qwen2ForCausalLM", "qwen2")


def model_group(config: Mapping, *, seq_length: int, tp: int = 1) -> dict:
    """The recipe's model group of a Qwen2.5-VL checkpoint: the Qwen2 import's group of its language model
    (:func:`thdpack.hf.config.model_group`), with multimodal RoPE (``mrope_section``) and the Qwen2.5-VL family
    (:data:`FAMILY`, :mod:`thdpack.hf.vlm_family`); ``freeze_vision`` true (``model.freeze_vision=false`` trains
    the vision tower too)."""
    group = vl_checkpoint.vl_model_group(
        config, seq_length=seq_length, tp=tp, import_config=qwen2_config, label="Qwen2.5-VL"
    )
    group.update(name="hf_qwen2_5_vl", family=FAMILY)
    return group


def load_language_model(gpt, directory: str | Path) -> int:
    """Load a Qwen2.5-VL checkpoint's language model into ``gpt`` (this rank's bare ``GPTModel`` chunk) with
    the Qwen2 import (per-rank slices; vocabulary padding never predicted). Returns the tensors loaded."""
    return vl_checkpoint.load_language_model(gpt, directory, qwen2_config)
