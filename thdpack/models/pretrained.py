"""The recipe's ``model`` group of a Hugging Face directory (``model=hf model.pretrained=DIR``): its family's
(:func:`thdpack.models.registry.family_of`) model group of ``config.json``, with the recipe's own settings on top.

    group = pretrained_model_group(recipe_model, seq_length=4096, tp=2)
    group = model_group(HFCheckpoint.open(DIR), seq_length=4096, tp=2)    # config.json alone
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from thdpack.hf.checkpoint import HFCheckpoint, HFConfigError
from thdpack.hf.config_keys import ACCEPT_KEY, ConfigReader

from .registry import family_of

__all__ = ["ARCHITECTURE_KEYS", "TOP_LEVEL_KEYS", "model_group", "pretrained_model_group"]

log = logging.getLogger("thdpack")

# Model-group config keys that config.json fixes (the weights' shapes and the math); a recipe may not change them.
# fmt: off
ARCHITECTURE_KEYS = frozenset({
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
    "kv_channels", "normalization", "layernorm_epsilon", "gated_linear_unit", "activation_func",
    "add_bias_linear", "add_qkv_bias", "qk_layernorm", "num_moe_experts", "moe_router_topk",
    "moe_ffn_hidden_size", "moe_router_pre_softmax", "moe_router_score_function", "moe_layer_freq",
})
# fmt: on
# Model-group keys outside model.config that config.json fixes.
TOP_LEVEL_KEYS = (
    "position_embedding_type",
    "rotary_base",
    "vocab_size",
    "share_embeddings_and_output_weights",
)


def model_group(
    checkpoint: HFCheckpoint, *, seq_length: int, tp: int = 1, accept: Iterable[str] = ()
) -> dict[str, Any]:
    """The model group (Megatron ``TransformerConfig`` keys under ``config``, ``family``: the family's name) that
    computes what transformers computes with ``checkpoint``, for rows of up to ``seq_length`` tokens under tensor
    parallelism ``tp``. Every key of ``config.json`` is read by the family, harmless
    (:data:`thdpack.hf.config_keys.HARMLESS_KEYS`) or in ``accept``; any other stops it, naming the file, line and
    key (:class:`~thdpack.hf.checkpoint.HFConfigError`)."""
    family = family_of(checkpoint)
    reader = ConfigReader(checkpoint, accept=accept)
    group = family.model_group(reader, seq_length=seq_length, tp=tp)
    reader.refuse_unknown()
    accepted = sorted(set(checkpoint.config) & reader.accept - reader.used)
    if accepted:
        log.warning(
            "%s: %s accepted unread (%s): the model is built without them",
            checkpoint.path,
            accepted,
            ACCEPT_KEY,
        )
    return {**group, "family": family.name}


def _accepted(recipe_model: Mapping[str, Any]) -> list[str]:
    keys = recipe_model.get("accept_unknown_config_keys")
    if keys is None:
        return []
    if isinstance(keys, str) or not all(isinstance(k, str) for k in keys):
        raise HFConfigError(
            f"{ACCEPT_KEY} is {keys!r}: a list of config.json keys expected, e.g. [key1,key2]"
        )
    return list(keys)


def pretrained_model_group(recipe_model: Mapping[str, Any], *, seq_length: int, tp: int) -> dict[str, Any]:
    """The recipe's ``model`` group with ``pretrained`` set, made concrete: :func:`model_group` of its
    ``config.json``, with the recipe's own settings on top (dropout, initialisation, recompute, the MoE
    dispatcher...). A recipe setting that contradicts config.json on the architecture is an error."""
    directory = recipe_model["pretrained"]
    checkpoint = HFCheckpoint.open(directory)
    group = model_group(checkpoint, seq_length=seq_length, tp=tp, accept=_accepted(recipe_model))
    family = group["family"]
    recipe = {k: v for k, v in dict(recipe_model).items()}
    overrides = {k: v for k, v in dict(recipe.pop("config", None) or {}).items() if v is not None}
    for key, value in overrides.items():
        if key in ARCHITECTURE_KEYS and key in group["config"] and value != group["config"][key]:
            raise HFConfigError(
                f"model.config.{key}={value!r} contradicts {checkpoint.path} ({group['config'][key]!r}): the "
                "checkpoint's weights fix the architecture; remove the override"
            )
        group["config"][key] = value
    for key in TOP_LEVEL_KEYS:
        if recipe.get(key) is not None and recipe[key] != group[key]:
            raise HFConfigError(
                f"model.{key}={recipe[key]!r} contradicts {checkpoint.path} ({group[key]!r}): remove the override"
            )
        recipe.pop(key, None)
    recipe.pop("name", None)
    named = recipe.pop("family", None)
    if named not in (None, "gpt", family):
        raise HFConfigError(
            f"model.family is '{named}' but model.pretrained is set: {checkpoint.path} is built by the '{family}' "
            "family (leave model.family unset)"
        )
    return {**group, **recipe, "family": family, "pretrained": str(directory)}
