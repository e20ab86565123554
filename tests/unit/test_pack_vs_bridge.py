"""benchmarks/pack_vs_bridge.py runs end to end offline: without the peer, and with a Bridge packer read from a
path (a stand-in source tree and wheel written here); it never reaches the network."""

import importlib.util
import json
import sys
import zipfile
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "pack_vs_bridge.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("pack_vs_bridge", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["pack_vs_bridge"] = module  # dataclasses look their module up by name
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules["pack_vs_bridge"]


# A stand-in for Bridge's in_batch.py with its real shape: the one stubbed import, torch only, and the packer's
# signature. It packs like thdpack on right-padded rows, so the benchmark's same-row check passes.
FAKE_BRIDGE = """
from __future__ import annotations

import torch
from megatron.bridge.data.datasets.utils import IGNORE_INDEX


def pack_right_padded_sequence_batch_to_mcore_thd(batch, pad_token_id, ignore_index, pad_to_multiple_of):
    lengths = batch["attention_mask"].sum(1)
    m = pad_to_multiple_of
    padded = (lengths + m - 1) // m * m
    rows = []
    for key, fill in (("tokens", pad_token_id), ("labels", IGNORE_INDEX), ("loss_mask", 0), ("position_ids", 0)):
        parts = []
        for b in range(len(lengths)):
            real = batch[key][b, : int(lengths[b])]
            pad = torch.full((int(padded[b] - lengths[b]),), fill, dtype=real.dtype)
            if key == "position_ids":
                pad = torch.arange(int(lengths[b]), int(padded[b]))
            parts.append(torch.cat([real, pad]))
        batch[key] = torch.cat(parts)[None]
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).int()])
    cu_padded = torch.cat([torch.zeros(1, dtype=torch.int32), padded.cumsum(0).int()])
    batch["cu_seqlens_q"] = cu
    if m > 1:
        batch["cu_seqlens_q_padded"] = cu_padded
    batch["max_seqlen_q"] = padded.max()
    batch["total_tokens"] = int(cu_padded[-1])
"""


def run(bench, tmp_path, capsys, *extra):
    out = tmp_path / "pack.json"
    argv = ["--cases", "2x64,2x64-cp2", "--repeats", "1", "--warmup", "0", *extra, "--json", str(out)]
    assert bench.main(argv) == 0
    return capsys.readouterr().out, json.loads(out.read_text())


def test_without_the_peer_prints_table_and_writes_json(bench, tmp_path, capsys):
    table, report = run(bench, tmp_path, capsys, "--no-peer")
    assert "thdpack ms" in table and "2x64-cp2" in table and "disabled (--no-peer)" in table
    assert report["benchmark"] == "pack"
    for key in ("torch", "device_name", "date", "python", "cpu_count"):
        assert report["meta"][key]
    assert [r["case"] for r in report["results"]] == ["2x64", "2x64-cp2"]
    for row in report["results"]:
        assert row["device"] == "cpu"
        assert row["thdpack_ms"] > 0
        assert row["thdpack_pad_overhead"] >= 1
        assert row["bshd_pad_overhead"] >= row["thdpack_pad_overhead"]
        assert row["bridge_ms"] is None and row["ratio"] is None


@pytest.mark.parametrize("form", ["source tree", "unzipped wheel", "wheel"])
def test_the_peer_is_read_from_a_path_and_compared(bench, tmp_path, capsys, form):
    if form == "wheel":
        path = tmp_path / "megatron_bridge-0.0-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as zf:
            zf.writestr(bench.BRIDGE_MODULE, FAKE_BRIDGE)
    else:
        path = tmp_path / "bridge"
        module = path / ("src" if form == "source tree" else "") / bench.BRIDGE_MODULE
        module.parent.mkdir(parents=True)
        module.write_text(FAKE_BRIDGE)
    table, report = run(bench, tmp_path, capsys, "--bridge", str(path))
    assert "megatron-bridge pack_right_padded_sequence_batch_to_mcore_thd from" in table
    for row in report["results"]:
        assert row["bridge_ms"] > 0 and row["ratio"] > 0
        assert row["outputs_match"], row["mismatched_fields"]


def test_a_path_without_the_packer_drops_the_peer_with_the_reason(bench, tmp_path, capsys):
    table, report = run(bench, tmp_path, capsys, "--bridge", str(tmp_path))
    assert "skipped: RuntimeError" in table and "holds neither" in table
    assert all(row["bridge_ms"] is None for row in report["results"])


def test_a_packer_with_other_imports_is_refused(bench, tmp_path):
    module = tmp_path / bench.BRIDGE_MODULE
    module.parent.mkdir(parents=True)
    module.write_text(FAKE_BRIDGE.replace("import torch\n", "import torch\nimport os\n"))
    with pytest.raises(RuntimeError, match="only torch and the stdlib"):
        bench.load_bridge_packer(tmp_path)


def test_cases_parse_batch_seq_and_cp(bench):
    assert bench.parse_cases("8x8192,64x8192-cp2") == [bench.Case(8, 8192, 1), bench.Case(64, 8192, 2)]
    assert bench.Case(64, 8192, 2).name == "64x8192-cp2"


def test_lengths_are_seeded_and_within_the_row(bench):
    a = bench.sample_lengths(256, 2048, seed=3)
    assert torch.equal(a, bench.sample_lengths(256, 2048, seed=3))
    assert a.min() >= 1 and a.max() <= 2048


def test_batch_is_right_padded_with_shifted_labels(bench):
    batch = bench.make_batch(torch.tensor([3, 1]), 4, seed=0)
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]
    tokens = batch["tokens"]
    assert batch["labels"].tolist() == [
        [tokens[0, 1].item(), tokens[0, 2].item(), -100, -100],
        [-100, -100, -100, -100],
    ]
    assert batch["loss_mask"].tolist() == [[1, 1, 0, 0], [0, 0, 0, 0]]


@pytest.mark.parametrize("cp, multiple", [(1, 1), (2, 4), (4, 8)])
def test_bridge_pads_each_sample_to_twice_cp(bench, cp, multiple):
    assert bench.bridge_pad_multiple(cp) == multiple


def test_timing_interleaves_the_packers_call_by_call(bench):
    calls = []
    times = bench.time_ms(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeats=3, warmup=1, cuda=False
    )
    assert calls == ["a", "b"] * 4  # one warm-up round, then three timed rounds, A B A B ...
    assert [len(t) for t in times.values()] == [3, 3]
