"""The output layer and the cross entropy in one pass over chunks of tokens: no ``[tokens, vocab]`` logits kept.

megatron-core's ``GPTModel`` builds the logits of every token (``[s, b, V/tp]`` in bf16) and its vocab-parallel
cross entropy takes ``logits.float()``: at 32,768 tokens x 128,256 vocabulary that is 16.8 GB of fp32 on top of
8.4 GB of bf16, and the softmax is kept for the backward. :func:`linear_cross_entropy` computes, chunk of tokens
by chunk of tokens, the chunk's logits (the compute dtype, as the output layer makes them), their fp32 softmax
statistics, the per-token loss and, in the same pass, the gradients of the hidden states and of the weight
(Liger's idea: the loss is the last layer, so its gradient can be formed in the forward). Only the losses, the
hidden states' gradient (``[tokens, hidden]``) and the weight's gradient (fp32 ``[V/tp, hidden]``) outlive a chunk.

Under tensor parallelism the vocabulary is split as Megatron splits it (rank ``r`` holds rows
``[r V/tp, (r+1) V/tp)``): the max and the sum of exponentials are all-reduced over the TP group, the target's
logit comes from the rank that owns it. The hidden states enter the way ``ColumnParallelLinear`` takes them:
all-gathered along the sequence under sequence parallelism (reduce-scattered back in the backward), else copied
to every TP rank (gradients all-reduced).

The gradient contract: the forward forms the gradient of ``sum_t weights_t * loss_t`` (``weights``: the loss mask);
the backward scales it by ``c``, where the incoming per-token gradient is ``c * weights`` -- what thdpack's
per-token loss (``loss_func``: the sum over counted tokens) and Megatron's loss scaling produce. Any other
per-token gradient is refused on the device (``torch._assert_async``).

Implementations (``model.output_loss``):
- ``megatron``: megatron-core's output layer and cross entropy, untouched;
- ``chunked``: this module's torch code (any device, any TP; on CUDA its element-wise parts are compiled);
- ``liger``: Liger-Kernel's ``fused_linear_cross_entropy_forward`` (Triton, TP=1 only, loss-mask weights 0 or 1;
  it reads the count of counted tokens back to the host: one sync a micro-batch).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

from .distributed import run_forward_pre_hooks

__all__ = [
    "OUTPUT_LOSSES",
    "check_output_loss",
    "default_chunk_tokens",
    "linear_cross_entropy",
    "resolve_output_loss",
    "use_output_loss",
]

OUTPUT_LOSSES = ("megatron", "chunked", "liger")


def default_chunk_tokens(vocab_per_rank: int) -> int:
    """Tokens a chunk: its bf16 logits about 1 GiB (4,096 tokens at 128,256 vocabulary), a multiple of 256.

    Each chunk reads and writes the fp32 weight-gradient accumulator (``[v, h]``) once, so fewer, larger chunks pay:
    on one H100 at 32,768 tokens x 128,256 x 2048, 4,096-token chunks took 101 ms and 4.0 GiB, 1,024-token ones
    111 ms and 2.7 GiB (``benchmarks/results/output_loss_h100_2026-11-25.md``)."""
    return max(256, (1 << 29) // max(1, vocab_per_rank) // 256 * 256)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    tp_group=None,
    chunk_tokens: int | None = None,
    impl: str = "chunked",
    compiled: bool | None = None,
    vocab_limit: int | None = None,
) -> torch.Tensor:
    """Per-token cross entropy of ``hidden @ weight.T`` against ``labels``, without keeping the logits.

    Args:
        hidden: ``[n, h]`` hidden states (compute dtype), the same on every TP rank.
        weight: ``[v, h]`` this rank's rows of the output layer (``v`` = vocabulary / TP).
        labels: int ``[n]`` target ids in the whole vocabulary; a negative label is no target (loss 0, no gradient).
        weights: float ``[n]`` loss-mask weights (0 = not counted: loss 0, no gradient); None = 1 for every token
            with a target.
        tp_group: the tensor-parallel group the vocabulary is split over (None: not split).
        chunk_tokens: tokens a chunk (default :func:`default_chunk_tokens`).
        impl: ``chunked`` or ``liger``.
        compiled: compile the element-wise parts of ``chunked`` (default: on CUDA).
        vocab_limit: ids at or past it are vocabulary padding (Megatron pads the vocabulary to a multiple of TP):
            their logits are ``-inf``, never predicted, as :func:`thdpack.hf.load.never_predict_padding` makes the
            output layer's. None: every row of ``weight`` is a token.

    Returns:
        fp32 ``[n]`` per-token losses (0 where not counted). See the module docstring for the gradient contract.
    """
    if impl not in ("chunked", "liger"):
        raise ValueError(f"impl is {impl!r}: linear_cross_entropy computes chunked or liger")
    counted = labels >= 0
    weights = counted.to(torch.float32) if weights is None else torch.where(counted, weights.float(), 0.0)
    tp = dist.get_world_size(tp_group) if tp_group is not None and dist.is_initialized() else 1
    if impl == "liger" and tp > 1:
        raise ValueError("the liger output loss runs without tensor parallelism only (TP=1)")
    if impl == "liger" and vocab_limit is not None and vocab_limit < weight.shape[0]:
        raise ValueError(
            "the liger output loss cannot leave out padded vocabulary rows: use model.output_loss=chunked"
        )
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    if compiled is None:
        compiled = hidden.device.type == "cuda"
    return _LinearCrossEntropy.apply(
        hidden,
        weight,
        labels,
        weights,
        tp_group if tp > 1 else None,
        chunk_tokens or default_chunk_tokens(weight.shape[0]),
        impl,
        compiled,
        needs_grad,
        vocab_limit,
    )


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, hidden, weight, labels, weights, tp_group, chunk_tokens, impl, compiled, needs_grad, limit
    ):
        if impl == "liger":
            losses, grad_hidden, grad_weight = _liger(hidden, weight, labels, weights, needs_grad)
        else:
            losses, grad_hidden, grad_weight = _chunked(
                hidden, weight, labels, weights, tp_group, chunk_tokens, compiled, needs_grad, limit
            )
        ctx.save_for_backward(grad_hidden, grad_weight, weights)
        ctx.weight_dtype = weight.dtype
        ctx.weight_needs_grad = weight.requires_grad
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        grad_hidden, grad_weight, weights = ctx.saved_tensors
        if grad_hidden is None:
            raise RuntimeError(
                "linear_cross_entropy ran without gradients (no_grad, or inputs that need none)"
            )
        # The incoming gradient must be c * weights on the counted tokens (elsewhere the loss is a constant 0, so
        # its gradient does not matter): c from a least-squares fit, the rest checked on the device.
        counted = weights != 0
        grad_losses = torch.where(counted, grad_losses.float(), 0.0)
        scale = (grad_losses * weights).sum() / (weights * weights).sum().clamp_min(
            torch.finfo(torch.float32).tiny
        )
        residual = (grad_losses - scale * weights).abs().amax()
        torch._assert_async(
            residual <= 1e-4 * grad_losses.abs().amax(),
            "linear_cross_entropy: the per-token loss gradient is not proportional to the loss-mask weights "
            "(the fused output loss supports a loss that is c * sum(weights * loss) only)",
        )
        grad_hidden = grad_hidden * scale.to(grad_hidden.dtype)
        grad_weight = (grad_weight * scale).to(ctx.weight_dtype) if ctx.weight_needs_grad else None
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, None


def _chunked(hidden, weight, labels, weights, tp_group, chunk_tokens, compiled, needs_grad, limit=None):
    """This module's chunk loop (torch): ``(losses, grad_hidden, grad_weight)`` for ``sum(weights * loss)``."""
    kernels = _compiled_kernels() if compiled else _KERNELS
    n = hidden.shape[0]
    vocab = weight.shape[0]
    start = dist.get_rank(tp_group) * vocab if tp_group is not None else 0
    padded_from = None if limit is None or limit >= start + vocab else max(0, limit - start)
    losses = torch.empty(n, dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if needs_grad else None
    # a frozen output layer (LoRA's base) needs no [vocab, hidden] fp32 accumulator, nor its GEMMs
    weight_grad = needs_grad and weight.requires_grad
    grad_weight = (
        torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if weight_grad else None
    )
    for begin in range(0, n, chunk_tokens):
        end = min(begin + chunk_tokens, n)
        h = hidden[begin:end]
        logits = h @ weight.t()  # [c, v] in the compute dtype, as the output layer computes them
        if padded_from is not None:
            logits[:, padded_from:] = float("-inf")
        local = labels[begin:end] - start
        owned = (local >= 0) & (local < vocab)
        local = torch.where(owned, local, 0)
        row_max = kernels.row_max(logits)
        if tp_group is not None:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=tp_group)
        sums = kernels.sum_exp_and_target(logits, row_max, local, owned)  # [c, 2]
        if tp_group is not None:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=tp_group)
        w = weights[begin:end]
        losses[begin:end] = torch.where(w != 0, sums[:, 0].log() - sums[:, 1], 0.0)
        if needs_grad:
            grad_logits = kernels.weighted_softmax_grad(logits, row_max, sums[:, 0], local, owned, w)
            del logits
            torch.mm(grad_logits, weight, out=grad_hidden[begin:end])
            # rows that do not count hold zero gradients, but 0 x inf is NaN: their hidden states leave the sum too
            if weight_grad:
                _accumulate_weight_grad(grad_weight, grad_logits, torch.where(w[:, None] != 0, h, 0.0))
    return losses, grad_hidden, grad_weight


