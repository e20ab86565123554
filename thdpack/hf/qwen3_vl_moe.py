"""Qwen3-VL-MoE (``Qwen3VLMoeForConditionalGeneration``, e.g. Qwen3-VL-30B-A3B) from a Hugging Face directory:
Qwen3-VL's vision tower, DeepStack and interleaved MRoPE (:mod:`thdpack.hf.qwen3_vl`) around a Qwen3-MoE language
model, imported through the text Qwen3-MoE import (router, experts, expert parallelism).

Against the text Qwen3-MoE (``Qwen3MoeForCausalLM``), per transformers' ``modeling_qwen3_vl_moe.py``:

* the experts of a layer are stored fused (``Qwen3VLMoeTextExperts``): ``mlp.experts.gate_up_proj`` holds every
  expert's ``[gate; up]`` and ``mlp.experts.down_proj`` every expert's down projection, ``out x in``
  (transformers 5.x) or ``in x out`` (the released checkpoints): :mod:`thdpack.hf.fused_experts`.
  :class:`~thdpack.hf.fused_experts.FusedExpertsReader` shows each expert's slice as the text family's per-expert
  tensors (``mlp.experts.{e}.gate_proj.weight`` ``[I, H]``...), so the text import reads only this rank's experts
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

from . import qwen3_vl, vl_checkpoint
from .config import HFConfigError
from .fused_experts import FusedExpertsReader

__all__ = [
    "ARCHITECTURES",
    "FAMILY",
    "build_vision_tower",
    "deepstack_layers",
    "load_language_model",
    "load_vision_tower",
    "model_group",
    "qwen3_moe_config",
]

ARCHITECTURES = ("Qwen3VLMoeForConditionalGeneration",)
FAMILY = "thdpack.hf.vlm_family:QWEN3_VL_MOE"
MROPE_INTERLEAVED = qwen3_vl.MROPE_INTERLEAVED
deepstack_layers = qwen3_vl.deepstack_layers


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
    """The checkpoint's vision tower, merger and DeepStack mergers (see :func:`thdpack.hf.qwen3_vl.load_vision_tower`)."""
    config = vl_checkpoint.read_vl_config(directory)
    return vl_checkpoint.load_vision_state(build_vision_tower(config, dtype), directory, device)


def qwen3_moe_config(config: Mapping) -> dict:
    """The language model of a Qwen3-VL-MoE ``config.json`` as a ``Qwen3MoeForCausalLM`` ``config.json`` (what the
    Qwen3-MoE import reads): :func:`thdpack.hf.vl_checkpoint.text_import_config`, with ``norm_topk_prob`` true
    (transformers' Qwen3-VL-MoE router always renormalises its top-k)."""
    text = vl_checkpoint.text_import_config(config, "Qwen3MoeForCausalLM", "qwen3_moe")
    if text.get("norm_topk_prob", True) is not True:
        raise HFConfigError(
            f"{config.get('_path', 'config.json')}: text_config.norm_topk_prob is {text['norm_topk_prob']!r}: "
            "transformers' Qwen3-VL-MoE router renormalises its top-k probabilities whatever this key says "
            "(Qwen3VLMoeTextTopKRouter), so thdpack would compute something else than the key or than "
            "transformers; set it to true"
        )
    text["norm_topk_prob"] = True
    return text


def model_group(config: Mapping, *, seq_length: int, tp: int = 1) -> dict:
    """The recipe's model group of a Qwen3-VL-MoE checkpoint: the Qwen3-MoE import's group of its language model
    (experts, router, alltoall dispatcher), with multimodal RoPE (``mrope_section``) and this family
    (:data:`FAMILY`: interleaved MRoPE, DeepStack); ``freeze_vision`` true."""
    deepstack_layers(config)
    group = vl_checkpoint.vl_model_group(
        config, seq_length=seq_length, tp=tp, import_config=qwen3_moe_config, label="Qwen3-VL-MoE"
    )
    group.update(name="hf_qwen3_vl_moe", family=FAMILY)
    return group


def load_language_model(gpt, directory: str | Path) -> int:
    """Load a Qwen3-VL-MoE checkpoint's language model into ``gpt`` (this rank's bare ``GPTModel`` chunk) with
    the Qwen3-MoE import: this rank's experts and tensor-parallel slices only; vocabulary padding never
    predicted. Returns the tensors loaded."""
    from .config import read_hf_config
    from .load import SafetensorsReader, load_weights, never_predict_padding

    hf = qwen3_moe_config(read_hf_config(directory))
    experts = int(hf.get("num_experts") or hf["num_local_experts"])
    reader = FusedExpertsReader(
        vl_checkpoint.LanguageModelReader(SafetensorsReader(directory)),
        experts,
        int(hf["hidden_size"]),
        int(hf["moe_intermediate_size"]),
    )
    loaded = load_weights(gpt, reader, hf)
    never_predict_padding(gpt, int(hf["vocab_size"]))
    return loaded
