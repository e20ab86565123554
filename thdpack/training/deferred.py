"""A step's device scalars reach the host one step later, without blocking the GPU.

The loss, the gradient norm and the skip flag of step ``k`` are device tensors. Reading them at step ``k``
(``float()``, ``.item()``) would make the host wait until the GPU has finished step ``k``, with nothing queued
behind it. Instead :meth:`DeferredScalars.push` copies them (one small tensor) into pinned host memory with
``non_blocking=True`` and records a CUDA event; :meth:`DeferredScalars.ready` hands a step's values back once
``lag`` more steps have been queued, when the event has long completed (its wait is then a formality, and the
GPU already has the next step's work). On CPU the values are read at once (``lag`` 0).

    scalars = DeferredScalars("cuda")
    scalars.push(step, torch.stack([loss, grad_norm]), info={"lr": lr})
    for step, values, info in scalars.ready():      # the steps that are `lag` behind
        ...
    for step, values, info in scalars.drain():      # every step still pending (before a save, at the end)
        ...
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["DeferredScalars"]


class DeferredScalars:
    """Per-step 1-D device tensors, handed back as host lists ``lag`` steps later (``lag``: 1 on CUDA, 0 else)."""

    def __init__(self, device: str, lag: int | None = None) -> None:
        self.cuda = device == "cuda"
        self.lag = (1 if self.cuda else 0) if lag is None else lag
        self._pending: deque[tuple[int, torch.Tensor, Any, dict]] = deque()

    def push(self, step: int, values: torch.Tensor, info: dict | None = None) -> None:
        """Start the copy of ``values`` (read as fp32) to the host; ``info`` (host data) travels along."""
        values = values.detach().to(torch.float32).reshape(-1)
        if self.cuda:
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            host.copy_(values, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host, event = values.clone(), None
        self._pending.append((step, host, event, dict(info or {})))

    def ready(self) -> Iterator[tuple[int, list[float], dict]]:
        """The pending steps older than ``lag``, oldest first, as ``(step, values, info)``."""
        while len(self._pending) > self.lag:
            yield self._pop()

    def drain(self) -> Iterator[tuple[int, list[float], dict]]:
        """Every pending step, oldest first (waits for the GPU to finish them)."""
        while self._pending:
            yield self._pop()

    def __len__(self) -> int:
        return len(self._pending)

    def _pop(self) -> tuple[int, list[float], dict]:
        step, host, event, info = self._pending.popleft()
        if event is not None:
            event.synchronize()
        return step, host.tolist(), info
