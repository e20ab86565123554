"""Megatron's optimizer step with the gradient norm, the clipping and the non-finite skip on the device.

megatron-core's ``optimizer.step()`` reads the global gradient norm back to the host to clip
(``clip_grads.get_grad_norm_fp32``: ``total_norm.item()``) and to decide whether to step: one host-device sync
a step, which stalls the GPU until the step's backward has finished. :class:`OptimizerStep` keeps all three on
the device:

- the norm: squared per-tensor norms of the gradients Megatron counts (``get_grads_for_grad_norm``: no
  shared or tensor-parallel-duplicate parameter), summed and all-reduced over the optimizer's
  ``get_grad_stats_parallel_group()`` (the whole distributed-optimizer instance), as Megatron does;
- the clipping: the coefficient ``clamp(clip_grad / (norm + 1e-6), max=1)`` multiplied into the gradients
  (Megatron multiplies by the same coefficient when it is below 1);
- the skip: a non-finite norm sets ``found_inf``, which torch's fused Adam kernel reads on the device and then
  leaves parameters, moments and step counts as they were (Transformer Engine's ``FusedAdam`` ignores its
  no-op flag outside its CUDA-graph mode, so the Adam update itself runs through
  ``torch._fused_adamw_`` on the optimizer's own state tensors; the checkpoint format is unchanged).

Where the update cannot be gated on the device (a loss scaler, TE's precision-aware optimizer with master
weights or low-precision moments, an optimizer other than Adam), the step reads ``found_inf`` on the host:
one sync, named by :attr:`OptimizerStep.host_read_reason`. On CPU the step is Megatron's own sequence (exactly
the numbers of ``optimizer.step()``): there a host read costs nothing.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["OptimizerStep", "StepOutcome"]

# megatron.core.optimizer.clip_grads.clip_grad_by_total_norm_fp32
CLIP_EPS = 1.0e-6


@dataclass(frozen=True)
class StepOutcome:
    """One optimizer step, as 0-dim fp32 tensors on the step's device (nothing read back to the host)."""

    grad_norm: torch.Tensor  # the global gradient norm before clipping
    skipped: torch.Tensor  # 1.0 when the update was held back (non-finite norm), else 0.0


