"""``python -m thdpack.compare [overrides...]``: the same recipe trained packed and padded, side by side.

Runs ``python -m thdpack.train`` twice with the same seed and samples, ``dataset.pack_sequences_in_batch=true``
then ``false`` (any other overrides apply to both), prints real tokens/s, pad fraction, final loss and time of
each, whether the per-step losses agree, and writes ``compare.png`` (both loss curves, their per-step difference,
and both throughputs with the measured speedup). ``--help`` lists the recipe groups and keys.
Both runs see the same global batches, so on real tokens they compute the same losses; packing only skips pad.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from .metrics import plot_comparison
from .recipe_help import recipe_groups_help

RUNS = {"packed": "true", "padded": "false"}


def run(overrides: list[str], out: Path, nproc: int) -> dict[str, dict]:
    results = {}
    for name, packed in RUNS.items():
        run_dir = out / name
        launcher = [sys.executable, "-m", "thdpack.train"]
        if nproc > 1:
            launcher = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nproc-per-node={nproc}",
                "-m",
                "thdpack.train",
            ]
        command = [
            *launcher,
            f"dataset.pack_sequences_in_batch={packed}",
            f"hydra.run.dir={run_dir}",
            *overrides,
        ]
        print(f"== {name}: {' '.join(command[1:])}", flush=True)
        started = time.perf_counter()
        subprocess.run(command, check=True, env={**os.environ, "THDPACK_RUN_STAMP": out.name})
        wall = time.perf_counter() - started
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        summary = json.loads((run_dir / "summary.json").read_text())
        results[name] = {"records": records, "summary": summary, "wall_s": wall}
    return results


def report(results: dict[str, dict], out: Path) -> str:
    packed, padded = results["packed"], results["padded"]
    rows = [
        ("real tokens/s", "{:,.0f}", "real_tokens_per_s"),
        ("all tokens/s (pad included)", "{:,.0f}", "all_tokens_per_s"),
        ("pad fraction", "{:.1%}", "pad_fraction"),
        ("step time (s)", "{:.3f}", "step_time_s"),
        ("final loss", "{:.4f}", "final_loss"),
    ]
    lines = [f"{'':30} {'packed':>12} {'padded':>12}"]
    for label, fmt, key in rows:
        lines.append(
            f"{label:30} {fmt.format(packed['summary'][key]):>12} {fmt.format(padded['summary'][key]):>12}"
        )
    lines.append(
        f"{'training time (s)':30} {packed['summary']['wall_time_s']:>12.1f} {padded['summary']['wall_time_s']:>12.1f}"
    )
    speedup = packed["summary"]["real_tokens_per_s"] / padded["summary"]["real_tokens_per_s"]
    by_step = {r["step"]: r["loss"] for r in padded["records"] if "loss" in r}
    pairs = [
        (r["loss"], by_step[r["step"]]) for r in packed["records"] if r["step"] in by_step and "loss" in r
    ]
    worst = max((abs(a - b) / max(abs(b), 1e-12) for a, b in pairs), default=float("nan"))
    lines.append(f"packed trains {speedup:.2f}x the real tokens per second of padded")
    lines.append(
        f"per-step losses, packed against padded: largest relative difference {worst:.1e} over {len(pairs)} steps"
    )
    plot_comparison(
        [r for r in packed["records"] if "loss" in r],
        [r for r in padded["records"] if "loss" in r],
        speedup,
        out / "compare.png",
    )
    lines.append(f"curves: {out / 'compare.png'}; runs: {out / 'packed'}, {out / 'padded'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m thdpack.compare",
        usage="%(prog)s [--out DIR] [--nproc N] [group=option ...] [key=value ...]",
        description="Train one recipe packed, then padded (same seed and samples); print both runs' real\n"
        "tokens/s, pad fraction, final loss and time, whether their per-step losses agree, and write compare.png.",
        epilog="Every other argument is a recipe override, applied to both runs.\n\n" + recipe_groups_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="output directory (default outputs/compare-<time>)"
    )
    parser.add_argument("--nproc", type=int, default=1, help="processes per run (torchrun), default 1")
    args, overrides = parser.parse_known_args(argv)
    out = args.out or Path("outputs") / f"compare-{datetime.now().strftime('%Y-%m-%d_%H-%M-%S')}"
    out.mkdir(parents=True, exist_ok=True)
    text = report(run(overrides, out, args.nproc), out)
    (out / "compare.txt").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
