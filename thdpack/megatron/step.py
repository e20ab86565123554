"""``forward_step`` and ``loss_func`` in Megatron-core's schedule convention (``get_forward_backward_func``)."""

from __future__ import annotations

import functools

import torch

from .batch import BatchConfig, get_batch
from .unwrap import unwrap_model

__all__ = ["forward_step", "loss_func", "make_forward_step", "reduce_loss_report"]


def forward_step(data_iterator, model, config: BatchConfig = BatchConfig()):  # noqa: B008 - frozen dataclass
    """One micro-batch through ``model``: returns ``(output, loss_func)`` as Megatron's schedules expect.

    With ``config.pack_sequences_in_batch`` the model sees one THD row with ``packed_seq_params``, the MoE
    ``padding_mask`` and (for MRoPE models) ``[3, 1, T]`` position ids; otherwise the padded BSHD baseline.
    Bind ``config`` with :func:`make_forward_step` to get Megatron's two-argument signature.
    """
    model_config = unwrap_model(model).config
    inputs = get_batch(data_iterator, model_config, config)
    output = model(
        inputs.tokens,
        inputs.position_ids,
        inputs.attention_mask,
        labels=inputs.labels,
        loss_mask=inputs.loss_mask,  # the fused output loss's per-token weights (thdpack.megatron.output_loss)
        packed_seq_params=inputs.packed_seq_params,
        padding_mask=inputs.padding_mask,
    )
    return output, functools.partial(loss_func, inputs.loss_mask)


def make_forward_step(config: BatchConfig):
    """``forward_step`` with ``config`` bound: ``(data_iterator, model) -> (output, loss_func)``."""
    return functools.partial(forward_step, config=config)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Per-token loss for ``calculate_per_token_loss=True``.

    Args:
        loss_mask: float ``[b, s]`` (1 = counts), aligned with ``output_tensor``.
        output_tensor: per-token losses ``[b, s]`` from ``GPTModel`` with labels.

    Returns:
        ``(loss_sum, num_tokens, {"lm loss": [loss_sum, num_tokens]})`` for this rank's tokens. Megatron divides
        the gradients by the number of tokens summed over micro-batches and DP x CP ranks
        (``finalize_model_grads``); :func:`reduce_loss_report` does the same for the reported loss. A rank with
        no counted token returns ``(0, 0)``: masked positions are dropped with ``where``, not multiplied by 0,
        so a non-finite loss on pad cannot turn the sum into NaN.
    """
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.reshape(-1).float()
    loss_sum = torch.where(mask > 0, losses * mask, torch.zeros_like(losses)).sum()
    num_tokens = (mask > 0).sum().to(torch.int)
    report = torch.stack([loss_sum.detach(), num_tokens.detach().float()])
    return loss_sum, num_tokens, {"lm loss": report}


def reduce_loss_report(reports: list[dict[str, torch.Tensor]], key: str = "lm loss") -> torch.Tensor:
    """Mean per-token loss over micro-batches and over the DP x CP group, from ``loss_func``'s reports (the
    list ``get_forward_backward_func`` returns on the last pipeline stage)."""
    from megatron.core import parallel_state as ps

    total = torch.stack([r[key] for r in reports]).sum(dim=0)
    torch.distributed.all_reduce(total, group=ps.get_data_parallel_group(with_context_parallel=True))
    return total[0] / total[1].clamp(min=1)
