"""The keys a recipe may hold: those of the shipped recipe files, and a recipe checked against them.

The schema is read from ``recipes/`` itself (every option of every group, and ``train.yaml``), so a key added to a
recipe file is known at once. ``model.config`` holds megatron-core ``TransformerConfig`` fields by their own names:
those are checked against the dataclass. A key nobody reads (a typo, also one added with Hydra's ``+``) would
leave its default in force without a word: it is refused, naming the closest known key.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from functools import cache
from importlib import resources
from pathlib import Path

import yaml

from .config_error import ConfigError

__all__ = [
    "GROUPS",
    "boolean_keys",
    "check_keys",
    "group_options",
    "recipe_schema",
    "recipes_dir",
    "unknown_key_error",
]

GROUPS = ("model", "dataset", "parallel", "trainer", "peft")

# Keys thdpack reads with a default that no shipped recipe file sets (a tree like the schema's; None = a leaf).
OPTIONAL_KEYS = {
    "model": {"attention_mask_type": None},  # thdpack.megatron.setup: causal only (checked at start-up)
    "dataset": {
        "cost_weights": None,  # thdpack.data.loader: the token-budget plan's cost model [a, b]
        "synthetic": {"mean": None},  # thdpack.data.synthetic: the lognormal's mean instead of its median
    },
}
# Megatron-core's TransformerConfig fields, checked against the dataclass itself.
TRANSFORMER_CONFIG = ("model", "config")


def recipes_dir() -> Path:
    """The recipes' directory: the top-level ``recipes/`` of a source checkout (editable install), else the copy
    a wheel installs as ``thdpack/recipes``."""
    package = Path(str(resources.files("thdpack")))
    checkout = package.parent / "recipes"
    return checkout if (checkout / "train.yaml").is_file() else package / "recipes"


def group_options(recipes: Path, group: str) -> list[str]:
    """The options of a recipe group: the YAML files of ``recipes/<group>/``, by name."""
    return sorted(p.stem for p in (recipes / group).glob("*.yaml"))


def recipe_schema(recipes: Path) -> dict:
    """The known keys as a tree (``{key: subtree or None}``): the union of every recipe file's keys, and
    :data:`OPTIONAL_KEYS`."""
    return _schema(str(recipes))


@cache
def _schema(recipes: str) -> dict:
    root = Path(recipes)
    schema: dict = {}
    _merge(schema, {k: v for k, v in _load(root / "train.yaml").items() if k not in ("defaults", "hydra")})
    for group in GROUPS:
        tree = schema.setdefault(group, {})
        for option in group_options(root, group):
            _merge(tree, {k: v for k, v in _load(root / group / f"{option}.yaml").items() if k != "defaults"})
    _merge(schema, OPTIONAL_KEYS)
    return schema


def boolean_keys(recipes: Path) -> frozenset[tuple[str, ...]]:
    """The keys every recipe file that sets them sets to true or false: they take nothing else."""
    return _boolean_keys(str(recipes))


@cache
def _boolean_keys(recipes: str) -> frozenset[tuple[str, ...]]:
    root = Path(recipes)
    seen: dict[tuple[str, ...], set[bool]] = {}
    files = [((), root / "train.yaml")]
    files += [((g,), root / g / f"{o}.yaml") for g in GROUPS for o in group_options(root, g)]
    for prefix, path in files:
        _leaves(_load(path), prefix, seen)
    return frozenset(path for path, kinds in seen.items() if kinds == {True})


def _leaves(tree: Mapping, prefix: tuple[str, ...], seen: dict) -> None:
    for key, value in tree.items():
        if key in ("defaults", "hydra"):
            continue
        if isinstance(value, Mapping):
            _leaves(value, (*prefix, str(key)), seen)
        else:
            seen.setdefault((*prefix, str(key)), set()).add(isinstance(value, bool))


def _load(path: Path) -> dict:
    with open(path) as f:
        return yaml.safe_load(f) or {}


def _merge(tree: dict, values: Mapping) -> None:
    for key, value in values.items():
        if isinstance(value, Mapping):
            if not isinstance(tree.get(key), dict):
                tree[key] = {}
            _merge(tree[key], value)
        else:
            tree.setdefault(key, None)


def check_keys(cfg: Mapping, recipes: Path) -> None:
    """Raise :class:`ConfigError` naming the first key of ``cfg`` that no recipe file has (and thdpack does not
    read), with the closest known key; ``model.config`` keys against ``TransformerConfig``'s fields."""
    for path, known in _unknown(cfg, recipe_schema(recipes), ()):
        raise unknown_key_error(path, known)


def unknown_key_error(path: tuple[str, ...], known: list[str]) -> ConfigError:
    """The error for the unknown key ``path`` (a tuple of names), ``known`` the keys beside it."""
    close = difflib.get_close_matches(path[-1], known, n=1, cutoff=0.6)
    hint = f": did you mean {'.'.join((*path[:-1], close[0]))}?" if close else ""
    if path[:-1] == TRANSFORMER_CONFIG:
        return ConfigError(
            f"{'.'.join(path)} is not a field of megatron.core TransformerConfig{hint} (model.config takes "
            "TransformerConfig's own key names)"
        )
    parent = ".".join(path[:-1])
    return ConfigError(
        f"{'.'.join(path)} is not a recipe key{hint or '.'} The {f'{parent} keys' if parent else 'top-level keys'} "
        f"are {', '.join(sorted(known))}. A key that no recipe reads would leave its default in force."
    )


def _unknown(cfg: Mapping, schema: dict, path: tuple):
    for key in cfg:
        key = str(key)
        here = (*path, key)
        if here == ("hydra",):
            continue
        if key not in schema:
            yield here, list(schema)
        elif here == TRANSFORMER_CONFIG:
            fields = transformer_config_fields()
            for name in cfg[key] or {}:
                if str(name) not in fields:
                    yield (*here, str(name)), sorted(fields)
        elif isinstance(schema[key], dict):  # a leaf's value is not read here: it may be a missing ??? value
            value = cfg[key]
            if isinstance(value, Mapping):
                yield from _unknown(value, schema[key], here)


@cache
def transformer_config_fields() -> frozenset[str]:
    from megatron.core.transformer.transformer_config import TransformerConfig

    return frozenset(f.name for f in dataclasses.fields(TransformerConfig))
