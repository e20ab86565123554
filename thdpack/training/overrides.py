"""The command line's overrides checked against the recipes before Hydra composes them.

Hydra answers a key it does not find with its own advice ("To append to your config use +trainer.lrr=1e-3", exit
code 1): for a typo that advice is wrong, since the added key would be read by nobody. Here every ``key=value``,
``+key=value``, ``++key=value``, ``~key`` and ``group=option`` of ``python -m thdpack.train`` is checked first, against
the option files the run will use: an unknown key or option is named with the closest known one, a key that belongs
to another option of its group names that option, and ``+`` is asked for only where it is right (a
``TransformerConfig`` field or a key thdpack reads that no recipe file sets). Hydra's own keys (``hydra.*``) and
flags (``--cfg``, ``--help``, ...) pass through.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from functools import cache
from pathlib import Path

from .config_error import ConfigError
from .recipe_keys import (
    GROUPS,
    OPTIONAL_KEYS,
    TRANSFORMER_CONFIG,
    group_options,
    recipe_schema,
    transformer_config_fields,
    unknown_key_error,
)

__all__ = ["check_overrides"]


def check_overrides(argv: Sequence[str], recipes: Path) -> None:
    """Raise :class:`ConfigError` for the first override in ``argv`` (``python -m thdpack.train``'s arguments) that
    Hydra would refuse or that would be read by nobody."""
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    args, _ = get_args_parser().parse_known_args(list(argv))
    try:
        overrides = OverridesParser.create().parse_overrides(args.overrides)
    except OverrideParseException as e:
        raise ConfigError(f"a command-line override cannot be parsed: {e}") from None
    chosen = dict(default_options(recipes))
    for override in overrides:
        key = override.key_or_group
        if key in GROUPS and not override.is_delete():
            chosen[key] = _option(key, override.value(), recipes)
    for override in overrides:
        path = tuple(override.key_or_group.split("."))
        if path[0].split("/")[0] == "hydra" or (len(path) == 1 and path[0] in GROUPS):  # hydra.*, hydra/*
            continue
        _check(override, path, chosen, recipes)


def _option(group: str, value, recipes: Path) -> str:
    options = group_options(recipes, group)
    if isinstance(value, str) and value in options:
        return value
    close = difflib.get_close_matches(str(value), options, n=1, cutoff=0.5)
    hint = f": did you mean {group}={close[0]}?" if close else "."
    raise ConfigError(
        f"{group}={value} is not a recipe option{hint} The {group} options are {', '.join(options)}."
    )


def _check(override, path: tuple[str, ...], chosen: dict[str, str], recipes: Path) -> None:
    name = ".".join(path)
    schema = recipe_schema(recipes)
    tree: dict | None = schema
    for depth, part in enumerate(path):
        if path[:depth] == TRANSFORMER_CONFIG:
            if part not in transformer_config_fields():
                raise unknown_key_error(path[: depth + 1], sorted(transformer_config_fields()))
            tree = None
            break
        if not isinstance(tree, dict) or part not in tree:
            known = sorted(tree) if isinstance(tree, dict) else []
            raise unknown_key_error(path[: depth + 1], known)
        tree = tree[part]
    if override.is_delete():
        if path[:2] == TRANSFORMER_CONFIG and len(path) == 3:
            return  # megatron-core's default then applies
        raise ConfigError(f"~{name} removes a key thdpack reads: set a value instead ({name}=...)")
    present = _present(path, chosen, recipes)
    if present and override.is_add() and not override.is_force_add():
        raise ConfigError(f"{name} is already in the recipe: set it without '+' ({name}=...)")
    if present or override.is_force_add():
        if not present and not _addable(path):
            raise _elsewhere(path, chosen, recipes)
        return
    if _addable(path):
        if override.is_add():
            return
        where = f"{path[0]}={chosen[path[0]]}" if path[0] in chosen else "the recipe"
        raise ConfigError(
            f"{name} is not set by {where}: add it with +{name}=..."
            + (" (a megatron.core TransformerConfig field)" if path[:2] == TRANSFORMER_CONFIG else "")
        )
    raise _elsewhere(path, chosen, recipes)


def _addable(path: tuple[str, ...]) -> bool:
    """A key that may be added with ``+``: a TransformerConfig field, or one thdpack reads with a default."""
    if path[:2] == TRANSFORMER_CONFIG and len(path) == 3:
        return True
    tree = OPTIONAL_KEYS
    for part in path:
        if not isinstance(tree, dict) or part not in tree:
            return False
        tree = tree[part]
    return True


def _elsewhere(path: tuple[str, ...], chosen: dict[str, str], recipes: Path) -> ConfigError:
    group, name = path[0], ".".join(path)
    owners = [
        o for o in group_options(recipes, group) if _in_tree(option_tree(str(recipes), group, o), path[1:])
    ]
    return ConfigError(
        f"{name} is not read with {group}={chosen.get(group)}: only with "
        + " or ".join(f"{group}={o}" for o in owners)
    )


def _present(path: tuple[str, ...], chosen: dict[str, str], recipes: Path) -> bool:
    if path[0] in GROUPS:
        return _in_tree(option_tree(str(recipes), path[0], chosen[path[0]]), path[1:])
    return _in_tree(_yaml(Path(recipes) / "train.yaml"), path)


def _in_tree(tree, path: Sequence[str]) -> bool:
    for part in path:
        if not isinstance(tree, dict) or part not in tree:
            return False
        tree = tree[part]
    return True


def default_options(recipes: Path) -> list[tuple[str, str]]:
    """``(group, option)`` of ``train.yaml``'s defaults list: what a run uses unless told otherwise."""
    out = []
    for entry in _yaml(Path(recipes) / "train.yaml").get("defaults", []):
        if isinstance(entry, dict):
            for group, option in entry.items():
                if group in GROUPS:
                    out.append((group, str(option)))
    return out


@cache
def option_tree(recipes: str, group: str, option: str) -> dict:
    """The keys of ``recipes/<group>/<option>.yaml`` with those of the options its defaults list names."""
    data = _yaml(Path(recipes) / group / f"{option}.yaml")
    tree: dict = {}
    for entry in data.get("defaults", []):
        if isinstance(entry, str) and entry != "_self_":
            _merge(tree, option_tree(recipes, group, entry))
    _merge(tree, {k: v for k, v in data.items() if k != "defaults"})
    return tree


def _merge(tree: dict, values: dict) -> None:
    for key, value in values.items():
        if isinstance(value, dict) and isinstance(tree.get(key), dict):
            _merge(tree[key], value)
        else:
            tree[key] = value


def _yaml(path: Path) -> dict:
    import yaml

    with open(path) as f:
        return yaml.safe_load(f) or {}
