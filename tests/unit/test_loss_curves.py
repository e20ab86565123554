"""benchmarks/loss_curves.py's comparison: what it reports for each variant against the baseline."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "loss_curves", Path(__file__).resolve().parents[2] / "benchmarks" / "loss_curves.py"
)
loss_curves = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(loss_curves)


def _run(losses, skipped=()):
    records = [
        {"step": i + 1, "loss": x, "real_tokens": 100, "step_time_s": 0.5, "skipped": i + 1 in skipped}
        for i, x in enumerate(losses)
    ]
    return {"records": records, "summary": {"peak_memory_gib": 3.0}}


def test_window_mean_difference_and_largest_step_difference_against_the_baseline():
    base = [10.0, 8.0, 6.0, 4.0, 2.0, 2.0]
    other = [10.0, 8.5, 6.0, 4.3, 2.2, 2.2]
    out = loss_curves.compare(
        {"bf16": _run(base), "fp8": _run(other, skipped=(2,))}, 2, {"bf16": 0, "fp8": 0}
    )
    assert out["bf16"]["final_window_rel_diff_vs_baseline"] == 0.0
    assert out["fp8"]["final_window_mean_loss"] == pytest.approx(2.2)
    assert out["fp8"]["final_window_rel_diff_vs_baseline"] == pytest.approx(0.1)
    # steps after the first window (3..6): the step-1/2 difference of 0.5 does not count
    assert out["fp8"]["max_abs_step_diff_after_window"] == pytest.approx(0.3)
    assert out["fp8"]["skipped_updates"] == 1
    assert out["fp8"]["real_tokens_per_s"] == pytest.approx(200.0)


def test_a_variant_whose_process_failed_is_failed_whatever_it_logged():
    out = loss_curves.compare(
        {"bf16": _run([3.0, 2.0, 1.0]), "precision_aware": _run([3.0, 2.5])},
        1,
        {"bf16": 0, "precision_aware": 1},
    )
    assert out["precision_aware"] == {"status": "failed (exit 1)", "steps": 2}
    assert out["bf16"]["status"] == "ok"
