"""L1: thdpack's packed Qwen2.5-VL and Qwen3-VL (DeepStack included) equal transformers per sample under context
parallelism (the vision tower on
every CP rank, image embeddings scattered into each rank's zigzag shard) and tensor parallelism with sequence
parallelism (scattered before the sequence split); MRoPE ids of every shard equal get_rope_index's."""

from __future__ import annotations

import pytest

from tests.vlm_models import build_tiny_vl

pytestmark = pytest.mark.functional


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def directory(request, tmp_path_factory):
    return build_tiny_vl(tmp_path_factory.mktemp("vl"), family=request.param)


@pytest.mark.parametrize("layout", ["cp2", "tp2_sp"])
def test_vlm_logits_and_loss_equal_transformers(run_torchrun, directory, layout):
    out = run_torchrun(
        "vlm_parity.py", nproc=2, args=["--layout", layout, "--directory", str(directory)], timeout=400
    )
    line = next((line for line in out.splitlines() if "VLM PARITY OK" in line), "")
    print(line)
    assert f"VLM PARITY OK {layout}" in line
