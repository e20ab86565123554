"""`python -m thdpack.bench pack` runs end to end on a tiny case, without the network (peer disabled)."""

import json

import pytest
import torch

from thdpack import bench


def test_pack_bench_prints_table_and_writes_json(tmp_path, capsys, monkeypatch):
    # --no-peer must not download; an unreachable cache makes any attempt fail loudly.
    monkeypatch.setenv("THDPACK_BENCH_CACHE", str(tmp_path / "no-cache"))
    out = tmp_path / "pack.json"
    argv = ["pack", "--cases", "2x64,2x64-cp2", "--repeats", "1", "--warmup", "0", "--no-peer"]

    assert bench.main([*argv, "--json", str(out)]) == 0

    table = capsys.readouterr().out
    assert "thdpack ms" in table and "2x64-cp2" in table and "disabled (--no-peer)" in table
    assert not (tmp_path / "no-cache").exists()

    report = json.loads(out.read_text())
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


def test_cases_parse_batch_seq_and_cp():
    assert bench.parse_cases("8x8192,64x8192-cp2") == [bench.Case(8, 8192, 1), bench.Case(64, 8192, 2)]
    assert bench.Case(64, 8192, 2).name == "64x8192-cp2"


def test_lengths_are_seeded_and_within_the_row():
    a = bench.sample_lengths(256, 2048, seed=3)
    assert torch.equal(a, bench.sample_lengths(256, 2048, seed=3))
    assert a.min() >= 1 and a.max() <= 2048


def test_batch_is_right_padded_with_shifted_labels():
    batch = bench.make_batch(torch.tensor([3, 1]), 4, seed=0)
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]
    tokens = batch["tokens"]
    assert batch["labels"].tolist() == [
        [tokens[0, 1].item(), tokens[0, 2].item(), -100, -100],
        [-100, -100, -100, -100],
    ]
    assert batch["loss_mask"].tolist() == [[1, 1, 0, 0], [0, 0, 0, 0]]


@pytest.mark.parametrize("cp, multiple", [(1, 1), (2, 4), (4, 8)])
def test_bridge_pads_each_sample_to_twice_cp(cp, multiple):
    assert bench.bridge_pad_multiple(cp) == multiple


def test_timing_interleaves_the_packers_call_by_call():
    calls = []
    times = bench.time_ms(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeats=3, warmup=1, cuda=False
    )
    assert calls == ["a", "b"] * 4  # one warm-up round, then three timed rounds, A B A B ...
    assert [len(t) for t in times.values()] == [3, 3]
