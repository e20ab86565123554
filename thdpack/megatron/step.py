"""``forward_step`` in Megatron-core's schedule convention (``get_forward_backward_func``): the batch, the model
family's forward and the loss, each taken from the step's :class:`StepConfig`."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from .batch import BatchConfig, get_batch
from .families import GPT, ModelFamily
from .loss import LM_LOSS, TokenLoss
from .unwrap import unwrap_model

__all__ = ["StepConfig", "forward_step", "make_forward_step"]


@dataclass(frozen=True)
class StepConfig:
    """What one micro-batch's step does.

    Attributes:
        batch: :class:`~thdpack.megatron.batch.BatchConfig`: packing, alignment, the batch hook.
        family: the :class:`~thdpack.megatron.families.ModelFamily` whose ``forward`` calls the model.
        loss: the loss component (:class:`~thdpack.megatron.loss.TokenLoss` or a subclass).
    """

    batch: BatchConfig = field(default_factory=BatchConfig)
    family: ModelFamily = GPT
    loss: TokenLoss = LM_LOSS


def forward_step(data_iterator, model, config: StepConfig = StepConfig()):  # noqa: B008 - frozen dataclass
    """One micro-batch through ``model``: returns ``(output, loss_func)`` as Megatron's schedules expect.

    With ``config.batch.pack_sequences_in_batch`` the model sees one THD row with ``packed_seq_params``, the MoE
    ``padding_mask`` and (for MRoPE models) ``[3, 1, T]`` position ids; otherwise the padded BSHD baseline.
    Bind ``config`` with :func:`make_forward_step` to get Megatron's two-argument signature.
    """
    inputs = get_batch(data_iterator, unwrap_model(model).config, config.batch)
    output = config.family.forward(model, inputs)
    return output, functools.partial(config.loss, inputs)


def make_forward_step(
    batch: BatchConfig = BatchConfig(),  # noqa: B008 - frozen dataclass
    *,
    family: ModelFamily = GPT,
    loss: TokenLoss = LM_LOSS,
):
    """``forward_step`` with its :class:`StepConfig` bound: ``(data_iterator, model) -> (output, loss_func)``."""
    return functools.partial(forward_step, config=StepConfig(batch, family, loss))
