"""GPU: LoRA on Transformer Engine's layers (the branch takes the fused norm + linear's own norm output, the base
GEMMs stay in TE) against PEFT on the same tiny model and adapter: in fp32 within 1e-4 relative (loss and every
adapter gradient), in bf16 within bf16's rounding; with FP8 base GEMMs (TE delayed scaling) the adapters stay bf16
outside the FP8 GEMMs, get finite gradients and give the bf16 run's loss within FP8's error; a LoRA training step
of the product makes no host-device sync.

    pytest -m gpu tests/functional/test_gpu_lora.py -s      # prints the measured differences
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.lora_parity import (
    grad_difference,
    padded_batch,
    peft_reference,
    thdpack_step,
    write_peft_adapter,
    write_source,
)

from .gpu import FP8_CORES, WITH_TE, steady_step_scalars

pytestmark = WITH_TE

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_a_lora_training_step_makes_no_sync_in_steady_state(tmp_path):
    # first in the module: it starts and ends its own process groups, before the module's fixture holds them
    from hydra import compose, initialize_config_dir

    from tests.hf_models import save_model
    from thdpack.training.loop import _shutdown, recipes_dir, setup_run

    source = save_model("qwen3", tmp_path / "qwen3")
    os.environ.pop("MASTER_PORT", None)
    overrides = [
        "model=hf", f"model.pretrained={source}", f"dataset.tokenizer={source / 'tokenizer.json'}", "peft=lora",
        "dataset.seq_length=512", "dataset.micro_batch_size=4", "dataset.global_batch_size=16",
        "dataset.max_files=40", "trainer.train_iters=10",
    ]  # fmt: skip
    with initialize_config_dir(str(recipes_dir()), version_base="1.3"):
        run = setup_run(compose("train", overrides=overrides))
    try:
        settled = steady_step_scalars(run)
        assert [step for step, _, _ in settled] == [3, 4, 5, 6]
    finally:
        _shutdown()


@pytest.fixture(scope="module")
def gpu_megatron():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from thdpack.megatron.runtime import Runtime, init_distributed

    os.environ.pop("MASTER_PORT", None)
    init_distributed(Runtime("cuda", "bf16", "te"), seed=1234)
    yield
    ps.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.fixture(scope="module", params=["llama3", "qwen3_moe"])
def model_and_adapter(request, tmp_path_factory, gpu_megatron):
    family = request.param
    root = tmp_path_factory.mktemp(f"gpu_lora_{family}")
    source = write_source(family, root / "source")
    names = ALL if "moe" not in family else ALL[:4]
    adapter = write_peft_adapter(source, root / "peft", names)
    return family, source, adapter, peft_reference(source, adapter, padded_batch(source))


def _step(source, adapter, precision, fp8_recipe=None):
    from thdpack.megatron.runtime import Runtime

    return thdpack_step(source, adapter, None, runtime=Runtime("cuda", precision, "te", fp8_recipe))


def test_lora_on_te_layers_in_fp32_computes_what_peft_computes(model_and_adapter):
    family, source, adapter, reference = model_and_adapter
    step = _step(source, adapter, "fp32")
    loss, grads = abs(step.loss - reference.loss) / reference.loss, grad_difference(step, reference)
    print(f"{family} TE fp32: loss {loss:.2g}, gradients {grads:.2g}")
    assert loss <= 1e-4 and grads <= 1e-4


def test_lora_on_te_layers_in_bf16_is_within_bf16_rounding_of_peft(model_and_adapter):
    family, source, adapter, reference = model_and_adapter
    step = _step(source, adapter, "bf16")
    loss, grads = abs(step.loss - reference.loss) / reference.loss, grad_difference(step, reference)
    print(f"{family} TE bf16: loss {loss:.2g}, gradients {grads:.2g}")
    assert step.dtypes == {"adapters": {torch.bfloat16}, "base": {torch.bfloat16}}
    assert loss <= 1e-2 and grads <= 5e-2


@FP8_CORES
def test_fp8_base_gemms_with_bf16_adapters_train_near_the_bf16_run(model_and_adapter):
    family, source, adapter, reference = model_and_adapter
    bf16 = _step(source, adapter, "bf16")
    fp8 = _step(source, adapter, "fp8", "delayed")
    loss, grads = abs(fp8.loss - bf16.loss) / bf16.loss, grad_difference(fp8, reference)
    print(f"{family} FP8 (delayed) vs bf16: loss {loss:.2g}; gradients vs PEFT {grads:.2g}")
    assert fp8.dtypes["adapters"] == {torch.bfloat16}
    assert all(torch.isfinite(g).all() and g.abs().max() > 0 for g in fp8.grads.values())
    # measured 0.36 (llama3) and 0.41 (qwen3_moe) on an H200, 2026-12-01: the first step of delayed scaling runs
    # with its initial scales; the adapters' scaling itself is held to 5e-2 by the bf16 test above
    assert loss <= 5e-2 and grads <= 0.5
