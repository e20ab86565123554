"""DeepStack (Qwen3-VL) on Megatron's decoder: features of some vision layers added to the hidden states at the
image-token positions after the first ``k`` decoder layers.

The rule is transformers' ``Qwen3VLTextModel.forward`` (models/qwen3_vl/modeling_qwen3_vl.py): after decoder
layer ``i`` (0-based) for ``i < len(deepstack_visual_embeds)``, ``_deepstack_process`` does
``hidden_states[visual_pos_masks] += deepstack_visual_embeds[i]``; the ``k`` feature maps come from the vision
blocks ``vision_config.deepstack_visual_indexes``, each through its own merger (``deepstack_merger_list``), one row
per image token, images in order (the same order as the main merger's output).

Here: Megatron layer ``layer_number`` ``i + 1`` (1-based, global over pipeline stages) gets, after its forward,
``hidden + where(vision_index > 0, features[i][vision_index - 1], 0)``, where ``vision_index`` is the same
token-aligned map the embedding scatter uses (1 + the image-token row, 0 on text; packed and CP-sharded with the
tokens by :func:`thdpack.megatron.batch.get_batch`), so every CP rank adds the rows of its own image tokens; with
sequence parallelism the ``[s, b, h]`` addend is split over the TP group like the hidden states (Megatron's
``scatter_to_sequence_parallel_region``, whose backward gathers: a trained vision tower gets the whole gradient
on every TP rank, as for the embedding scatter). Adding 0 off the image tokens leaves them exactly as they were.

How the features reach the layers: the model's call wraps its ``packed_seq_params`` (None for the padded BSHD
baseline) in a :class:`DeepStackPackedSeqParams` that carries them; a forward pre-hook on each DeepStack layer
takes them off and hands the layer the original ``packed_seq_params`` (so attention, MRoPE and Transformer Engine
never see the carrier), the layer's forward hook adds them to its output. Carried as a call argument, not module
state, the features stay right under activation recomputation (Megatron's checkpointed forward passes
``packed_seq_params`` through to every layer) and under pipeline schedules that interleave micro-batches. Only the
first pipeline stage (which holds the vision tower) may hold DeepStack layers (:func:`check_deepstack_placement`).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

__all__ = [
    "DeepStackPackedSeqParams",
    "check_deepstack_placement",
    "check_deepstack_split",
    "deepstack_addend",
    "enable_deepstack",
    "with_deepstack",
]

_HOOKED = "_thdpack_deepstack_hooks"


def _carrier_class():
    """``THDPackedSeqParams`` plus the DeepStack inputs; built lazily (Megatron imported on first use)."""
    global DeepStackPackedSeqParams
    if DeepStackPackedSeqParams is None:
        from .packed_seq_params import THDPackedSeqParams

        @dataclasses.dataclass
        class _DeepStackPackedSeqParams(THDPackedSeqParams):
            """The call's ``packed_seq_params`` fields (the same values, for what reads them before the layers)
            plus ``features`` (per DeepStack layer ``[N, hidden]``), ``vision_index`` (``[b, s]``, this rank's
            tokens) and ``original`` (what the layers get back: the ``packed_seq_params`` given, or None)."""

            features: tuple = ()
            vision_index: torch.Tensor | None = None
            original: object = None

        DeepStackPackedSeqParams = _DeepStackPackedSeqParams
    return DeepStackPackedSeqParams


DeepStackPackedSeqParams = None


def with_deepstack(packed_seq_params, features, vision_index: torch.Tensor):
    """A carrier of ``features`` (per DeepStack layer ``[N, hidden]``, images in order) and ``vision_index``
    (``[b, s]``, this rank's tokens: 0 on text, 1 + the feature row on an image token) around ``packed_seq_params``
    (a THD ``PackedSeqParams`` or None)."""
    carrier = _carrier_class()
    fields = {}
    if packed_seq_params is not None:
        names = {f.name for f in dataclasses.fields(carrier)}
        fields = {
            f.name: getattr(packed_seq_params, f.name)
            for f in dataclasses.fields(packed_seq_params)
            if f.name in names
        }
    return carrier(**fields, features=tuple(features), vision_index=vision_index, original=packed_seq_params)


def deepstack_addend(
    features: torch.Tensor, vision_index: torch.Tensor, dtype: torch.dtype, sequence_parallel: bool
) -> torch.Tensor:
    """``[s, b, hidden]`` (``[s / tp, b, hidden]`` under sequence parallelism): ``features[vision_index - 1]`` at
    the image tokens, 0 elsewhere. A gather and a ``where``: no data-dependent shape, no host sync."""
    index = vision_index.transpose(0, 1)  # [s, b], as the hidden states
    rows = features.to(dtype)[(index - 1).clamp(min=0)]  # text tokens read row 0, then dropped
    addend = torch.where((index > 0).unsqueeze(-1), rows, torch.zeros((), dtype=dtype, device=rows.device))
    if sequence_parallel:
        from megatron.core import tensor_parallel

        addend = tensor_parallel.scatter_to_sequence_parallel_region(addend)
    return addend


def _pre_hook(slot: dict):
    def hook(layer, args, kwargs):
        params = kwargs.get("packed_seq_params")
        carries = DeepStackPackedSeqParams is not None and isinstance(params, DeepStackPackedSeqParams)
        slot["carrier"] = params if carries else None
        if not carries:
            return None
        return args, {**kwargs, "packed_seq_params": params.original}

    return hook


def _post_hook(slot: dict):
    def hook(layer, args, output):
        carrier = slot.pop("carrier", None)
        if carrier is None:
            return None
        i = layer.layer_number - 1
        if i >= len(carrier.features):
            return None
        hidden, context = output
        addend = deepstack_addend(
            carrier.features[i], carrier.vision_index, hidden.dtype, layer.config.sequence_parallel
        )
        return hidden + addend, context

    return hook


def enable_deepstack(gpt: nn.Module, layers: int) -> int:
    """Hook every decoder layer of ``gpt`` (this stage's bare ``GPTModel``): each hands its forward the original
    ``packed_seq_params`` of a carrying call (:func:`with_deepstack`), and those whose global ``layer_number`` is
    at most ``layers`` add their DeepStack features to their output. Idempotent; returns how many layers it
    hooked."""
    hooked = 0
    for layer in gpt.decoder.layers:
        if getattr(layer, _HOOKED, None):
            continue
        # The pre-hook hands the post-hook the carrier of the same call: a layer's forward is never re-entered
        # before it returns (recomputation runs it again later, both hooks included).
        slot: dict = {}
        handles = (
            layer.register_forward_pre_hook(_pre_hook(slot), with_kwargs=True),
            layer.register_forward_hook(_post_hook(slot)),
        )
        setattr(layer, _HOOKED, handles)
        hooked += 1
    return hooked


def check_deepstack_placement(gpt: nn.Module, layers: int, pre_process: bool) -> None:
    """Raise ``ValueError`` when this pipeline stage cannot run DeepStack: the first stage (which runs the vision
    tower) must hold decoder layers 1..``layers``, no other stage may hold any of them (the features are not sent
    between stages)."""
    here = sorted(layer.layer_number for layer in gpt.decoder.layers)
    mine = [n for n in here if n <= layers]
    expected = list(range(1, layers + 1))
    if (pre_process and mine != expected) or (not pre_process and mine):
        raise ValueError(
            f"DeepStack adds vision features after decoder layers 1..{layers} (vision_config."
            f"deepstack_visual_indexes), which must all be on the first pipeline stage, but this stage "
            f"(first: {pre_process}) holds layers {here[:1] + here[-1:]} (first, last): give the first stage at "
            f"least {layers} layers (model.config.num_layers_in_first_pipeline_stage)"
        )


def check_deepstack_split(first_stage_layers: int | None, layers: int, pp: int) -> None:
    """The recipe-time form of :func:`check_deepstack_placement`: raise ``ValueError`` naming the key when the
    first of ``pp`` pipeline stages holds ``first_stage_layers`` decoder layers (None: a split Megatron decides;
    the model's build checks it) and fewer than the ``layers`` that get DeepStack features."""
    if pp <= 1 or not layers or first_stage_layers is None or first_stage_layers >= layers:
        return
    raise ValueError(
        f"DeepStack (Qwen3-VL) adds vision features after decoder layers 1..{layers} (vision_config."
        f"deepstack_visual_indexes), on the first pipeline stage (which runs the vision tower; the features are not "
        f"sent between stages), but with parallel.pipeline_model_parallel_size={pp} it holds "
        f"{first_stage_layers}: set model.config.num_layers_in_first_pipeline_stage to at least {layers}"
    )
