"""The loss of the training step as one component: the per-token loss, the key its reports carry, and the
reduction of those reports to the mean per-token loss.

Megatron's schedules (``calculate_per_token_loss=True``) take ``(loss_sum, num_tokens, reports)`` from the loss
function of each micro-batch, add ``num_tokens`` over micro-batches and divide the gradients by it after the
DP x CP reduction (:func:`thdpack.megatron.optimizer.finalize_grads_per_token`). :class:`TokenLoss` states that
contract once; a custom loss subclasses it (``token_losses`` for another per-token term, ``key`` for its name in
the reports) and reaches the step through :func:`thdpack.megatron.step.make_forward_step` or the training loop's
``Run.step``, with no edit of the step or the loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .batch import ModelInputs

__all__ = ["LM_LOSS", "TokenLoss"]


@dataclass(frozen=True)
class TokenLoss:
    """A loss summed over counted tokens, ``(loss_sum, num_tokens, {key: [loss_sum, num_tokens]})`` per
    micro-batch; the reports of a step reduce to ``sum / count`` over micro-batches and the DP x CP group.

    Attributes:
        key: the reports' key (Megatron's ``"lm loss"`` for the language-model loss).
    """

    key: str = "lm loss"

    def token_losses(self, inputs: ModelInputs, output_tensor: torch.Tensor) -> torch.Tensor:
        """Per-token losses ``[b, s]`` aligned with ``inputs.loss_mask``: here the model's output itself
        (``GPTModel`` called with labels returns the per-token cross entropy)."""
        return output_tensor

    def __call__(self, inputs: ModelInputs, output_tensor: torch.Tensor):
        """Megatron's ``loss_func`` for one micro-batch: ``(loss_sum, num_tokens, {key: report})`` over the
        tokens where ``inputs.loss_mask > 0``. A rank with no counted token returns ``(0, 0)``: masked positions
        are dropped with ``where``, not multiplied by 0, so a non-finite loss on pad cannot turn the sum into
        NaN (Megatron-Bridge issue 2914)."""
        losses = self.token_losses(inputs, output_tensor).float().reshape(-1)
        mask = inputs.loss_mask.reshape(-1).float()
        loss_sum = torch.where(mask > 0, losses * mask, torch.zeros_like(losses)).sum()
        num_tokens = (mask > 0).sum().to(torch.int)
        report = torch.stack([loss_sum.detach(), num_tokens.detach().float()])
        return loss_sum, num_tokens, {self.key: report}

    def reduce(self, reports: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """Mean per-token loss over micro-batches and over the DP x CP group, from this loss's reports (the
        list ``get_forward_backward_func`` returns on the last pipeline stage)."""
        from megatron.core import parallel_state as ps

        total = torch.stack([r[self.key] for r in reports]).sum(dim=0)
        torch.distributed.all_reduce(total, group=ps.get_data_parallel_group(with_context_parallel=True))
        return total[0] / total[1].clamp(min=1)

    def first_nonfinite(self, reports: list[dict[str, torch.Tensor]]) -> int | None:
        """1-based index of the first micro-batch whose summed loss is not finite (a host read per report: for
        the error path)."""
        for i, report in enumerate(reports, start=1):
            if not torch.isfinite(report[self.key][0]).item():
                return i
        return None


LM_LOSS = TokenLoss()
