"""benchmarks/e2e.py: the command line's overrides reach every run, and none silently changes a batching mode."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "e2e", Path(__file__).resolve().parents[2] / "benchmarks" / "e2e.py"
)
e2e = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(e2e)


def test_extra_overrides_come_after_the_mode_and_win():
    overrides = e2e.run_overrides(["model=llama3_1b"], "chat", "packed_budget", "auto", ["trainer.lr=3e-4"])
    assert overrides[-1] == "trainer.lr=3e-4"
    assert "dataset.micro_batch_tokens=auto" in overrides


def test_the_budget_option_sets_packed_budgets_token_budget():
    overrides = e2e.run_overrides([], "chat", "packed_budget", "32768", [])
    assert "dataset.micro_batch_tokens=32768" in overrides
    assert not any(o.startswith("dataset.micro_batch_tokens=auto") for o in overrides)


@pytest.mark.parametrize("extra", ["dataset.micro_batch_tokens=65536", "dataset.pad_to=longest"])
def test_an_extra_override_of_a_modes_key_is_refused_not_silently_replaced(extra):
    with pytest.raises(SystemExit, match="give the packed_budget token budget with --budget"):
        e2e.run_overrides([], "chat", "packed_budget", "auto", [extra])
