"""thdpack.megatron.post_norm: an output projection followed by its own norm, the bias it would hand to the
residual add normalised with the output (transformers' ``post_norm(sublayer(x))``)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from thdpack.megatron.post_norm import with_post_norm


class Projection(torch.nn.Module):
    """A Megatron-style output projection: ``(output, bias)``, the bias left to the residual add."""

    def __init__(self, config, with_bias: bool):
        super().__init__()
        self.config = config
        self.weight = torch.nn.Parameter(torch.randn(8, 8))
        self.bias = torch.nn.Parameter(torch.randn(8)) if with_bias else None

    def forward(self, x):
        return x @ self.weight.T, self.bias


def norm(config, hidden_size, eps):
    return torch.nn.RMSNorm(hidden_size, eps=eps)


def test_the_output_and_its_bias_go_through_the_norm_and_no_bias_is_left():
    config = SimpleNamespace(hidden_size=8, layernorm_epsilon=1e-6)
    torch.manual_seed(0)
    layer = with_post_norm(Projection, norm)(config, with_bias=True)
    x = torch.randn(3, 8)
    output, bias = layer(x)
    expected = layer.post_layernorm(x @ layer.weight.T + layer.bias)
    assert bias is None and torch.equal(output, expected)
    assert type(layer).__name__ == "PostNormProjection"
    assert "post_layernorm.weight" in dict(layer.named_parameters())
