"""thdpack.megatron.optimizer_precision: the precision-aware optimizer's recipe keys, checked at start-up."""

from __future__ import annotations

import pytest
import torch

from thdpack.megatron.optimizer_precision import (
    check_optimizer_precision,
    ddp_grad_reduce_in_fp32,
    optimizer_precision_kwargs,
)


def test_the_default_recipe_keeps_megatrons_default_optimizer():
    trainer = {"use_precision_aware_optimizer": False, "exp_avg_dtype": "fp32"}
    check_optimizer_precision(trainer, "cpu", "fp32")
    assert optimizer_precision_kwargs(trainer) == {}
    assert ddp_grad_reduce_in_fp32(trainer)


def test_precision_aware_settings_become_optimizer_config_dtypes():
    trainer = {"use_precision_aware_optimizer": True, "exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "fp8"}
    assert optimizer_precision_kwargs(trainer) == {
        "use_precision_aware_optimizer": True,
        "main_params_dtype": torch.float32,
        "main_grads_dtype": torch.float32,
        "exp_avg_dtype": torch.bfloat16,
        "exp_avg_sq_dtype": torch.uint8,  # TE's FusedAdam: uint8 means FP8 (E4M3, scaled)
    }


def test_bf16_main_grads_make_the_ddp_buffer_bf16():
    assert not ddp_grad_reduce_in_fp32({"use_precision_aware_optimizer": True, "main_grads_dtype": "bf16"})


@pytest.mark.parametrize(
    ("trainer", "device", "precision", "message"),
    [
        (
            {"exp_avg_dtype": "bf16"},
            "cuda",
            "bf16",
            r"trainer.exp_avg_dtype=bf16 needs trainer.use_precision_aware",
        ),
        ({"use_precision_aware_optimizer": True}, "cpu", "fp32", "needs a CUDA GPU"),
        ({"use_precision_aware_optimizer": True}, "cuda", "fp32", "with trainer.precision=fp32"),
        (
            {"use_precision_aware_optimizer": True, "main_params_dtype": "bf16"},
            "cuda",
            "bf16",
            "main_params_dtype is",
        ),
        ({"use_precision_aware_optimizer": "yes"}, "cuda", "bf16", "must be true or false"),
    ],
)
def test_a_combination_that_cannot_run_is_refused_naming_the_key(trainer, device, precision, message):
    with pytest.raises(ValueError, match=message):
        check_optimizer_precision(trainer, device, precision)
