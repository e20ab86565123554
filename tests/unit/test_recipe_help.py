"""``--help`` of ``python -m thdpack.train`` and ``python -m thdpack.compare``: the recipe groups, options and keys
with the recipe files' comments; and compare's picture (thdpack.training.metrics.comparison_figure)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from thdpack.training import compare
from thdpack.training.metrics import comparison_figure
from thdpack.training.recipe_help import recipe_groups_help, recipe_help
from thdpack.training.recipe_keys import OPTIONAL_KEYS, recipe_schema, recipes_dir

ROOT = Path(__file__).resolve().parents[2]


def leaves(tree: dict, path=()):
    for key, sub in tree.items():
        if isinstance(sub, dict) and sub:
            yield from leaves(sub, (*path, key))
        else:
            yield (*path, key)


def test_help_lists_every_option_of_every_group_with_its_header_comment():
    text = recipe_help()
    assert (
        "model=tiny_gpt | hf | llama3_1b | llama3_8b | qwen2_5_vl_7b | qwen3_30b_a3b | tiny_moe | tiny_mrope"
        in text
    )
    assert "  tp2      Tensor parallel 2 with sequence parallelism." in text
    assert "  cp2      sets context_parallel_size: 2" in text  # a file whose header is only its name


def test_help_shows_each_key_with_the_comment_of_its_recipe_file():
    text = recipe_help()
    assert "    lr_decay_style: cosine   # constant | linear | cosine | inverse-square-root\n" in text
    assert (
        "                               # null = micro_batch_size samples per micro-batch, as padded\n"
        in text
    )
    assert "  added by dataset=synthetic:\n    synthetic:\n      num_samples: 100000\n" in text


def test_help_names_every_key_of_the_shipped_recipe_files():
    text = recipe_help()
    optional = set(leaves(OPTIONAL_KEYS))
    for path in leaves(recipe_schema(recipes_dir())):
        if path not in optional:
            assert f" {path[-1]}:" in text, ".".join(path)


def run_help(module: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", module, "--help"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=300,
    )
    return done.stdout


def test_train_help_prints_the_recipe_help_instead_of_hydras_generic_text():
    assert run_help("thdpack.train") == recipe_help() + "\n"


def test_compare_help_lists_its_options_and_the_recipe_groups(capsys):
    with pytest.raises(SystemExit):
        compare.main(["--help"])
    text = capsys.readouterr().out
    assert text.startswith("usage: python -m thdpack.compare [--out DIR] [--nproc N] [group=option ...]")
    assert "--nproc NPROC" in text and recipe_groups_help() in text


def records(losses, rates):
    return [
        {"step": i, "loss": loss, "real_tokens_per_s": r}
        for i, (loss, r) in enumerate(zip(losses, rates, strict=True), 1)
    ]


def test_compare_picture_draws_the_packed_loss_dashed_over_the_padded_one():
    fig = comparison_figure(
        records([3.0, 2.5, 2.2], [40, 41, 42]), records([3.0, 2.5, 2.2], [30, 31, 30]), 1.37
    )
    padded, packed = fig.axes[0].get_lines()
    assert packed.get_label() == "packed" and packed.get_linestyle() == "--" and packed.get_marker() == "o"
    assert packed.get_zorder() > padded.get_zorder()


def test_compare_picture_writes_the_speedup_and_plots_the_loss_difference():
    fig = comparison_figure(records([3.0, 2.5], [40, 41]), records([3.0, 2.4], [30, 31]), 1.37)
    assert (
        fig.axes[2].get_title() == "real tokens/s: packed 1.37x padded\n(mean over the steps after the first)"
    )
    (diff,) = [line for line in fig.axes[1].get_lines() if line.get_marker() == "o"]
    assert [round(y, 6) for y in diff.get_ydata()] == [0.0, 0.1]


def test_compare_picture_has_integer_step_ticks():
    fig = comparison_figure(
        records([3.0, 2.5, 2.2], [40, 41, 42]), records([3.0, 2.5, 2.2], [30, 31, 30]), 1.2
    )
    fig.canvas.draw()
    for ax in fig.axes:
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks)
