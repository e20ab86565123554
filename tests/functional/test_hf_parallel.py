"""Imported Hugging Face checkpoints under TP2, TP2+SP, PP2, CP2 (every family) and EP2 (the MoE families): logits and
loss equal transformers'. One torchrun (2 ranks, gloo) runs every layout; what each checks is in
scripts/hf_parity.py, which prints the measured differences."""

import pytest

from tests.hf_models import FAMILIES, save_model

from .conftest import run_torchrun

pytestmark = [pytest.mark.functional, pytest.mark.cpu_only]

LAYOUTS = ["tp2", "tp2sp", "pp2", "cp2", "ep2"]


@pytest.fixture(scope="module")
def parity_output(tmp_path_factory):
    models = tmp_path_factory.mktemp("hf_models")
    for family in FAMILIES:
        save_model(family, models / family)
    return run_torchrun("hf_parity.py", nproc=2, args=["--models", models], timeout=300)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_family_matches_transformers_under(layout, parity_output):
    assert f"[{layout}] rank 0: all families match" in parity_output
    assert f"[{layout}] rank 1: all families match" in parity_output
