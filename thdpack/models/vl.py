"""The Qwen vision-language families (``model=hf model.pretrained=<a Qwen2.5-VL, Qwen3-VL or Qwen3-VL-MoE
directory>``): :class:`~thdpack.megatron.vlm.VisionLanguageModel`, a ``GPTModel`` language model with packed MRoPE
imported through a text family, beside transformers' own vision tower loaded from the checkpoint; called on
micro-batches whose images ride beside the packed row (``pixel_values``, ``image_grid_thw``: carried, not packed;
``vision_index``: packed and CP-sharded with the tokens).

A family module declares what is its own and :func:`vl_family` makes its
:class:`~thdpack.models.family.ModelFamily`: the text family its language model imports as (and how its
``config.json`` reads as that family's: ``text_import``), the vision tower class, the MRoPE frequency layout,
DeepStack, and how its language model's tensors read as the text family's (Qwen3-VL-MoE's fused experts).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path

from thdpack.hf.checkpoint import HFCheckpoint, HFConfigError
from thdpack.hf.config_keys import ConfigReader
from thdpack.hf.vl_checkpoint import LanguageModelReader, load_vision_state, text_config, vl_facts

from .family import ModelFamily

__all__ = ["MODEL_KEYS", "VISION_KEYS", "no_deepstack", "vl_family"]

log = logging.getLogger("thdpack")

# The batch entries a VL family carries beside the packed row (the images of thdpack.megatron.vlm's forward).
VISION_KEYS = ("pixel_values", "image_grid_thw")
MODEL_KEYS = (
    "pretrained",
    "freeze_vision",
    "position_embedding_type",
    "rotary_base",
    "rope_scaling",
    "share_embeddings_and_output_weights",
    "te_op_fuser",
    "accept_unknown_config_keys",
)


def no_deepstack(checkpoint: HFCheckpoint) -> int:
    """A vision tower without DeepStack: 0 decoder layers get vision features."""
    return 0


def vl_family(
    *,
    name: str,
    architectures: tuple[str, ...],
    text: ModelFamily,
    text_import: Callable[[HFCheckpoint], dict],
    build_vision_tower: Callable[..., object],
    mrope_interleaved: bool,
    deepstack_layers: Callable[[HFCheckpoint], int] = no_deepstack,
    language_reader: Callable[[LanguageModelReader, Mapping], object] | None = None,
) -> ModelFamily:
    """A Qwen vision-language family.

    Args:
        name, architectures: the family's name and ``config.json`` architectures.
        text: the text family its language model imports as (its ``model_group`` and ``mapping``).
        text_import: the checkpoint's ``config.json`` as that text family's ``config.json``
            (:func:`thdpack.hf.vl_checkpoint.text_import_config`, plus the family's own rules).
        build_vision_tower: ``(config, dtype) -> module``: transformers' vision tower for ``vision_config``,
            weights uninitialised.
        mrope_interleaved: MRoPE's frequency layout (:func:`thdpack.megatron.mrope.mrope_frequencies`).
        deepstack_layers: how many decoder layers get DeepStack features (raises
            :class:`~thdpack.hf.checkpoint.HFConfigError` for a layout the decoder cannot hold).
        language_reader: ``(reader, text config) -> reader``: the language model's tensors as the text family's
            names (Qwen3-VL-MoE's fused experts shown per expert), or None where they already are.
    """

    def model_group(r: ConfigReader, *, seq_length: int, tp: int) -> dict:
        checkpoint = r.checkpoint
        deepstack_layers(
            checkpoint
        )  # refuse a DeepStack layout the decoder cannot hold before anything is built
        rope = text_config(r.config)["rope_parameters"]
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "mrope"):
            raise HFConfigError(
                f"{checkpoint.path}: rope_type '{kind}': {name}'s language model uses plain multimodal RoPE "
                "(mrope_section), no scaling"
            )
        facts = vl_facts(r.config, str(checkpoint.path))
        language = r.derived(text_import(checkpoint))
        group = text.model_group(language, seq_length=seq_length, tp=tp)
        language.refuse_unknown()
        # The rest of the file is the vision side and the image tokens (read by the processor and the tower);
        # the language model's keys were read just now, through the text family.
        r.used.update(r.config)
        group["config"]["mrope_section"] = list(facts.mrope_section)
        group.update(name=f"hf_{name}", position_embedding_type="mrope", freeze_vision=True)
        return group

    def load_language_model(gpt, checkpoint: HFCheckpoint) -> int:
        from thdpack.hf.load import load_weights, never_predict_padding

        config = text_import(checkpoint)
        reader = LanguageModelReader(checkpoint.tensors())
        if language_reader is not None:
            reader = language_reader(reader, config)
        loaded = load_weights(gpt, reader, text.mapping, int(config["vocab_size"]))
        never_predict_padding(gpt, int(config["vocab_size"]))
        return loaded

    def build(model: Mapping, config, vocab_size: int, max_sequence_length: int, runtime):
        """This rank's :class:`VisionLanguageModel` with the checkpoint's weights: the language model by the text
        family's mapping (per-rank slices), the vision tower (first pipeline stage only) from its safetensors."""
        import torch

        from thdpack.megatron.vlm import VisionLanguageModel, build_language_model

        directory = model.get("pretrained")
        if not directory:
            raise ValueError(f"the {name} family needs model.pretrained (a Hugging Face directory)")
        checkpoint = HFCheckpoint.open(directory)
        language_model = build_language_model(
            model, config, vocab_size, max_sequence_length, runtime, mrope_interleaved=mrope_interleaved
        )
        loaded = load_language_model(language_model, checkpoint)
        log.info("loaded %d language-model tensors of %s into this rank's model", loaded, directory)
        visual = None
        if language_model.pre_process:
            visual = load_vision_state(build_vision_tower(checkpoint.config, torch.float32), directory)
        return VisionLanguageModel(
            config,
            language_model,
            visual,
            freeze_vision=bool(model.get("freeze_vision", True)),
            deepstack_layers=deepstack_layers(checkpoint),
        )

    def check(cfg: Mapping) -> None:
        """Under pipeline parallelism the first stage, which runs the vision tower, holds every DeepStack layer
        (:func:`thdpack.megatron.deepstack.check_deepstack_split`). A trained vision tower
        (``model.freeze_vision=false``) gets no gradient from a step without images: megatron-core's overlapped
        gradient reduction and parameter all-gather wait for every parameter, and stop on a bare
        ``AssertionError`` (tests/unit/test_checks.py); they are refused with it."""
        from thdpack.megatron.deepstack import check_deepstack_split
        from thdpack.megatron.parallel_layout import first_stage_layers

        model, pp = cfg["model"], int(cfg["parallel"]["pipeline_model_parallel_size"])
        overlap = [
            k for k in ("overlap_grad_reduce", "overlap_param_gather") if cfg["trainer"].get(k) is True
        ]
        if overlap and not model.get("freeze_vision", True):
            raise ValueError(
                f"model.freeze_vision=false with trainer.{overlap[0]}=true: a micro-batch without images leaves "
                "the vision tower without gradients, and megatron-core's overlapped communication waits for every "
                "parameter's. Set trainer.overlap_grad_reduce=false trainer.overlap_param_gather=false, or keep "
                "model.freeze_vision=true"
            )
        if pp <= 1 or not model.get("pretrained"):
            return
        layers = deepstack_layers(HFCheckpoint.open(model["pretrained"]))
        check_deepstack_split(first_stage_layers(model.get("config") or {}, pp), layers, pp)

    def export(iteration_dir: Path, kept: HFCheckpoint):
        from thdpack.hf.vl_export import vl_checkpoint_hf_tensors

        return vl_checkpoint_hf_tensors(iteration_dir, kept, text.mapping)

    def forward(model, inputs):
        from thdpack.megatron.vlm import vlm_forward

        return vlm_forward(model, inputs)

    def transform(batch: dict) -> dict:
        from thdpack.megatron.vlm import vlm_batch_transform

        return vlm_batch_transform(batch)

    return ModelFamily(
        name=name,
        build=build,
        forward=forward,
        model_keys=MODEL_KEYS,
        transform=transform,
        carry_keys=VISION_KEYS,
        check=check,
        architectures=architectures,
        model_group=model_group,
        mapping=text.mapping,
        export=export,
    )
