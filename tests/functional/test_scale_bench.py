"""L1: ``benchmarks/scale.py --smoke``: thdpack (importing the directory with ``model=hf``) and transformers +
FSDP2 on the tiny shape, 2 ranks over gloo (fp32), the same weights and the same global batches.

Two ranks run each side's step as one rank does plus the data-parallel split and the global reductions; the
driver's bookkeeping across world sizes (scaling efficiency, the comparison rows) is tests/unit/test_scale_bench.py.

Losses: measured on CPU (torch 2.13, transformers 5.24), the two sides agree exactly at two ranks on the first
step (the same global per-token mean) and to 4.8e-7 on the second (after the same AdamW update); at one rank
(``--world-sizes 1``) each step differs by 4.8e-7 (sums in another order). The tolerance is 10x that.
"""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.functional, pytest.mark.cpu_only]

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "scale.py"
LOSS_TOLERANCE = 5e-6


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("scale_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tmp = tmp_path_factory.mktemp("scale")
    stem = module.main(["--smoke", "--work", str(tmp / "work"), "--out", str(tmp / "out")])
    sys.path.remove(str(SCRIPT.parent))
    return json.loads(stem.with_suffix(".json").read_text()), stem


def test_both_sides_run_on_two_ranks(report):
    payload, _ = report
    assert sorted((r["side"], r["world_size"], r["status"]) for r in payload["runs"]) == [
        ("hf", 2, "ok"),
        ("thdpack", 2, "ok"),
    ]


def test_thdpack_side_imports_the_directory_with_model_hf(report):
    payload, _ = report
    (ours,) = [r for r in payload["runs"] if r["side"] == "thdpack"]
    assert ours["weights"].startswith("model=hf model.pretrained")


def test_first_step_losses_agree(report):
    payload, _ = report
    (row,) = payload["comparison"]
    assert abs(row["first_step_loss_diff"]) <= LOSS_TOLERANCE, row


def test_second_step_losses_agree_after_the_same_update(report):
    payload, _ = report
    ours, hf = ([r for r in payload["runs"] if r["side"] == side][0] for side in ("thdpack", "hf"))
    assert abs(ours["losses"][1] - hf["losses"][1]) <= LOSS_TOLERANCE, (ours["losses"], hf["losses"])


def test_both_sides_train_on_the_same_real_tokens(report):
    payload, _ = report
    tokens = [[s["real_tokens"] for s in r["steps"]] for r in payload["runs"]]
    assert tokens[0] == tokens[1] and min(tokens[0]) > 0


def test_each_run_reports_throughput_and_memory_of_every_rank(report):
    payload, _ = report
    for run in payload["runs"]:
        assert run["real_tokens_per_s_per_gpu"] > 0
        assert run["steps_measured"] == payload["setup"]["steps"] - payload["setup"]["warmup"]
        assert len(run["peak_rss_gib"]) == run["world_size"] == 2


def test_report_names_device_versions_date_and_liger_on_cpu(report):
    payload, stem = report
    assert payload["tag"] == "cpu" and payload["device"]
    assert payload["versions"]["torch"] and payload["versions"]["transformers"]
    assert stem.name == f"scale_cpu_{payload['date'][:10]}"
    assert stem.with_suffix(".md").is_file()
    (hf,) = [r for r in payload["runs"] if r["side"] == "hf"]
    assert hf["liger"].startswith("not applied")
