"""The torch layer spec's zero-centred RMSNorm (thdpack.megatron.zero_centered_norm) is transformers' Gemma 3
RMSNorm bit for bit, the checkpoint's weight loaded as it is stored, and TorchNorm (every torch-spec norm) builds it
where Megatron's ``layernorm_zero_centered_gamma`` asks (under sequence parallelism too)."""

import pytest
import torch
from megatron.core.transformer import TransformerConfig

from thdpack.megatron.norm import TorchNorm
from thdpack.megatron.zero_centered_norm import ZeroCenteredRMSNormModule


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_it_is_transformers_gemma3_rmsnorm_bit_for_bit(dtype):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 3, 16, generator=g) * 3).to(dtype)
    weight = torch.randn(16, generator=g) * 0.5
    ours, theirs = ZeroCenteredRMSNormModule(16, eps=1e-6), Gemma3RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight)
    ours, theirs = ours.to(dtype), theirs.to(dtype)
    assert torch.equal(ours(x), theirs(x))


def test_torch_norm_builds_it_for_zero_centered_gamma_with_sequence_parallel_marks():
    config = TransformerConfig(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=2,
        normalization="RMSNorm",
        layernorm_zero_centered_gamma=True,
        tensor_model_parallel_size=2,
        sequence_parallel=True,
    )
    norm = TorchNorm(config, 8, eps=1e-6)
    assert isinstance(norm, ZeroCenteredRMSNormModule) and norm.eps == 1e-6
    assert norm.weight.sequence_parallel is True and torch.equal(norm.weight, torch.zeros(8))
