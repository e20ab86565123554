"""L1: thdpack's packed Qwen2.5-VL, Qwen3-VL (DeepStack included) and Qwen3-VL-MoE equal transformers per sample
under context parallelism (the vision tower on every CP rank, image embeddings scattered into each rank's zigzag
shard), tensor parallelism with sequence parallelism (scattered before the sequence split) and, for the MoE family,
expert parallelism (half the experts on each rank, alone or over the CP ranks) and, for the dense families, pipeline
parallelism (the vision tower and DeepStack layers on the first stage); MRoPE ids of every shard equal
get_rope_index's."""

from __future__ import annotations

import pytest

from tests.vlm_models import build_tiny_vl

from .conftest import run_torchrun

pytestmark = pytest.mark.functional

CASES = [
    *((family, layout) for family in ("qwen2_5_vl", "qwen3_vl") for layout in ("cp2", "tp2_sp", "pp2")),
    *(("qwen3_vl_moe", layout) for layout in ("ep2", "ep2_cp2", "tp2_sp")),
]


@pytest.fixture(scope="module")
def directories(tmp_path_factory):
    """``family -> a tiny directory``, each built once for the module."""
    return {family: build_tiny_vl(tmp_path_factory.mktemp("vl"), family=family) for family in dict(CASES)}


@pytest.fixture(scope="module")
def output(directories):
    """The output of one launch that runs every case, one after another."""
    args = []
    for family, directory in directories.items():
        layouts = [layout for f, layout in CASES if f == family]
        args += ["+", "--layout", *layouts, "--directory", str(directory)]
    return run_torchrun("vlm_parity.py", nproc=2, args=args[1:], timeout=600, check=False)


@pytest.mark.parametrize("family, layout", CASES, ids=[f"{f}-{layout}" for f, layout in CASES])
def test_vlm_logits_and_loss_equal_transformers(output, directories, family, layout):
    line = next(
        (line for line in output.splitlines() if f"VLM PARITY OK {layout} {directories[family]} " in line), ""
    )
    print(line)
    assert f"VLM PARITY OK {layout}" in line, "\n".join(output.splitlines()[-60:])
    if layout == "pp2":  # tiny Qwen3-VL: DeepStack after layers 1 and 2, both on the first stage
        assert "layers per stage " + ("[[1, 2], [3]]" if family == "qwen3_vl" else "[[1], [2]]") in line
