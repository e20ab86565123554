"""GPU: a Qwen2.5-VL and a Qwen3-VL directory made on the host fine-tune packed with Transformer Engine in bf16;
the first step's loss is within 0.5% of transformers' (bf16) on the same batch and weights; packed and padded runs
on the same image chat length mix (benchmarks/vlm_gpu.py, which writes the JSON/MD report)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .gpu import WITH_TE

pytestmark = WITH_TE

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_vlm_first_step_loss_within_half_a_percent_of_transformers(tmp_path, family):
    command = [
        sys.executable,
        str(ROOT / "benchmarks" / "vlm_gpu.py"),
        "--out",
        str(tmp_path),
        "--steps",
        "6",
        "--family",
        family,
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    (report,) = tmp_path.glob("vlm_gpu_*.json")
    loss = json.loads(report.read_text())["first_step_loss"]
    print(loss)
    assert loss["relative_difference_same_precision"] <= 0.005
