"""benchmarks/scale_report.py: the four-GPU report's headline from the phases' ``scale.py`` reports. The ratios
compare thdpack's fastest layout with the fastest transformers configuration that finished at the same world size;
a target nothing measured says which runs were tried and how they ended."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import scale_report  # noqa: E402

VERSIONS = {
    "python": "3.12.3",
    "torch": "2.11.0",
    "transformers": "5.17.0",
    "liger-kernel": "0.8.5",
    "megatron-core": "0.16.1",
    "transformer-engine": "2.20.2",
}


def run(side, layout, status="ok", world=4, tok=None, loss=None):
    out = {"side": side, "layout": layout, "status": status, "world_size": world}
    if status == "ok":
        out |= {"real_tokens_per_s_per_gpu": tok, "peak_memory_gib_max": 60.0, "first_step_loss": loss}
    return out


def report(shape, mix, seq, runs, comparison=(), hf_samples=None, name="x"):
    return {
        "date": "2026-11-27T21:00:00",
        "tag": "h100",
        "device": "4x NVIDIA H100 80GB HBM3",
        "versions": VERSIONS,
        "setup": {"shape": shape, "mix": mix, "seq_length": seq, "hf_samples_per_step": hf_samples},
        "runs": runs,
        "comparison": list(comparison),
        "file": f"scale-{name}.json",
    }


@pytest.fixture
def reports():
    eight = report(
        "llama3_8b",
        "chat",
        8192,
        [
            run("thdpack", "tp2@8192", tok=9164.0, loss=12.576272),
            run("thdpack", "tp2+fp8@8192", tok=7615.0, loss=12.579081),
            run("hf", "fsdp2:noreshard@4096", status="out of memory"),
            run("hf", "fsdp2:noreshard:ac@8192", tok=6738.0, loss=12.576233),
            run("hf", "fsdp2:ac@16384", tok=6487.0, loss=12.576235),
        ],
        comparison=[{"first_step_loss_rel_diff": 3.1e-6}, {"first_step_loss_rel_diff": 2.3e-4}],
        name="8b",
    )
    moe = report(
        "qwen3_30b_a3b_l16",
        "chat",
        8192,
        [run("thdpack", "ep4@8192", status="out of memory"), run("hf", "fsdp2@8192", status="out of memory")],
        name="moe",
    )
    ctx_hf = report(
        "llama3_8b", "full", 131072, [run("hf", "fsdp2:ac", status="out of memory")], hf_samples=4, name="ctx"
    )
    ctx_ours = report(
        "llama3_8b", "full", 262144, [run("thdpack", "tp2cp2:fold+recompute", status="failed (1)")], name="c2"
    )
    return [eight, moe, ctx_hf, ctx_ours]


def test_the_8b_ratio_is_the_fastest_layout_over_the_fastest_peer_that_finished(reports):
    headline = scale_report.combine(reports)
    assert headline["per_gpu_speedup_8b"] == pytest.approx(9164 / 6738)
    assert headline["detail_8b"]["thdpack"] == "tp2@8192"
    assert headline["detail_8b"]["peer"] == "fsdp2:noreshard:ac@8192"
    assert headline["targets"]["per_gpu_speedup_8b"]["met"] is False  # 1.36 < 1.5


def test_targets_nothing_measured_say_which_runs_ended_how(reports):
    headline = scale_report.combine(reports)
    missing = headline["missing"]
    assert headline["per_gpu_speedup_moe"] is None
    assert missing["per_gpu_speedup_moe"] == (
        "qwen3_30b_a3b: thdpack runs ['out of memory'], transformers runs ['out of memory']"
    )
    assert missing["longest_sample_peer"] == (
        "no transformers run of the full-length mix finished (131,072 tokens out of memory)"
    )
    assert missing["longest_sample_thdpack"] == (
        "no thdpack run of the full-length mix finished (262,144 tokens failed (1))"
    )
    assert headline["targets"]["longest_sample_ratio"]["met"] is None


def test_first_step_loss_agreement_skips_the_runs_whose_sides_trained_different_batches(reports):
    reports[2]["comparison"] = [
        {"first_step_loss_rel_diff": 0.5}
    ]  # long context: the peer's own sample count
    assert scale_report.combine(reports)["max_first_step_loss_rel_diff"] == pytest.approx(2.3e-4)


def test_the_report_files_carry_device_versions_and_every_peer_configuration(reports, tmp_path):
    stem = scale_report.write(reports, tmp_path, notes="## Notes\n\nsaid here")
    assert stem.name == "scale_h100x4_2026-11-27"
    payload = json.loads(stem.with_suffix(".json").read_text())
    assert payload["devices"] == ["4x NVIDIA H100 80GB HBM3"]
    assert payload["versions"]["megatron-core"] == "0.16.1"
    assert [p["config"] for p in payload["headline"]["peer_configs"]] == [
        "fsdp2:noreshard@4096",
        "fsdp2:noreshard:ac@8192",
        "fsdp2:ac@16384",
        "fsdp2@8192",
        "fsdp2:ac",
    ]
    text = stem.with_suffix(".md").read_text()
    assert "| per_gpu_speedup_8b | 1.5 | 1.36 | no |" in text
    assert "| llama3_8b | full | 262144 | 4 | `tp2cp2:fold+recompute` | failed (1) | - | - |" in text
    assert text.rstrip().endswith("said here")
