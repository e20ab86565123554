"""What a training run writes to its run directory: ``metrics.jsonl`` (one JSON object per logged step),
TensorBoard events (``tensorboard/``), ``summary.json`` and ``curves.png`` (loss and throughput), plus a
progress bar in a terminal or plain log lines otherwise. Only the logging rank (last pipeline stage, first
tensor-, context- and data-parallel rank) writes.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "MetricsWriter",
    "comparison_figure",
    "memory_summary",
    "plot_comparison",
    "plot_curves",
    "summarize",
]

log = logging.getLogger("thdpack")


class MetricsWriter:
    """Per-step records to ``run_dir``; a no-op on ranks that do not log (``enabled=False``)."""

    def __init__(
        self,
        run_dir: Path,
        *,
        enabled: bool,
        total_iters: int,
        start_iter: int,
        progress_bar: str | bool = "auto",
    ):
        self.run_dir, self.enabled = Path(run_dir), enabled
        self.records: list[dict[str, Any]] = []
        self._jsonl = self._tb = self._bar = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # A run killed after its last checkpoint logged steps that the resumed run logs again: one record a step.
        _drop_records_after(self.run_dir / "metrics.jsonl", start_iter)
        self._jsonl = open(self.run_dir / "metrics.jsonl", "a")  # noqa: SIM115 - open for the whole run
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=start_iter + 1)
        except ImportError:  # tensorboard is a dependency; a broken install only loses the events
            log.warning("tensorboard is not importable: no TensorBoard events are written")
        if progress_bar == "auto":
            progress_bar = sys.stderr.isatty()
        if progress_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total_iters, initial=start_iter, unit="it", dynamic_ncols=True)

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.records.append(record)
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        step = record["step"]
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)
        line = _format(record)
        if self._bar is not None:
            self._bar.update(step - self._bar.n)
            self._bar.set_postfix_str(line, refresh=True)
        else:
            log.info("step %d | %s", step, line)

    def close(self, summary: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        self._jsonl.close()
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        steps = [r for r in self.records if "loss" in r]
        if steps:
            plot_curves({"run": steps}, self.run_dir / "curves.png")


def _drop_records_after(path: Path, step: int) -> None:
    """Keep the records of ``path`` up to ``step`` (none for a run that starts at 0); a line cut short by a kill
    goes too."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line + "\n")
        except (ValueError, KeyError, TypeError):
            pass
    path.write_text("".join(kept))


def _format(record: dict[str, Any]) -> str:
    parts = [f"loss {record['loss']:.4f}"] if "loss" in record else []
    if "eval_loss" in record:
        parts.append(f"eval {record['eval_loss']:.4f}")
    for key, fmt in (
        ("lr", "lr {:.2e}"),
        ("grad_norm", "grad {:.3f}"),
        ("real_tokens_per_s", "{:,.0f} real tok/s"),
        ("pad_fraction", "pad {:.1%}"),
        ("step_time_s", "{:.3f} s"),
        ("tflops", "{:.3g} TFLOP/s"),
    ):
        if key in record:
            parts.append(fmt.format(record[key]))
    # dataset.overlong's work since the run began (running totals), on the console as in metrics.jsonl, shown
    # once it happens
    for key, word in (("samples_truncated", "truncated"), ("samples_dropped", "dropped")):
        if record.get(key):
            parts.append(f"{record[key]} {word} so far")
    return " | ".join(parts)


def summarize(records: list[dict[str, Any]], skip_first: int = 1) -> dict[str, float]:
    """Means over the logged steps after the first ``skip_first`` (warm-up), and the last loss."""
    steady = [r for r in records if "step_time_s" in r][skip_first:] or [
        r for r in records if "step_time_s" in r
    ]
    out: dict[str, float] = {}
    if not steady:
        return out
    time = sum(r["step_time_s"] for r in steady)
    out["steps_measured"] = len(steady)
    out["step_time_s"] = time / len(steady)
    out["real_tokens_per_s"] = sum(r["real_tokens"] for r in steady) / time
    out["all_tokens_per_s"] = sum(r["all_tokens"] for r in steady) / time
    out["pad_fraction"] = 1.0 - sum(r["real_tokens"] for r in steady) / sum(r["all_tokens"] for r in steady)
    if all("tflops" in r for r in steady):
        out["tflops"] = float(np.mean([r["tflops"] for r in steady]))
    losses = [r["loss"] for r in records if "loss" in r]
    if losses:
        out["final_loss"] = losses[-1]
    return out


