"""``forward_step`` in Megatron-core's schedule convention (``get_forward_backward_func``): the batch, the model
family's forward and the loss, each taken from the step's :class:`StepConfig`."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .batch import BatchConfig, ModelInputs, get_batch
from .loss import LM_LOSS, TokenLoss
from .unwrap import unwrap_model

__all__ = ["StepConfig", "forward_step", "gpt_forward", "make_forward_step"]


def gpt_forward(model, inputs: ModelInputs):
    """``GPTModel.forward`` on a micro-batch: packed (``packed_seq_params``, the MoE ``padding_mask``, ``[3, 1,
    T]`` MRoPE ids) or padded (a ``[B, 1, 1, S]`` attention mask); per-token losses on the last stage."""
    return model(
        inputs.tokens,
        inputs.position_ids,
        inputs.attention_mask,
        labels=inputs.labels,
        loss_mask=inputs.loss_mask,  # the fused output loss's per-token weights (thdpack.megatron.output_loss)
        packed_seq_params=inputs.packed_seq_params,
        padding_mask=inputs.padding_mask,
    )


@dataclass(frozen=True)
class StepConfig:
    """What one micro-batch's step does.

    Attributes:
        batch: :class:`~thdpack.megatron.batch.BatchConfig`: packing, alignment, the batch hook.
        forward: ``(model, inputs) -> output``: the model family's forward (``ModelFamily.forward`` of
            :mod:`thdpack.models`); :func:`gpt_forward` by default.
        loss: the loss component (:class:`~thdpack.megatron.loss.TokenLoss` or a subclass).
    """

    batch: BatchConfig = field(default_factory=BatchConfig)
    forward: Callable[[Any, ModelInputs], Any] = gpt_forward
    loss: TokenLoss = LM_LOSS


def forward_step(data_iterator, model, config: StepConfig = StepConfig()):  # noqa: B008 - frozen dataclass
    """One micro-batch through ``model``: returns ``(output, loss_func)`` as Megatron's schedules expect.

    With ``config.batch.pack_sequences_in_batch`` the model sees one THD row with ``packed_seq_params``, the MoE
    ``padding_mask`` and (for MRoPE models) ``[3, 1, T]`` position ids; otherwise the padded BSHD baseline.
    Bind ``config`` with :func:`make_forward_step` to get Megatron's two-argument signature.
    """
    inputs = get_batch(data_iterator, unwrap_model(model).config, config.batch)
    output = config.forward(model, inputs)
    return output, functools.partial(config.loss, inputs)


def make_forward_step(
    batch: BatchConfig = BatchConfig(),  # noqa: B008 - frozen dataclass
    *,
    forward: Callable[[Any, ModelInputs], Any] = gpt_forward,
    loss: TokenLoss = LM_LOSS,
):
    """``forward_step`` with its :class:`StepConfig` bound: ``(data_iterator, model) -> (output, loss_func)``."""
    return functools.partial(forward_step, config=StepConfig(batch, forward, loss))
