"""Qwen3-VL-MoE (``Qwen3VLMoeForConditionalGeneration``, e.g. Qwen3-VL-30B-A3B): Qwen3-VL's vision tower, DeepStack
and interleaved MRoPE (:mod:`thdpack.models.qwen3_vl`) around a Qwen3-MoE language model, imported through the
text Qwen3-MoE family (router, experts, expert parallelism).

Against the text Qwen3-MoE (``Qwen3MoeForCausalLM``), per transformers' ``modeling_qwen3_vl_moe.py``:

* the experts of a layer are stored fused (``Qwen3VLMoeTextExperts``): ``mlp.experts.gate_up_proj`` holds every
  expert's ``[gate; up]`` and ``mlp.experts.down_proj`` every expert's down projection, ``out x in``
  (transformers 5.x) or ``in x out`` (the released checkpoints): :mod:`thdpack.hf.fused_experts`.
  :class:`~thdpack.hf.fused_experts.FusedExpertsReader` shows each expert's slice as the text family's per-expert
  tensors (``mlp.experts.{e}.gate_proj.weight`` ``[I, H]``...), so the text mapping reads only this rank's experts
  (expert parallelism) and splits them as it does for Qwen3-MoE; the export
  (:mod:`thdpack.hf.vl_export`) stacks them back in the source's orientation
  (:func:`~thdpack.hf.fused_experts.fuse_experts`);
* the router (``mlp.gate.weight``, ``[E, H]``) always renormalises its top-k probabilities (``router_top_value /=
  router_top_value.sum(...)``, whatever ``norm_topk_prob`` says): imported as Qwen3-MoE with ``norm_topk_prob``
  true (Megatron: top-k of the logits, softmax over those k); a ``config.json`` that says ``norm_topk_prob: false``
  is refused (transformers would ignore it; which does the user mean?);
* dense layers between MoE layers (``decoder_sparse_step`` > 1, ``mlp_only_layers``) are refused by the Qwen3-MoE
  import (Megatron's ``moe_layer_freq`` 1: every layer a mixture of experts).

The vision tower is transformers' ``Qwen3VLMoeVisionModel`` (the same module as Qwen3-VL's), loaded from the
checkpoint. Tested with transformers 5.24.0 (CPU).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from thdpack.hf.checkpoint import HFCheckpoint, HFConfigError
from thdpack.hf.fused_experts import FusedExpertsReader
from thdpack.hf.vl_checkpoint import load_vision_state, text_import_config

from . import qwen3_moe, qwen3_vl
from .vl import vl_family

__all__ = ["FAMILY", "build_vision_tower", "load_vision_tower", "qwen3_moe_config"]


def build_vision_tower(config: Mapping, dtype=None):
    """transformers' ``Qwen3VLMoeVisionModel`` for ``config["vision_config"]``, weights uninitialised (random).
    Attention is SDPA: per image, as transformers runs it."""
    import torch
    from transformers import Qwen3VLMoeConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel

    vision_config = Qwen3VLMoeConfig(vision_config=dict(config["vision_config"])).vision_config
    vision_config._attn_implementation = "sdpa"
    return Qwen3VLMoeVisionModel._from_config(vision_config, dtype=dtype or torch.float32)


def load_vision_tower(directory: str | Path, dtype=None, device=None):
    """The checkpoint's vision tower, merger and DeepStack mergers (see :func:`thdpack.models.qwen3_vl.load_vision_tower`)."""
    config = HFCheckpoint.open(directory).config
    return load_vision_state(build_vision_tower(config, dtype), directory, device)


def qwen3_moe_config(checkpoint: HFCheckpoint) -> dict:
    """The language model of a Qwen3-VL-MoE ``config.json`` as a ``Qwen3MoeForCausalLM`` ``config.json`` (what
    Qwen3-MoE's model group reads): :func:`thdpack.hf.vl_checkpoint.text_import_config`, with ``norm_topk_prob``
    true (transformers' Qwen3-VL-MoE router always renormalises its top-k)."""
    text = text_import_config(checkpoint.config, "Qwen3MoeForCausalLM", "qwen3_moe")
    if text.get("norm_topk_prob", True) is not True:
        raise HFConfigError(
            f"{checkpoint.path}: text_config.norm_topk_prob is {text['norm_topk_prob']!r}: "
            "transformers' Qwen3-VL-MoE router renormalises its top-k probabilities whatever this key says "
            "(Qwen3VLMoeTextTopKRouter), so thdpack would compute something else than the key or than "
            "transformers; set it to true"
        )
    text["norm_topk_prob"] = True
    return text


def per_expert(reader, text: Mapping) -> FusedExpertsReader:
    """The language model's tensors with each layer's fused experts shown per expert, as Qwen3-MoE's mapping reads
    them (``text``: :func:`qwen3_moe_config`)."""
    experts = int(text.get("num_experts") or text["num_local_experts"])
    return FusedExpertsReader(reader, experts, int(text["hidden_size"]), int(text["moe_intermediate_size"]))


FAMILY = vl_family(
    name="qwen3_vl_moe",
    architectures=("Qwen3VLMoeForConditionalGeneration",),
    text=qwen3_moe.FAMILY,
    text_import=qwen3_moe_config,
    build_vision_tower=build_vision_tower,
    mrope_interleaved=True,
    deepstack_layers=qwen3_vl.deepstack_layers,
    language_reader=per_expert,
)
