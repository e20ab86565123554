"""LoRA under TP2, TP2+SP, PP2, CP2, EP2 and DP2 (distributed optimizer): loss and adapter gradients equal PEFT's,
and the checkpoint's exports (PEFT adapter, merged model) equal PEFT's too. One torchrun (2 ranks, gloo) runs every
layout with the families CI checks under it; what each checks is in scripts/lora_parity.py, which prints the
measured differences (``--matrix full``: every family under every layout, docs/lora.md's table)."""

import pytest

from tests.lora_parity import prepare

from .conftest import SCRIPTS_DIR, run_torchrun

pytestmark = [pytest.mark.functional, pytest.mark.cpu_only]

LAYOUTS = ["tp2", "tp2sp", "pp2", "cp2", "ep2", "dp2"]


def ci_families() -> list[str]:
    """The families the script's CI layouts name (read from the script, which imports Megatron when run)."""
    import ast

    tree = ast.parse((SCRIPTS_DIR / "lora_parity.py").read_text())
    (layouts,) = [
        node.value for node in tree.body if isinstance(node, ast.Assign) and node.targets[0].id == "LAYOUTS"
    ]
    return sorted({f for entry in ast.literal_eval(layouts).values() for f in entry[2]})


@pytest.fixture(scope="module")
def parity_output(tmp_path_factory):
    root = prepare(tmp_path_factory.mktemp("lora_parallel"), ci_families())
    return run_torchrun("lora_parity.py", nproc=2, args=["--root", root], timeout=420)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_lora_matches_peft_under(layout, parity_output):
    assert f"[{layout}] rank 0: all families match" in parity_output
    assert f"[{layout}] rank 1: all families match" in parity_output
