"""When Transformer Engine's layers accumulate weight gradients into Megatron's fp32 buffer inside the GEMM
(``thdpack.megatron.distributed.te_wgrad_fusion``). The fusion itself is checked on a GPU
(``tests/functional/test_gpu_wgrad_fusion.py``)."""

from __future__ import annotations

import pytest

from thdpack.megatron.distributed import te_wgrad_fusion
from thdpack.megatron.runtime import Runtime


@pytest.mark.parametrize(
    ("device", "backend", "model", "expected"),
    [
        ("cuda", "te", {}, True),
        ("cuda", "te", {"config": {"num_layers": 2}}, True),
        ("cuda", "te", {"config": None}, True),
        # the recipe's own megatron-core key wins: false turns it off, true leaves it to megatron-core (Apex)
        ("cuda", "te", {"config": {"gradient_accumulation_fusion": False}}, False),
        ("cuda", "te", {"config": {"gradient_accumulation_fusion": True}}, False),
        ("cuda", "torch", {}, False),
        ("cpu", "torch", {}, False),
    ],
)
def test_on_with_transformer_engine_on_a_gpu_unless_the_recipe_sets_megatrons_key(
    device, backend, model, expected
):
    assert te_wgrad_fusion(model, Runtime(device=device, precision="bf16", backend=backend)) is expected
