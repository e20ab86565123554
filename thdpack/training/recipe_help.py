"""``--help`` of ``python -m thdpack.train`` and ``python -m thdpack.compare``: the recipe groups, their options and
keys, with the comments the recipe files carry (read from ``recipes/`` itself, so the help never drifts).

``train.yaml`` sets Hydra's ``hydra.help.template`` to ``${thdpack_recipe_help:}``, the resolver registered here.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

from omegaconf import OmegaConf

from .recipe_keys import GROUPS, group_options, recipes_dir

__all__ = ["recipe_groups_help", "recipe_help"]

_KEY = re.compile(r"^(\s*)([A-Za-z_][\w]*):(.*)$")
_DEFAULTS = {
    "model": "tiny_gpt",
    "dataset": "embedded",
    "parallel": "default",
    "trainer": "default",
    "peft": "none",
}


def recipe_help(recipes: Path | None = None) -> str:
    """``python -m thdpack.train --help``: what the command does, then :func:`recipe_groups_help`."""
    return "\n".join(
        [
            "python -m thdpack.train [group=option ...] [key=value ...]",
            "",
            "Train a Megatron-core GPT from a Hydra recipe: one option of each group (a file in recipes/<group>/),",
            "then any key as group.key=value.",
            "",
            recipe_groups_help(recipes),
        ]
    )


def recipe_groups_help(recipes: Path | None = None) -> str:
    """Each group's options (with each file's header comment), the default option's keys with their comments,
    the keys that other options add; then ``train.yaml``'s own keys and how to override."""
    recipes = recipes or recipes_dir()
    defaults = _default_options(recipes)
    out = ["Groups, their options (default first), and their keys with their comments:"]
    for group in GROUPS:
        default = defaults[group]
        options = [default] + [o for o in group_options(recipes, group) if o != default]
        out += ["", f"{group}={' | '.join(options)}"]
        width = max(map(len, options))
        for option in options:
            out += textwrap.wrap(
                _summary(recipes / group / f"{option}.yaml"),
                width=110,
                initial_indent=f"  {option:<{width}}  ",
                subsequent_indent=" " * (width + 4),
            )
        default_lines = _key_lines(recipes / group / f"{default}.yaml")
        out += ["", f"  {group} keys ({group}={default}):"]
        out += [f"    {line}" for _, line in default_lines]
        known = {path for path, _ in default_lines}
        for option in options[1:]:
            added = [
                (p, line) for p, line in _key_lines(recipes / group / f"{option}.yaml") if p not in known
            ]
            if added:
                out.append(f"  added by {group}={option}:")
                out += [f"    {line}" for _, line in added]
                known.update(p for p, _ in added)
    own = [line for path, line in _key_lines(recipes / "train.yaml") if path[0] != "hydra"]
    out += ["", "train.yaml:"] + [f"    {line}" for line in own]
    out += [
        "",
        "Overrides: group=option picks a file (model=tiny_moe); key=value sets a key (trainer.lr=3e-4); +key=value",
        "adds a key no recipe file sets (refused unless thdpack reads it: the closest known key is named); ~key",
        "removes one. --cfg job prints the resolved recipe; --hydra-help Hydra's own options.",
    ]
    return "\n".join(out) + "\n"


def _default_options(recipes: Path) -> dict[str, str]:
    """Each group's default option, from ``train.yaml``'s defaults list."""
    found = dict(_DEFAULTS)
    for entry in OmegaConf.load(recipes / "train.yaml").get("defaults", []):
        if isinstance(entry, dict) or OmegaConf.is_dict(entry):
            for key, value in entry.items():
                if key in found:
                    found[key] = str(value)
    return found


def _summary(path: Path) -> str:
    """The file's header comment; for a file whose header is only its name, the keys it sets."""
    header = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line.lstrip("#").strip())
    text = " ".join(header)
    if text in ("", path.stem):
        text = "sets " + ", ".join(line.strip() for _, line in _key_lines(path))
    return text


def _key_lines(path: Path) -> list[tuple[tuple[str, ...], str]]:
    """``(key path, text)`` for each key line of a recipe file (its comment-only continuation lines joined to it),
    indented as in the file; the ``defaults`` list and the file's header comment left out."""
    out: list[tuple[tuple[str, ...], str]] = []
    stack: list[tuple[int, str]] = []
    in_defaults = False
    for line in path.read_text().splitlines():
        match = _KEY.match(line)
        if match:
            indent, key = len(match.group(1)), match.group(2)
            while stack and stack[-1][0] >= indent:
                stack.pop()
            stack.append((indent, key))
            in_defaults = stack[0][1] == "defaults"
            if not in_defaults:
                out.append((tuple(k for _, k in stack), line.rstrip()))
        elif line.lstrip().startswith("#") and line.startswith(" ") and out and not in_defaults:
            out.append((out[-1][0], line.rstrip()))  # a comment that continues the key line above
    return out


OmegaConf.register_new_resolver(
    "thdpack_recipe_help", lambda: recipe_help().replace("$", "$$"), use_cache=True, replace=True
)
