"""Gemma 3 and gpt-oss from a Hugging Face directory through thdpack's training loop and back (CPU, fp32, torch
attention): benchmarks/hf_finetune.py's tiny shapes (a sliding and a global layer each; gpt-oss's sinks, YaRN and
experts) set up with ``model=hf model.pretrained=DIR`` by the loop's own ``setup_run``, the first step's loss and
packed logits against transformers on the same padded micro-batches, two training steps, a checkpoint, and
``python -m thdpack.export``: the export is the trained weights bit for bit and transformers loads it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.functional, pytest.mark.cpu_only]

REPO = Path(__file__).resolve().parents[2]
MODELS = {"gemma3_tiny": "Gemma3ForCausalLM", "gpt_oss_tiny": "GptOssForCausalLM"}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("finetune")
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "2"}
    command = [
        sys.executable, str(REPO / "benchmarks" / "hf_finetune.py"), "--shapes", "tiny", "--models", ",".join(MODELS),
        "--steps", "2", "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--out", str(out / "report"), "--work", str(out / "work"),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    (path,) = (out / "report").glob("hf_finetune_*.json")
    return {m["model"]: m for m in json.loads(path.read_text())["models"]}


@pytest.mark.parametrize("model", MODELS)
def test_the_first_step_and_packed_logits_are_transformers(report, model):
    run = report[model]
    assert abs(run["first_step_loss"]["relative_difference"]) < 1e-6
    assert run["first_micro_batch_logits"]["max_abs_diff"] < 1e-5


@pytest.mark.parametrize("model", MODELS)
def test_the_trained_model_exports_bit_for_bit_and_transformers_loads_it(report, model):
    export = report[model]["export"]
    assert export["bitwise_equal_to_trained_weights"] and export["loaded_by_transformers_as"] == MODELS[model]
    assert 0 < export["max_abs_change_from_imported"] < 1e-3  # two steps moved the imported weights