def memory_summary(stats: dict[str, Any] | None = None) -> dict[str, float]:
    """A CUDA run's memory from the caching allocator's statistics (``torch.cuda.memory_stats()``): the peak held by
    tensors, the peak reserved from the device, and how often an allocation found no cached block, freed the cache
    (``cudaFree``: a device synchronization) and retried."""
    if stats is None:
        import torch

        stats = torch.cuda.memory_stats()
    return {
        "peak_memory_gib": stats["allocated_bytes.all.peak"] / 2**30,
        "peak_reserved_gib": stats["reserved_bytes.all.peak"] / 2**30,
        "alloc_retries": int(stats.get("num_alloc_retries", 0)),
    }


def plot_curves(runs: dict[str, list[dict[str, Any]]], path: Path) -> None:
    """Loss and real tokens/s against step, one line per run (``runs``: name -> records)."""
    plt = _pyplot()
    fig, (ax_loss, ax_tps) = plt.subplots(1, 2, figsize=(11, 4))
    for name, records in runs.items():
        steps = [r["step"] for r in records]
        ax_loss.plot(steps, [r["loss"] for r in records], label=name)
        ax_tps.plot(steps, [r["real_tokens_per_s"] for r in records], label=name)
    ax_loss.set(xlabel="step", ylabel="loss (per real token)", title="training loss")
    ax_tps.set(xlabel="step", ylabel="real tokens / s", title="throughput on real tokens")
    _style(fig, (ax_loss, ax_tps))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_comparison(
    packed: list[dict[str, Any]], padded: list[dict[str, Any]], speedup: float, path: Path
) -> None:
    """``python -m thdpack.compare``'s picture (:func:`comparison_figure`) written to ``path``."""
    fig = comparison_figure(packed, padded, speedup)
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)


def comparison_figure(packed: list[dict[str, Any]], padded: list[dict[str, Any]], speedup: float):
    """Both loss curves (the packed one dashed with markers, drawn over the padded one it should cover), their
    per-step difference, and the real tokens/s of each with the measured ``speedup`` in the title; integer steps."""
    plt = _pyplot()
    fig, (ax_loss, ax_diff, ax_tps) = plt.subplots(1, 3, figsize=(15, 4.2))
    styles = {
        "padded": dict(color="tab:orange", linewidth=3.5, alpha=0.55, zorder=2),
        "packed": dict(color="tab:blue", linestyle="--", marker="o", markersize=4, linewidth=1.4, zorder=3),
    }
    for name, records in (("padded", padded), ("packed", packed)):
        steps = [r["step"] for r in records]
        ax_loss.plot(steps, [r["loss"] for r in records], label=name, **styles[name])
        ax_tps.plot(steps, [r["real_tokens_per_s"] for r in records], label=name, **styles[name])
    by_step = {r["step"]: r["loss"] for r in padded}
    steps = [r["step"] for r in packed if r["step"] in by_step]
    diff = [r["loss"] - by_step[r["step"]] for r in packed if r["step"] in by_step]
    ax_diff.axhline(0.0, color="gray", linewidth=0.8)
    ax_diff.plot(steps, diff, color="tab:green", marker="o", markersize=4)
    ax_diff.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    ax_loss.set(xlabel="step", ylabel="loss (per real token)", title="training loss")
    ax_diff.set(xlabel="step", ylabel="packed - padded", title="loss difference, per step")
    ax_tps.set(
        xlabel="step",
        ylabel="real tokens / s",
        title=f"real tokens/s: packed {speedup:.2f}x padded\n(mean over the steps after the first)",
    )
    _style(fig, (ax_loss, ax_diff, ax_tps))
    return fig


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _style(fig, axes) -> None:
    from matplotlib.ticker import MaxNLocator

    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
