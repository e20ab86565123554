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
def test_lora_vs_peft_smoke_starts_both_sides_from_the_same_loss(tmp_path):
    payload = json.loads(_run("lora_vs_peft.py", tmp_path, "--work", str(tmp_path / "work")).read_text())
    assert payload["headline"]["fastest_peft_config"] in ("sdpa", "sdpa_gc")
    assert payload["headline"]["speedup_vs_fastest_peft"] > 0
    assert payload["versions"]["peft"]
    # B starts at zero on both sides: the first step's loss is the base model's, to rounding (fp32, CPU); with
    # gradient checkpointing too (it recomputes, the loss is the same)
    assert abs(payload["peft"]["sdpa"]["first_step_loss_diff"]) < 1e-5
    assert abs(payload["peft"]["sdpa_gc"]["first_step_loss_diff"]) < 1e-5


def test_a_misspelt_peft_configuration_is_named():
    sys.path.insert(0, str(REPO / "benchmarks"))
    from lora_vs_peft import parse_peer

    assert parse_peer("varlen_liger_gc") == ("varlen", True, True)
    assert parse_peer("sdpa") == ("sdpa", False, False)
    with pytest.raises(ValueError, match="'varlen_ligre'"):
        parse_peer("varlen_ligre")


@pytest.mark.cpu_only
def test_output_loss_smoke_matches_megatrons_loss(tmp_path):
    payload = json.loads(_run("output_loss.py", tmp_path).read_text())
    (row,) = payload["results"].values()
    assert row["chunked_eager_24"]["loss_rel_diff"] < 1e-6


def test_step_gaps_attributes_each_idle_gap_to_the_host_operator_spanning_its_start():
    sys.path.insert(0, str(REPO / "benchmarks"))
    from step_gaps import analyse

    def gpu(ts, dur, correlation):
        return {
            "cat": "kernel",
            "name": f"k{correlation}",
            "ts": ts,
            "dur": dur,
            "args": {"correlation": correlation},
        }

    events = [
        gpu(0, 100, 1), gpu(50, 100, 2),  # overlapping: busy 0-150 once
        gpu(200, 100, 3),  # a 50 us gap from 150, while the host was in aten::mm (inside the longer outer op)
        gpu(305, 95, 4),  # a 5 us gap: counted as idle, too short to attribute
        gpu(1400, 100, 5),  # a 1000 us gap from 400, the host outside every operator
        {"cat": "cpu_op", "name": "outer", "ts": 0, "dur": 300, "tid": 1},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 140, "dur": 20, "tid": 1},
        {"cat": "cpu_op", "name": "other thread", "ts": 100, "dur": 100, "tid": 2},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 1390, "dur": 3, "args": {"correlation": 5}},
    ]  # fmt: skip
    a = analyse(events)
    assert (a["gpu_span_ms"], a["gpu_busy_ms"], a["idle_ms"], a["gaps"]) == (1.5, 0.445, 1.055, 3)
    assert a["idle_by_host_op_ms"] == {"(no op)": 1.0, "aten::mm": 0.05}
    assert a["idle_in_gaps_under_10us_ms"] == 0.005
    first = a["largest_gaps"][0]
    assert (first["next"], first["launched_by"], first["launch_after_us"]) == ("k5", "cudaLaunchKernel", 990)
    assert a["host_runtime_calls"] == {"cudaLaunchKernel": {"ms": 0.003, "calls": 1}}


@pytest.mark.cpu_only
def test_step_gaps_smoke_runs_whole_on_cpu(tmp_path):
    payload = json.loads(_run("step_gaps.py", tmp_path).read_text())
    assert payload["setup"]["model"] == "tiny_gpt" and payload["wall_ms"] > 0
    assert payload["analysis"]["gpu_busy_ms"] == 0.0  # no GPU: nothing ran there