def _accumulate_weight_grad(grad_weight: torch.Tensor, grad_logits: torch.Tensor, h: torch.Tensor) -> None:
    """``grad_weight += grad_logits.T @ h`` with an fp32 accumulator for compute-dtype operands (CUDA's
    ``addmm`` with ``out_dtype`` accumulates bf16 products into fp32 without a ``[v, h]`` temporary)."""
    if grad_logits.dtype == grad_weight.dtype:
        grad_weight.addmm_(grad_logits.t(), h)
    elif grad_weight.device.type == "cuda" and hasattr(torch.ops.aten.addmm, "dtype_out"):
        torch.addmm(grad_weight, grad_logits.t(), h, out_dtype=torch.float32, out=grad_weight)
    else:
        grad_weight += (grad_logits.t() @ h).float()


class _Kernels:
    """The element-wise parts of a chunk, on ``logits`` in the compute dtype, in fp32 (Megatron's
    ``VocabParallelCrossEntropy`` takes ``logits.float()`` and works in fp32 too)."""

    @staticmethod
    def row_max(logits):
        return logits.float().amax(dim=-1)

    @staticmethod
    def sum_exp_and_target(logits, row_max, local, owned):
        shifted = logits.float() - row_max[:, None]
        target = torch.where(owned, shifted.gather(1, local[:, None]).squeeze(1), 0.0)
        return torch.stack([shifted.exp().sum(dim=-1), target], dim=1)

    @staticmethod
    def weighted_softmax_grad(logits, row_max, sum_exp, local, owned, w):
        probs = (logits.float() - row_max[:, None]).exp() * sum_exp.reciprocal()[:, None]
        columns = torch.arange(logits.shape[1], device=logits.device)
        target = (columns[None, :] == local[:, None]) & owned[:, None]
        grad = torch.where(target, probs - 1.0, probs)
        # where, not a product: a row that does not count gives 0 even when its logits overflowed
        return torch.where(w[:, None] != 0, grad * w[:, None], 0.0).to(logits.dtype)


