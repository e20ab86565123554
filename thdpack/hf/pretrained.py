"""The recipe's ``model`` group of a Hugging Face directory (``model=hf model.pretrained=DIR``): the text families'
(:func:`thdpack.hf.config.model_group`) or a vision-language checkpoint's (its family module's ``model_group``,
:data:`thdpack.hf.vl_checkpoint.VL_ARCHITECTURES`), with the recipe's own settings on top."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .config import ARCHITECTURE_KEYS, HF_FAMILY, TOP_LEVEL_KEYS, HFConfigError, model_group, read_hf_config
from .vl_checkpoint import VL_ARCHITECTURES, is_vl_config, vl_module

__all__ = ["pretrained_model_group"]


def pretrained_model_group(recipe_model: Mapping[str, Any], *, seq_length: int, tp: int) -> dict[str, Any]:
    """The recipe's ``model`` group with ``pretrained`` set, made concrete: :func:`model_group` of its
    ``config.json`` (a vision-language family's ``model_group`` for a Qwen2.5-VL or Qwen3-VL checkpoint),
    with the recipe's own settings on top (dropout, initialisation, recompute, the MoE dispatcher...). A recipe
    setting that contradicts config.json on the architecture is an error."""
    directory = recipe_model["pretrained"]
    hf = read_hf_config(directory)
    group = _group_builder(hf)(hf, seq_length=seq_length, tp=tp)
    family = group.get("family", HF_FAMILY)
    recipe = {k: v for k, v in dict(recipe_model).items()}
    overrides = {k: v for k, v in dict(recipe.pop("config", None) or {}).items() if v is not None}
    for key, value in overrides.items():
        if key in ARCHITECTURE_KEYS and key in group["config"] and value != group["config"][key]:
            raise HFConfigError(
                f"model.config.{key}={value!r} contradicts {hf['_path']} ({group['config'][key]!r}): the "
                "checkpoint's weights fix the architecture; remove the override"
            )
        group["config"][key] = value
    for key in TOP_LEVEL_KEYS:
        if recipe.get(key) is not None and recipe[key] != group[key]:
            raise HFConfigError(
                f"model.{key}={recipe[key]!r} contradicts {hf['_path']} ({group[key]!r}): remove the override"
            )
        recipe.pop(key, None)
    recipe.pop("name", None)
    named = recipe.pop("family", None)
    if named not in (None, "gpt", HF_FAMILY, family):
        raise HFConfigError(
            f"model.family is '{named}' but model.pretrained is set: {hf['_path']} is built by the '{family}' "
            "family (leave model.family unset)"
        )
    return {**group, **recipe, "family": family, "pretrained": str(directory)}


def _group_builder(hf: Mapping[str, Any]):
    """The model-group function of a ``config.json``: a vision-language checkpoint's (its family module's, e.g.
    :func:`thdpack.hf.qwen3_vl.model_group`), else :func:`model_group` (the ``hf`` family, :data:`HF_FAMILY`).
    A checkpoint with a ``vision_config`` whose architecture no VL family supports is refused here, naming it."""
    if is_vl_config(hf):
        return vl_module(hf, hf.get("_path", "config.json")).model_group
    if isinstance(hf.get("vision_config"), Mapping):
        raise HFConfigError(
            f"{hf.get('_path', 'config.json')}: architectures {hf.get('architectures')!r} has a vision_config but "
            f"no vision-language family: thdpack supports {list(VL_ARCHITECTURES)}"
        )
    return model_group
