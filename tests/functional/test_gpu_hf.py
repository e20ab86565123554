"""GPU: Hugging Face models imported and fine-tuned packed with Transformer Engine in bf16 give transformers' first
loss (within 0.5%) and export bit for bit; a short run of benchmarks/hf_finetune.py on tiny shapes (the full
shapes: ``python benchmarks/hf_finetune.py --out benchmarks/results``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from .gpu import WITH_TE

pytestmark = WITH_TE

REPO = Path(__file__).resolve().parents[2]


def test_tiny_llama3_and_qwen3_moe_fine_tune_from_transformers_loss_and_export_bitwise(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    command = [
        sys.executable, str(REPO / "benchmarks" / "hf_finetune.py"), "--shapes", "tiny",
        "--models", "llama3_tiny,qwen3_moe_tiny", "--steps", "3",
        "--seq-length", "512", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    (report,) = (tmp_path / "out").glob("hf_finetune_*.json")
    for model in json.loads(report.read_text())["models"]:
        assert abs(model["first_step_loss"]["relative_difference"]) < 5e-3, model["model"]
        assert model["export"]["bitwise_equal_to_trained_weights"], model["model"]