_KERNELS = _Kernels()


@functools.cache
def _compiled_kernels() -> _Kernels:
    # Shapes dynamic only where they change (dynamo's automatic dynamic: the chunk's token count), so the
    # vocabulary width is a constant of the kernel: with every dimension symbolic, the flattened element-wise
    # gradient kernel divides a 64-bit index by the width for every logit.
    kernels = _Kernels()
    for name in ("row_max", "sum_exp_and_target", "weighted_softmax_grad"):
        setattr(kernels, name, torch.compile(getattr(_Kernels, name), dynamic=None))
    return kernels


def _liger(hidden, weight, labels, weights, needs_grad):
    """Liger-Kernel 0.8.5's fused linear cross entropy, ``reduction="none"`` with gradients formed in the forward
    (it does so when ``compute_gradients`` is set: the gradient of the sum of the non-ignored tokens' losses)."""
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import fused_linear_cross_entropy_forward
    except ImportError as error:
        raise ImportError("model.output_loss=liger needs liger-kernel: pip install liger-kernel") from error
    torch._assert_async(
        ((weights == 0) | (weights == 1)).all(),
        "model.output_loss=liger counts tokens with weight 1 only: the loss mask must be 0 or 1",
    )
    target = torch.where(weights != 0, labels, -100)
    loss, _, _, _, grad_hidden, grad_weight, _ = fused_linear_cross_entropy_forward(
        hidden,
        weight,
        target,
        ignore_index=-100,
        reduction="none",
        accum_dtype=torch.float32,
        compute_gradients=needs_grad,
        weight_requires_grad=needs_grad and weight.requires_grad,
    )
    if not needs_grad:
        grad_hidden = grad_weight = None
    return loss.float(), grad_hidden, grad_weight


# The model attribute that names the first padded vocabulary row (set by thdpack.hf.load.never_predict_padding).
VOCAB_LIMIT = "thdpack_vocab_limit"

# --- GPTModel: the output layer and compute_language_model_loss bypassed when labels are given ---------------


