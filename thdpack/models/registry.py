"""Every model family thdpack knows, in one registry: each module of :mod:`thdpack.models` that declares ``FAMILY``
(a :class:`~thdpack.models.family.ModelFamily`), found the first time the registry is asked, and any family
registered at run time (:func:`register_family`).

    family_of(HFCheckpoint.open(DIR))   # by config.json's architectures: model=hf model.pretrained=DIR
    get_family("gpt")                   # by the recipe's model.family (or "package.module:ATTRIBUTE")

Adding a family is adding its module (``thdpack/models/<name>.py`` with ``FAMILY = ...``): no list to edit. Every
module here is imported when the registry is first asked, so a module keeps Megatron and transformers imports inside
its functions (reading a recipe must stay quick).
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

from thdpack.hf.checkpoint import HFCheckpoint

from .family import ModelFamily

__all__ = ["family_of", "get_family", "known_architectures", "register_family"]

_BY_NAME: dict[str, ModelFamily] = {}
_BY_ARCHITECTURE: dict[str, ModelFamily] = {}
_found = False


def _find() -> None:
    """Import every module of this package once and register the ``FAMILY`` each declares."""
    global _found
    if _found:
        return
    _found = True
    for module in pkgutil.iter_modules([str(Path(__file__).parent)]):
        family = getattr(importlib.import_module(f"{__package__}.{module.name}"), "FAMILY", None)
        if family is not None:
            register_family(family)


def register_family(family: ModelFamily) -> ModelFamily:
    """Add ``family`` under its name and its architectures (replacing a family of that name); returns it."""
    if not isinstance(family, ModelFamily):
        raise TypeError(f"register_family takes a ModelFamily, got a {type(family).__name__}")
    for architecture in family.architectures:
        other = _BY_ARCHITECTURE.get(architecture)
        if other is not None and other.name != family.name:
            raise ValueError(f"families '{other.name}' and '{family.name}' both import {architecture}")
        _BY_ARCHITECTURE[architecture] = family
    _BY_NAME[family.name] = family
    return family


def known_architectures() -> list[str]:
    """Every ``config.json`` architecture a family imports, sorted."""
    _find()
    return sorted(_BY_ARCHITECTURE)


def family_of(checkpoint: HFCheckpoint) -> ModelFamily:
    """The family of a Hugging Face checkpoint, by its ``config.json``'s ``architectures`` (exactly one). Raises
    :class:`~thdpack.hf.checkpoint.HFConfigError` naming the file, the line and the architectures thdpack imports."""
    _find()
    family = _BY_ARCHITECTURE.get(checkpoint.architecture or "")
    if family is None:
        raise checkpoint.error(
            "architectures",
            f"is {checkpoint.config.get('architectures')!r}: thdpack imports exactly one of "
            f"{known_architectures()}",
        )
    return family


def get_family(name: str) -> ModelFamily:
    """The family a recipe's ``model.family`` names: a registered name, or ``"package.module:ATTRIBUTE"`` (a
    family of one's own, imported when named). Raises ``ValueError`` naming the key."""
    _find()
    family = _BY_NAME.get(name)
    if family is not None:
        return family
    if ":" not in str(name):
        raise ValueError(
            f"model.family is '{name}': known families are {sorted(_BY_NAME)} (add one as a module of "
            "thdpack.models declaring FAMILY, register one with thdpack.models.register_family, or name it as "
            "'package.module:ATTRIBUTE')"
        )
    module, _, attribute = str(name).partition(":")
    family = getattr(importlib.import_module(module), attribute, None)
    if not isinstance(family, ModelFamily):
        raise ValueError(
            f"model.family '{name}' names a {type(family).__name__}, not a thdpack.models.ModelFamily"
        )
    _BY_NAME[name] = family
    return family
