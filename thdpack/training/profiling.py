"""One training step under the torch profiler and CUDA's sync check (``trainer.profile_step=N``).

What a step spends, measured where it happens: the step's wall time against the GPU's busy time (kernels and
copies; a step whose GPU is busy for a small part of its wall time is host-bound), the host time spent inside
torch operators, the number of kernel launches, and every host-device synchronization with the line of Python
that caused it (``torch.cuda.set_sync_debug_mode("warn")``). The costliest operators by device time and by host
time go to ``profile_step.txt`` in the run directory.
"""

from __future__ import annotations

import collections
import contextlib
import time
import warnings
from pathlib import Path
from typing import Any

import torch

__all__ = ["StepProfile", "busy_and_gaps", "catch_syncs", "profile"]


@contextlib.contextmanager
def catch_syncs():
    """Record every host-device sync inside the block (``torch.cuda.set_sync_debug_mode("warn")``): yields a
    list that receives ``file:line`` of each sync's Python caller when the block ends."""
    sites: list[str] = []
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield sites
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # Only torch's per-operation warning: its first use in a process also warns that the mode is a prototype.
    sites += [
        f"{Path(w.filename).name}:{w.lineno}"
        for w in caught
        if "synchronizing CUDA operation" in str(w.message)
    ]


class StepProfile:
    def __init__(self) -> None:
        self.profiler = None
        self.wall_s = 0.0
        self.syncs: list[str] = []

    def summary(self, run_dir: Path | None = None) -> dict[str, Any]:
        """The step's measured split (keys ``profile_*``); writes ``profile_step.txt`` into ``run_dir`` if given."""
        events = self.profiler.key_averages()
        host_us = sum(e.self_cpu_time_total for e in events)
        device_us = _busy_us(self.profiler.events())
        launches = sum(
            e.count for e in events if e.key in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel")
        )
        sites = collections.Counter(self.syncs)
        if run_dir is not None:
            tables = [("host", events.table(sort_by="self_cpu_time_total", row_limit=40))]
            if device_us:
                tables.insert(0, ("device", events.table(sort_by="self_cuda_time_total", row_limit=40)))
            lines = [f"{count:5d} x {site}" for site, count in sites.most_common()]
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            (Path(run_dir) / "profile_step.txt").write_text(
                f"wall {self.wall_s * 1e3:.1f} ms, GPU busy {device_us / 1e3:.1f} ms, host in operators "
                f"{host_us / 1e3:.1f} ms, {launches} kernel launches, {len(self.syncs)} syncs\n"
                + ("syncs by site:\n" + "\n".join(lines) + "\n" if lines else "")
                + "".join(f"\noperators by {side} time:\n{table}\n" for side, table in tables)
            )
        return {
            "profile_wall_s": self.wall_s,
            "profile_device_busy_s": device_us / 1e6,
            "profile_host_operator_s": host_us / 1e6,
            "profile_kernel_launches": int(launches),
            "profile_syncs": len(self.syncs),
            "profile_sync_sites": dict(sites.most_common(10)),
        }


def _busy_us(events) -> float:
    """Time the GPU ran anything (kernels, copies, memsets): the union of their intervals, so that work on
    several streams at once counts once."""
    from torch.autograd import DeviceType

    spans = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA)
    return busy_and_gaps(spans)[0]


def busy_and_gaps(spans) -> tuple[float, list[tuple[float, float, int]]]:
    """For ``(start, stop)`` intervals sorted by start: the length of their union, and the gaps between them as
    ``(gap start, gap end, index of the interval that ends it)``."""
    busy, gaps = 0.0, []
    end = spans[0][0] if spans else 0.0
    for i, (start, stop) in enumerate(spans):
        if start > end:
            gaps.append((end, start, i))
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return busy, gaps


@contextlib.contextmanager
def profile(enabled: bool, device: str):
    """Profile the block when ``enabled`` (else a no-op); on CUDA, also count its synchronizations."""
    if not enabled:
        yield None
        return
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    result = StepProfile()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    syncs = catch_syncs() if device == "cuda" else contextlib.nullcontext([])
    with torch_profile(activities=activities) as prof:
        start = time.perf_counter()
        try:
            with syncs as sites:  # closed before the drain below, which is the profiler's own sync
                yield result
        finally:
            if device == "cuda":
                torch.cuda.synchronize()
            result.wall_s = time.perf_counter() - start
    result.profiler = prof
    result.syncs = sites
