"""A sublayer's output projection followed by its own norm before the residual add ("sandwich" norms): Gemma 3's
``post_attention_layernorm`` after the attention's output projection and ``post_feedforward_layernorm`` after the
MLP's down projection (transformers: ``residual + post_norm(sublayer(pre_norm(x)))``). Megatron's
``TransformerLayer`` has no such norm; :func:`with_post_norm` makes an output-projection class (``linear_proj``,
``linear_fc2``: row-parallel) that applies one to its output.

    spec.submodules.mlp.submodules.linear_fc2 = with_post_norm(RowParallelLinear, TorchNorm)

The norm is the projection's ``post_layernorm`` (state-dict key ``...linear_fc2.post_layernorm.weight``, Megatron-
Bridge's name), built like the layer's other norms (``norm``: the spec's norm class), so sequence parallelism and
zero-centred gains apply to it. It normalises each token's whole hidden vector: the row-parallel projection's
output is already reduced (every rank holds the full vectors of its tokens: all of them, or its sequence-parallel
share), never a partial sum.
"""

from __future__ import annotations

__all__ = ["with_post_norm"]


def with_post_norm(linear: type, norm: type) -> type:
    """A subclass of the Megatron output projection ``linear`` whose forward returns
    ``(post_layernorm(output + bias), None)``: a bias the projection hands to the residual add
    (``skip_bias_add``) goes under the norm, as in transformers' sublayer."""

    class PostNorm(linear):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            config = self.config
            self.post_layernorm = norm(
                config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon
            )

        def forward(self, *args, **kwargs):
            output, bias = super().forward(*args, **kwargs)
            if bias is not None:
                output = output + bias
            return self.post_layernorm(output), None

    PostNorm.__name__ = PostNorm.__qualname__ = f"PostNorm{linear.__name__}"
    return PostNorm
