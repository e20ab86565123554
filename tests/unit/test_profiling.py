"""thdpack.training.profiling: ``trainer.profile_step`` writes the step's split and its costliest operators."""

from __future__ import annotations

import torch

from thdpack.training.profiling import profile


def test_a_profiled_cpu_step_writes_its_split_and_the_operators_by_host_time(tmp_path):
    with profile(enabled=True, device="cpu") as step:
        a = torch.randn(256, 256)
        for _ in range(3):
            a = torch.tanh(a @ a)
    summary = step.summary(tmp_path)
    assert summary["profile_wall_s"] > 0
    assert summary["profile_host_operator_s"] > 0
    assert summary["profile_device_busy_s"] == 0 and summary["profile_syncs"] == 0
    text = (tmp_path / "profile_step.txt").read_text()
    assert text.startswith("wall ")
    assert "operators by host time:" in text and "aten::mm" in text
    assert "operators by device time:" not in text  # no GPU work: no device table


def test_a_disabled_profile_records_nothing():
    with profile(enabled=False, device="cpu") as step:
        torch.ones(2).sum()
    assert step is None


def test_busy_time_counts_overlapping_work_once_and_names_the_gaps():
    from thdpack.training.profiling import busy_and_gaps

    # two streams overlapping from 5 to 10, idle from 12 to 20, a span inside another at 21-22
    busy, gaps = busy_and_gaps([(0.0, 10.0), (5.0, 12.0), (20.0, 30.0), (21.0, 22.0)])
    assert busy == 22.0
    assert gaps == [(12.0, 20.0, 2)]
    assert busy_and_gaps([]) == (0.0, [])