def use_output_loss(model, impl: str, chunk_tokens: int | None = None) -> None:
    """Make ``model`` (a megatron-core ``GPTModel``) compute its training loss with :func:`linear_cross_entropy`.

    GPTModel's ``_postprocess`` runs the output layer and ``compute_language_model_loss`` when it gets ``labels``;
    it is replaced, on this instance, by one that gives the decoder's hidden states and the output weight (the
    embedding's when tied, as ``GPTModel`` passes it) to :func:`linear_cross_entropy`, with ``loss_mask`` (which
    ``GPTModel.forward`` takes and hands to ``_postprocess``) as the per-token weights. Without labels (logits
    wanted), during inference, on a stage without the output layer or with multi-token prediction, Megatron's own
    ``_postprocess`` runs. ``impl="megatron"`` leaves the model as it is.
    """
    if impl == "megatron":
        return
    if impl not in OUTPUT_LOSSES:
        raise ValueError(f"model.output_loss is {impl!r}: it must be one of {list(OUTPUT_LOSSES)} or auto")
    config = model.config
    for flag in ("defer_embedding_wgrad_compute", "use_mup"):
        if getattr(config, flag, False):
            raise ValueError(
                f"model.output_loss={impl} does not implement {flag}: use model.output_loss=megatron"
            )
    megatron_postprocess = type(model)._postprocess
    model._postprocess = types.MethodType(
        functools.partial(
            _fused_postprocess, megatron_postprocess=megatron_postprocess, impl=impl, chunk=chunk_tokens
        ),
        model,
    )


def _fused_postprocess(self, *, megatron_postprocess: Callable, impl: str, chunk: int | None, **kwargs):
    labels = kwargs.get("labels")
    inference = kwargs.get("inference_context") is not None and not self.training
    if labels is None or inference or not self.post_process or self.config.mtp_num_layers:
        return megatron_postprocess(self, **kwargs)
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    hidden = kwargs["hidden_states"]  # [s, b, h] (s / tp under sequence parallelism)
    layer = self.output_layer
    tp_group = layer.tp_group if hasattr(layer, "tp_group") else None
    tp = dist.get_world_size(tp_group) if tp_group is not None else 1
    if layer.sequence_parallel:
        hidden = gather_from_sequence_parallel_region(
            hidden, tensor_parallel_output_grad=True, group=tp_group
        )
    elif tp > 1:
        hidden = copy_to_tensor_model_parallel_region(hidden, group=tp_group)
    weight = (
        self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else layer.weight
    )
    run_forward_pre_hooks(
        layer, hidden
    )  # the overlapped all-gather of the weight read here, not by calling it
    s, b, h = hidden.shape
    loss_mask = kwargs.get("loss_mask")
    labels = labels.transpose(0, 1).reshape(s * b)  # [b, s] -> the hidden states' [s, b] order
    weights = None if loss_mask is None else loss_mask.transpose(0, 1).reshape(s * b)
    losses = linear_cross_entropy(
        hidden.reshape(s * b, h),
        weight,
        labels,
        weights,
        tp_group=tp_group if tp > 1 else None,
        chunk_tokens=chunk,
        impl=impl,
        vocab_limit=getattr(self, VOCAB_LIMIT, None),
    )
    return losses.view(s, b).transpose(0, 1).contiguous()  # [b, s], as compute_language_model_loss returns


# --- the recipe key -------------------------------------------------------------------------------------------


def resolve_output_loss(model: Mapping, device: str) -> str:
    """``model.output_loss`` made concrete: ``auto`` is ``chunked`` on CUDA (the fp32 logits of Megatron's loss
    cap the token budget there) and ``megatron`` on CPU."""
    name = model.get("output_loss", "auto")
    if name == "auto":
        return "chunked" if device == "cuda" else "megatron"
    return name


def check_output_loss(model: Mapping, parallel: Mapping, device: str) -> None:
    """Start-up check of ``model.output_loss``: a known value, and one this layout and device can run."""
    name = model.get("output_loss", "auto")
    if name != "auto" and name not in OUTPUT_LOSSES:
        raise ValueError(f"model.output_loss is {name!r}: it must be auto or one of {list(OUTPUT_LOSSES)}")
    if name == "liger":
        tp = int(parallel["tensor_model_parallel_size"])
        if tp > 1:
            raise ValueError(
                f"model.output_loss=liger runs without tensor parallelism only (parallel.tensor_model_parallel_size="
                f"{tp}): use model.output_loss=chunked"
            )
        if device != "cuda":
            raise ValueError(
                "model.output_loss=liger needs a CUDA GPU (Triton): use chunked or megatron on CPU"
            )
