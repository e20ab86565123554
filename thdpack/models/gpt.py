"""The ``gpt`` family: megatron-core's ``GPTModel`` (dense, MoE, MRoPE) built from the recipe's model group alone,
with random weights (``model.family: gpt``, the tiny and from-scratch recipes). The Hugging Face decoder families
build the same model and load a checkpoint into it (:mod:`thdpack.models.decoder`)."""

from __future__ import annotations

from collections.abc import Mapping

from thdpack.megatron.step import gpt_forward

from .family import ModelFamily

__all__ = ["FAMILY", "MODEL_KEYS", "build"]

MODEL_KEYS = (
    "position_embedding_type",
    "rotary_base",
    "share_embeddings_and_output_weights",
    "output_loss",
    "te_op_fuser",
)


def build(model: Mapping, config, vocab_size: int, max_sequence_length: int, runtime, **build_kwargs):
    """This rank's ``GPTModel`` stage (:func:`thdpack.megatron.models.build_gpt_model`, which takes
    ``build_kwargs``) with the recipe's output layer and loss (:mod:`thdpack.megatron.output_loss`)."""
    from thdpack.megatron.models import build_gpt_model
    from thdpack.megatron.output_loss import resolve_output_loss, use_output_loss

    module = build_gpt_model(
        config,
        vocab_size,
        max_sequence_length,
        backend=runtime.backend,
        position_embedding_type=model.get("position_embedding_type", "rope"),
        rotary_base=int(model.get("rotary_base", 10000)),
        share_embeddings_and_output_weights=bool(model.get("share_embeddings_and_output_weights", False)),
        te_op_fuser=model.get("te_op_fuser") is True,  # "auto" is resolved with the recipe
        **build_kwargs,
    )
    use_output_loss(module, resolve_output_loss(model, runtime.device))
    return module


FAMILY = ModelFamily(name="gpt", build=build, forward=gpt_forward, model_keys=MODEL_KEYS)
