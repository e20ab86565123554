"""The benchmarks' ``--smoke`` modes run whole on CPU (tiny shapes): what the GPU runs is exercised in CI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run(script: str, tmp_path: Path, *args: str) -> Path:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), "--smoke", "--out", str(tmp_path), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (result,) = tmp_path.glob("*.json")
    return result


@pytest.mark.cpu_only
def test_vs_hf_smoke_gives_the_same_first_step_loss_on_both_sides(tmp_path):
    payload = json.loads(_run("vs_hf.py", tmp_path, "--work", str(tmp_path / "work")).read_text())
    assert set(payload["headline"]) == {"speedup_vs_fastest_hf", "fastest_hf_config", "steady_state_syncs"}
    assert payload["headline"]["fastest_hf_config"] == "sdpa_bf16"
    # fp32 on CPU, the same weights and samples: the losses agree to rounding
    assert abs(payload["transformers"]["sdpa_bf16"]["first_step_loss_diff"]) < 1e-5


@pytest.mark.cpu_only
def test_output_loss_smoke_matches_megatrons_loss(tmp_path):
    payload = json.loads(_run("output_loss.py", tmp_path).read_text())
    (row,) = payload["results"].values()
    assert row["chunked_eager_24"]["loss_rel_diff"] < 1e-6
