"""L1: ``benchmarks/scale.py --smoke``: thdpack and transformers + FSDP2 on the tiny shape, 1 and 2 ranks over
gloo (fp32), the same weights and the same global batches; the report holds both sides at both world sizes.

First-step losses: measured on CPU (torch 2.13, transformers 5.24), the two sides agree to 4.8e-7 at one rank
and exactly at two (the same global per-token mean, summed in another order); the steps after agree as closely
(the same AdamW settings). The tolerance below is 10x the measured difference.
"""

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.functional, pytest.mark.cpu_only]

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "scale.py"
LOSS_TOLERANCE = 5e-6
# the Qwen3-MoE copy's logits against transformers': 3.6e-7 measured (largest logit 0.91), bound 10x that
LOGITS_TOLERANCE = 4e-6


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("scale_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tmp = tmp_path_factory.mktemp("scale")
    stem = module.main(["--smoke", "--work", str(tmp / "work"), "--out", str(tmp / "out")])
    sys.path.remove(str(SCRIPT.parent))
    return json.loads(stem.with_suffix(".json").read_text()), stem


def test_both_sides_run_at_one_and_two_ranks(report):
    payload, _ = report
    ran = sorted((r["side"], r["world_size"], r["status"]) for r in payload["runs"])
    assert ran == [("hf", 1, "ok"), ("hf", 2, "ok"), ("thdpack", 1, "ok"), ("thdpack", 2, "ok")]


def test_first_step_losses_agree(report):
    payload, _ = report
    rows = payload["comparison"]
    assert [r["world_size"] for r in rows] == [1, 2]
    for row in rows:
        assert abs(row["first_step_loss_diff"]) <= LOSS_TOLERANCE, row


def test_both_sides_train_on_the_same_real_tokens(report):
    payload, _ = report
    for world in (1, 2):
        tokens = [[s["real_tokens"] for s in r["steps"]] for r in payload["runs"] if r["world_size"] == world]
        assert tokens[0] == tokens[1] and min(tokens[0]) > 0


def test_each_run_reports_throughput_memory_and_scaling(report):
    payload, _ = report
    for run in payload["runs"]:
        assert run["real_tokens_per_s_per_gpu"] > 0
        assert run["steps_measured"] == payload["setup"]["steps"] - payload["setup"]["warmup"]
        assert len(run["peak_rss_gib"]) == run["world_size"]
        assert run["scaling_base_world_size"] == 1
        assert math.isfinite(run["scaling_efficiency"])
    assert {r["scaling_efficiency"] for r in payload["runs"] if r["world_size"] == 1} == {1.0}


def test_report_names_device_versions_date_and_liger_on_cpu(report):
    payload, stem = report
    assert payload["tag"] == "cpu" and payload["device"]
    assert payload["versions"]["torch"] and payload["versions"]["transformers"]
    assert stem.name == f"scale_cpu_{payload['date'][:10]}"
    assert stem.with_suffix(".md").is_file()
    hf = [r for r in payload["runs"] if r["side"] == "hf"]
    assert all(r["liger"].startswith("not applied") for r in hf)


def test_moe_copy_computes_transformers_logits():
    """The Qwen3-MoE by-name copy (experts, router, QK norms) gives transformers' logits on the same
    directory."""
    from .training import environment

    script = Path(__file__).parent / "scripts" / "scale_moe_vs_hf.py"
    done = subprocess.run(
        [sys.executable, str(script)],
        env=environment({"HF_HUB_OFFLINE": "1"}),
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["max_abs_diff"] <= LOGITS_TOLERANCE, result