class OptimizerStep:
    """``step()``: Megatron's optimizer step over ``optimizer`` (a ``DistributedOptimizer`` or a
    ``ChainedOptimizer`` of them) with the norm, clipping and skip decision on the device.

    ``gate_on_device``: None = on CUDA when the optimizer allows it (see the module docstring); True forces the
    device path (tests run it on CPU); False = Megatron's host sequence.
    """

    def __init__(self, optimizer, device: str, gate_on_device: bool | None = None) -> None:
        self.optimizer = optimizer
        self.subs = [
            s for s in getattr(optimizer, "chained_optimizers", [optimizer]) if _inner(s) is not None
        ]
        self.device = torch.device(device if device != "cuda" else f"cuda:{torch.cuda.current_device()}")
        reason = _why_not_gated(self.subs)
        if gate_on_device is None:
            gate_on_device = device == "cuda" and reason is None
        elif gate_on_device and reason is not None:
            raise ValueError(f"the optimizer step cannot be gated on the device: {reason}")
        self.gated = gate_on_device
        self.host_read_reason = None if gate_on_device else (reason or f"on {device}, Megatron's own step")
        self.found_inf = torch.zeros((), dtype=torch.float32, device=self.device)
        self.skipped_total = torch.zeros((), dtype=torch.float32, device=self.device)
        self._te_step: torch.Tensor | None = None  # TE FusedAdam's step count, one tensor for every group
        self._grad_scales: dict[int, torch.Tensor | None] = {}

    @torch.no_grad()
    def step(self) -> StepOutcome:
        """Prepare the gradients, compute the norm, clip, and update unless the norm is not finite."""
        if not self.gated and self.device.type == "cpu":
            return self._megatron_step()
        found_inf_on_host = bool(self.optimizer.prepare_grads())  # False without a loss scaler: no read
        norm = self.grad_norm()
        finite = torch.isfinite(norm)
        self.found_inf.copy_((~finite).float())
        if found_inf_on_host:
            self.found_inf.fill_(1.0)
        coefficients = {
            id(sub): torch.where(finite, (sub.config.clip_grad / (norm + CLIP_EPS)).clamp(max=1.0), 1.0)
            for sub in self.subs
            if sub.config.clip_grad > 0.0
        }
        if self.gated:
            # the clipping coefficient goes into the Adam kernel (it divides each gradient by grad_scale): no
            # extra pass over the gradients, and a coefficient of 1 leaves them bit for bit as they are
            self._grad_scales = {
                id(_inner(sub)): coefficients[id(sub)].reciprocal() if id(sub) in coefficients else None
                for sub in self.subs
            }
            self._advance_te_steps()
            with self._gated_inner_steps():
                self.optimizer.step_with_ready_grads()
        else:
            for sub in self.subs:
                grads = [p.grad for p in sub.get_parameters() if p.grad is not None]
                if id(sub) in coefficients and grads:
                    torch._foreach_mul_(grads, coefficients[id(sub)])
            if not bool(self.found_inf):  # the one host read of this path
                self.optimizer.step_with_ready_grads()
        self.skipped_total += self.found_inf
        return StepOutcome(grad_norm=norm, skipped=self.found_inf.clone())

    def grad_norm(self) -> torch.Tensor:
        """The global L2 norm of the gradients Megatron counts, all-reduced, as a 0-dim fp32 device tensor."""
        groups = [sub.get_grad_stats_parallel_group() for sub in self.subs]
        if all(group == groups[0] for group in groups):
            grads = [g for sub in self.subs for g in _grads_for_norm(sub)]
            return self._squared_norm(grads, groups[0] if groups else None).sqrt()
        # ChainedOptimizer with different statistics groups (megatron-core: sqrt of the summed squares)
        squares = [
            self._squared_norm(_grads_for_norm(sub), group)
            for sub, group in zip(self.subs, groups, strict=True)
        ]
        return torch.stack(squares).sum().sqrt()

    def _squared_norm(self, grads: list[torch.Tensor], group) -> torch.Tensor:
        if grads:
            # the structure of megatron's multi_tensor_l2norm: the norm of the per-tensor norms, squared
            total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))).square()
        else:
            total = torch.zeros((), dtype=torch.float32, device=self.device)
        total = total.to(torch.float32).reshape(1)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total[0]

    def _megatron_step(self) -> StepOutcome:
        """Megatron's sequence with its host reads: ``prepare_grads``, ``get_grad_norm`` (a Python float),
        clip by that float, ``step_with_ready_grads``; the numbers of ``optimizer.step()``."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        found_inf = self.optimizer.prepare_grads()
        norm = float(self.optimizer.get_grad_norm())
        skipped = bool(found_inf) or not math.isfinite(norm)
        if not skipped:
            for sub in self.subs:
                params = sub.get_parameters()
                if sub.config.clip_grad > 0.0 and params:
                    clip_grad_by_total_norm_fp32(params, max_norm=sub.config.clip_grad, total_norm=norm)
            self.optimizer.step_with_ready_grads()
        self.found_inf.fill_(float(skipped))
        self.skipped_total += self.found_inf
        return StepOutcome(
            grad_norm=torch.tensor(norm, dtype=torch.float32, device=self.device),
            skipped=self.found_inf.clone(),
        )

    @contextlib.contextmanager
    def _gated_inner_steps(self):
        """Megatron's ``step_with_ready_grads`` calls each inner optimizer's ``step()`` and then copies the main
        parameters into the model's (a copy that leaves a skipped step's parameters as they were): for that call,
        the inner ``step`` is the gated Adam update."""
        inners = [_inner(sub) for sub in self.subs]
        for inner in inners:
            inner.step = lambda inner=inner: self._gated_adam(inner)
        try:
            yield
        finally:
            for inner in inners:
                del inner.step

    def _gated_adam(self, inner) -> None:
        te = _is_te_fused_adam(inner)
        for group in inner.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            states = [_adam_state(inner, p, te) for p in params]
            if te:
                steps = [self._te_step] * len(params)
                decoupled = bool(inner.adam_w_mode)
            else:
                steps = [s["step"] for s in states]
                torch._foreach_add_(steps, 1.0 - self.found_inf)  # read by the kernel only when it updates
                decoupled = bool(group.get("decoupled_weight_decay", isinstance(inner, torch.optim.AdamW)))
            update = torch._fused_adamw_ if decoupled else torch._fused_adam_
            beta1, beta2 = group["betas"]
            update(
                params,
                [p.grad for p in params],
                [s["exp_avg"] for s in states],
                [s["exp_avg_sq"] for s in states],
                [],
                steps,
                lr=float(group["lr"]),
                beta1=float(beta1),
                beta2=float(beta2),
                weight_decay=float(group["weight_decay"]),
                eps=float(group["eps"]),
                amsgrad=False,
                maximize=False,
                grad_scale=self._grad_scales[id(inner)],
                found_inf=self.found_inf,
            )

    def _advance_te_steps(self) -> None:
        """TE's FusedAdam counts steps in each param group (a Python int). The gated update keeps the count on the
        device, one tensor object in every group of every TE optimizer, so that Megatron's checkpointing (the set
        of the groups' steps, then ``int()`` of it) sees one step and reads it once, at save. A group that holds an
        int (a fresh optimizer, or one just loaded from a checkpoint) sets the count."""
        groups = [g for sub in self.subs if _is_te_fused_adam(_inner(sub)) for g in _inner(sub).param_groups]
        if not groups:
            return
        loaded = {
            int(g.get("step", 0)) for g in groups if g["params"] and not torch.is_tensor(g.get("step", 0))
        }
        if len(loaded) > 1:
            raise RuntimeError(
                f"the optimizer's param groups disagree on the Adam step count: {sorted(loaded)}"
            )
        if self._te_step is None or loaded:
            start = loaded.pop() if loaded else 0
            self._te_step = torch.full((), float(start), dtype=torch.float32, device=self.device)
        for group in groups:
            group["step"] = self._te_step
        self._te_step.add_(1.0 - self.found_inf)  # read by the kernel only when it updates


def _inner(sub):
    return getattr(sub, "optimizer", None)


def _grads_for_norm(sub) -> list[torch.Tensor]:
    """The gradients Megatron's norm counts: ``get_main_grads_for_grad_norm`` in megatron-core 0.16, renamed
    ``get_grads_for_grad_norm`` by 0.19 (which also leaves out multi-token-prediction parameters, clipped apart)."""
    method = getattr(sub, "get_grads_for_grad_norm", None) or sub.get_main_grads_for_grad_norm
    return method()


def _is_te_fused_adam(inner) -> bool:
    return type(inner).__name__ == "FusedAdam" and type(inner).__module__.startswith("transformer_engine")


def _why_not_gated(subs) -> str | None:
    """Why the Adam update cannot be gated on the device (None when it can)."""
    for sub in subs:
        inner = _inner(sub)
        if getattr(sub, "grad_scaler", None) is not None:
            return "a loss scaler (fp16) decides the skip on the host"
        if getattr(sub.config, "use_precision_aware_optimizer", False):
            return "TE's precision-aware FusedAdam (master weights, low-precision moments) has no device skip"
        if _is_te_fused_adam(inner):
            if inner.master_weights or inner.capturable:
                return "TE FusedAdam with master weights or capturable state"
            if any(not g.get("bias_correction", True) for g in inner.param_groups):
                return "TE FusedAdam without bias correction"
            continue
        if isinstance(inner, torch.optim.Adam):
            if any(g.get("amsgrad") or g.get("maximize") for g in inner.param_groups):
                return "torch Adam with amsgrad or maximize"
            continue
        return f"the inner optimizer is {type(inner).__name__}, not Adam"
    return None


def _adam_state(inner, param, te: bool) -> dict:
    """The parameter's Adam state, created as the inner optimizer would (zero moments; torch: a step count)."""
    state = inner.state[param]
    if not state:
        if te:
            inner.initialize_state(param, False)
        else:
            state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    if not te and state["step"].device != param.device:
        # torch keeps a CPU step for its unfused kernels; the fused kernel reads it on the parameter's device
        state["step"] = state["step"].to(param.device, torch.float32)
    return state
