"""Expert biases (gpt-oss) on the torch layer spec, trained.

megatron-core 0.16.1's ``MLP.forward`` adds an expert's output bias in place, ``output += output_bias *
per_token_scale`` (``transformer/mlp.py:247``), to what the expert's row-parallel ``linear_fc2`` returned. Without
expert tensor or expert parallelism that is the reduction's autograd function handing its input back, which
autograd marks as a view and refuses to modify in place once gradients are on ("Output 0 of
_ReduceFromModelParallelRegion is a view and is being modified inplace"): the forward pass alone works, the first
training step stops. :class:`ExpertRowParallelLinear` returns a copy in that one case (TE's linear layers return
tensors of their own).
"""

from __future__ import annotations

from megatron.core.tensor_parallel.layers import RowParallelLinear

__all__ = ["ExpertRowParallelLinear", "use_expert_row_parallel_linear"]


class ExpertRowParallelLinear(RowParallelLinear):
    """Megatron's ``RowParallelLinear`` whose output the MLP may add its expert bias to in place."""

    def forward(self, *args, **kwargs):
        output, bias = super().forward(*args, **kwargs)
        if output._is_view():
            output = output.clone()
        return output, bias


def use_expert_row_parallel_linear(spec):
    """The torch layer spec ``spec`` (MoE) with :class:`ExpertRowParallelLinear` as the experts' ``linear_fc2``."""
    experts = spec.submodules.mlp.submodules.experts.submodules
    if experts.linear_fc2 is RowParallelLinear:
        experts.linear_fc2 = ExpertRowParallelLinear
    return spec
