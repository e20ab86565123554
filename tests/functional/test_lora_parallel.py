"""LoRA under TP2, TP2+SP, PP2, CP2, EP2 and DP2 (distributed optimizer): loss and adapter gradients equal PEFT's,
and the checkpoint's exports (PEFT adapter, merged model) equal PEFT's too. One torchrun (2 ranks, gloo) runs every
layout; what each checks is in scripts/lora_parity.py, which prints the measured differences."""

import pytest

from tests.lora_parity import write_peft_adapter, write_source

from .conftest import run_torchrun

pytestmark = [pytest.mark.functional, pytest.mark.cpu_only]

LAYOUTS = ["tp2", "tp2sp", "pp2", "cp2", "ep2", "dp2"]
FAMILIES = ["llama3", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen2_5_vl", "qwen3_vl"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
# some families with a part of each fused layer only: the other parts' rows get no adapter
TARGETS = {
    "llama3": ["q_proj", "v_proj", "up_proj", "down_proj"],
    "qwen3_moe": ATTENTION,
    "qwen3_vl": ["k_proj", "o_proj", "gate_proj"],
}
ALL = [*ATTENTION, "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def parity_output(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_parallel")
    for family in FAMILIES:
        source = write_source(family, root / family / "source")
        write_peft_adapter(source, root / family / "peft", TARGETS.get(family, ALL))
    return run_torchrun("lora_parity.py", nproc=2, args=["--root", root], timeout=420)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_lora_matches_peft_under(layout, parity_output):
    assert f"[{layout}] rank 0: all families match" in parity_output
    assert f"[{layout}] rank 1: all families match" in parity_output
