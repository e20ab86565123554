"""thdpack.training.token_budget: ``dataset.micro_batch_tokens: fit`` from a measured memory model."""

from __future__ import annotations

import pytest

from thdpack.training import token_budget
from thdpack.training.checks import ConfigError
from thdpack.training.token_budget import MemoryModel, fit_micro_batch_tokens, largest_budget, setting_key

GIB = 2**30


def test_the_budget_is_what_the_free_memory_holds_rounded_down_to_1024():
    # 80 GiB x 0.92 = 73.6 GiB; 73.6 - 20 = 53.6 GiB at 1 MiB a token: 54,886 tokens -> 54,272
    model = MemoryModel(20 * GIB, 2**20, "H100")
    assert largest_budget(model, 80 * GIB, headroom=0.92) == 54272


def test_a_model_larger_than_the_device_leaves_no_budget():
    assert largest_budget(MemoryModel(90 * GIB, 2**20, "H100"), 80 * GIB) == 0


def test_setting_key_names_the_optimizer_state():
    assert setting_key({"use_precision_aware_optimizer": False, "exp_avg_dtype": "fp32"}) == "default"
    trainer = {"use_precision_aware_optimizer": True, "exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "bf16"}
    assert setting_key(trainer) == "aware:fp32/fp32/bf16/bf16"


def _cfg(seq_length=8192, packed=True):
    dataset = {"seq_length": seq_length, "pack_sequences_in_batch": packed}
    return {"model": {"name": "llama3_1b"}, "trainer": {}, "dataset": dataset}


def test_fit_picks_the_measured_models_budget(monkeypatch):
    monkeypatch.setitem(
        token_budget.MEASURED, ("llama3_1b", "chunked", "default"), MemoryModel(20 * GIB, 2**20, "H100")
    )
    assert fit_micro_batch_tokens(_cfg(), "chunked", 80 * GIB) == 49152  # 0.85 x 80 GiB - 20 GiB = 48 GiB


def test_the_shipped_llama3_1b_entry_fits_its_measured_card_below_the_budget_that_ran_out_of_memory():
    h100 = 85017493504  # torch.cuda.get_device_properties(0).total_memory of the H100 80GB HBM3 it was measured on
    budget = fit_micro_batch_tokens(_cfg(), "chunked", h100)
    # there 36,864 tokens trained at 66.8 GiB; 38,912, 41,984 and 49,152 ran out of memory
    assert 32768 < budget <= 36864
    assert budget == 36864


def test_fit_without_a_measured_model_names_the_key_and_what_to_run():
    with pytest.raises(
        ConfigError, match=r"micro_batch_tokens=fit has no measured memory model .*token_budget.py"
    ):
        fit_micro_batch_tokens(_cfg(), "megatron", 80 * GIB)


def test_fit_below_one_sample_is_refused(monkeypatch):
    monkeypatch.setitem(
        token_budget.MEASURED, ("llama3_1b", "chunked", "default"), MemoryModel(70 * GIB, 2**20, "H100")
    )
    with pytest.raises(ConfigError, match="below dataset.seq_length=8192"):
        fit_micro_batch_tokens(_cfg(), "chunked", 80 * GIB)


def test_fit_on_cpu_is_refused():
    with pytest.raises(ConfigError, match="give a number on CPU"):
        fit_micro_batch_tokens(_cfg(), "megatron", None)


def test_fit_without_packing_is_refused():
    with pytest.raises(ConfigError, match="fit needs dataset.pack_sequences_in_batch=true"):
        fit_micro_batch_tokens(_cfg(packed=False), "chunked", 80 * GIB)
