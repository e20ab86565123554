"""Loss curves of precision variants on the same data: does FP8 or lower-precision optimizer state change training?

    python benchmarks/loss_curves.py                                   # llama3_1b, bf16 / fp8 / precision-aware
    python benchmarks/loss_curves.py --model tiny_gpt --steps 6 --variants fp32   # a CPU smoke run

Each variant trains the same recipe (same seed, same samples in the same order, same schedule) for ``--steps``
steps with its own overrides, as its own ``python -m thdpack.train`` process. With several GPUs the variants run
side by side, one a GPU (``--gpus 0,1``: variants go round the list; two on one GPU share it). The first variant
is the baseline: the report gives, per variant, the loss over the last ``--window`` steps (mean) against the
baseline's, the largest per-step loss difference after the first ``--window`` steps, the steps whose update was
skipped, real tokens/s (meaningless when variants share a GPU: it is reported, not compared) and peak memory.
Writes ``<out>/loss_curves[-<label>]_<device>_<date>.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

# name -> recipe overrides; the first one given is the baseline
VARIANTS = {
    "bf16": ["trainer.precision=bf16"],
    "fp32": ["trainer.precision=fp32"],
    "fp8": ["trainer.precision=fp8", "trainer.fp8_recipe=tensorwise"],
    "fp8_delayed": ["trainer.precision=fp8", "trainer.fp8_recipe=delayed"],
    "precision_aware": [
        "trainer.precision=bf16",
        "trainer.use_precision_aware_optimizer=true",
        "trainer.exp_avg_dtype=bf16",
        "trainer.exp_avg_sq_dtype=bf16",
    ],
}


def common_overrides(args) -> list[str]:
    return [
        f"model={args.model}",
        "dataset=embedded",
        f"dataset.seq_length={args.seq_length}",
        f"dataset.global_batch_size={args.global_batch_size}",
        f"dataset.micro_batch_tokens={args.micro_batch_tokens}",
        f"trainer.train_iters={args.steps}",
        f"trainer.lr={args.lr}",
        f"trainer.min_lr={args.lr / 10:g}",
        f"trainer.lr_warmup_iters={max(1, args.steps // 10)}",
        "trainer.progress_bar=false",
        *args.extra,
    ]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(name: str, overrides: list[str], work: Path, gpu: str | None) -> tuple[subprocess.Popen, Path]:
    run_dir = work / name
    if run_dir.exists():
        for path in run_dir.iterdir():  # metrics.jsonl appends: an empty run directory
            if path.is_file():
                path.unlink()
    run_dir.mkdir(parents=True, exist_ok=True)
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
        "PYTHONUNBUFFERED": "1",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
    }
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    command = [sys.executable, "-m", "thdpack.train", *overrides, f"hydra.run.dir={run_dir}"]
    (run_dir / "command.txt").write_text(" ".join(command) + "\n")
    log = open(run_dir / "train.log", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT), run_dir


def read_run(run_dir: Path) -> dict:
    path = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    return {"records": [r for r in records if "loss" in r], "summary": summary}


def compare(runs: dict[str, dict], window: int, codes: dict[str, int]) -> dict[str, dict]:
    """Per variant: last-window mean loss, its relative difference to the baseline's, the largest per-step
    difference after the first ``window`` steps. A run whose process failed is ``failed``, with the steps it
    logged."""
    names = list(runs)
    base = {r["step"]: r["loss"] for r in runs[names[0]]["records"]}
    out = {}
    for name in names:
        records = runs[name]["records"]
        if codes[name] or not records:
            out[name] = {"status": f"failed (exit {codes[name]})", "steps": len(records)}
            continue
        last = records[-window:]
        mean = sum(r["loss"] for r in last) / len(last)
        base_last = [base[r["step"]] for r in last if r["step"] in base]
        base_mean = sum(base_last) / len(base_last) if base_last else None
        later = [
            abs(r["loss"] - base[r["step"]]) for r in records if r["step"] > window and r["step"] in base
        ]
        steady = records[min(3, len(records) - 1) :]
        out[name] = {
            "status": "ok",
            "steps": len(records),
            "first_loss": records[0]["loss"],
            "final_window_mean_loss": mean,
            "final_window_rel_diff_vs_baseline": (mean - base_mean) / base_mean if base_mean else None,
            "max_abs_step_diff_after_window": max(later) if later else None,
            "skipped_updates": sum(bool(r.get("skipped")) for r in records),
            "real_tokens_per_s": sum(r["real_tokens"] for r in steady)
            / sum(r["step_time_s"] for r in steady),
            "peak_memory_gib": runs[name]["summary"].get("peak_memory_gib"),
        }
    return out


def plot(runs: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, run in runs.items():
        ax.plot([r["step"] for r in run["records"]], [r["loss"] for r in run["records"]], label=name, lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def versions() -> dict:
    import importlib.metadata as md
    import platform

    found = {"python": platform.python_version()}
    for name in ("torch", "megatron-core", "transformer-engine"):
        try:
            found[name] = md.version(name)
        except md.PackageNotFoundError:
            found[name] = None
    return found


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama3_1b")
    parser.add_argument("--variants", default="bf16,fp8,precision_aware", help=f"from {list(VARIANTS)}")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("--seq-length", type=int, default=8192)
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--micro-batch-tokens", type=int, default=16384)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--gpus", default=None, help="e.g. 0,1: variants go round these GPUs (default: all)")
    parser.add_argument("--work", type=Path, default=REPO / "outputs" / "loss_curves")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--label")
    parser.add_argument("extra", nargs="*", help="recipe overrides for every variant")
    args = parser.parse_args(argv)
    kinds = args.variants.split(",")
    unknown = [n for n in kinds if n not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    # a variant given again is a second run of it (its run-to-run spread): bf16, bf16_2, ...
    names = [k if kinds[:i].count(k) == 0 else f"{k}_{kinds[:i].count(k) + 1}" for i, k in enumerate(kinds)]
    recipe = dict(zip(names, kinds, strict=True))

    import torch

    on_gpu = torch.cuda.is_available()
    gpus = (args.gpus.split(",") if args.gpus else [str(i) for i in range(torch.cuda.device_count())]) or [
        None
    ]
    common = common_overrides(args)
    started = time.perf_counter()
    procs = {}
    for i, name in enumerate(names):
        procs[name] = start(
            name, [*common, *VARIANTS[recipe[name]]], args.work, gpus[i % len(gpus)] if on_gpu else None
        )
        print(f"== {name} on GPU {gpus[i % len(gpus)]}" if on_gpu else f"== {name}", flush=True)
    codes = {name: proc.wait() for name, (proc, _) in procs.items()}
    runs = {name: read_run(run_dir) for name, (_, run_dir) in procs.items()}
    for name, code in codes.items():
        if code:
            tail = (procs[name][1] / "train.log").read_text(errors="replace").splitlines()[-15:]
            print(f"   {name} failed ({code}):\n   | " + "\n   | ".join(tail), flush=True)
    results = compare(runs, args.window, codes)
    device = torch.cuda.get_device_name(0) if on_gpu else "cpu"
    tag = "h200" if "H200" in device else "h100" if "H100" in device else "gpu" if on_gpu else "cpu"
    date = datetime.now(timezone.utc).isoformat(timespec="seconds")
    payload = {
        "date": date,
        "device": device,
        "versions": versions(),
        "setup": {
            "model": args.model,
            "variants": {n: VARIANTS[recipe[n]] for n in names},
            "common_overrides": common,
            "steps": args.steps,
            "window": args.window,
            "side_by_side_on": gpus if on_gpu else None,
        },
        "wall_s": time.perf_counter() - started,
        "results": results,
        "losses": {n: [r["loss"] for r in runs[n]["records"]] for n in names},
    }
    stem = args.out / f"loss_curves{'-' + args.label if args.label else ''}_{tag}_{date[:10]}"
    args.out.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(payload, indent=1) + "\n")
    plot(runs, stem.with_suffix(".png"))
    lines = [
        f"# Loss curves: {', '.join(names)} on {args.model}, {device}, {date[:10]}",
        "",
        ", ".join(f"{k} {v}" for k, v in payload["versions"].items())
        + f". Baseline {names[0]}; common overrides: `{' '.join(common)}`.",
        "",
        f"| variant | steps | first loss | mean loss, last {args.window} | rel. diff vs {names[0]} "
        f"| max abs step diff after step {args.window} | skipped | real tok/s | peak GiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        if r["status"] != "ok":
            lines.append(f"| {name} | {r['status']} after {r['steps']} steps | - | - | - | - | - | - | - |")
            continue
        rel, diff, peak = (
            r["final_window_rel_diff_vs_baseline"],
            r["max_abs_step_diff_after_window"],
            r["peak_memory_gib"],
        )
        lines.append(
            f"| {name} | {r['steps']} | {r['first_loss']:.4f} | {r['final_window_mean_loss']:.4f} | "
            f"{'-' if rel is None else f'{rel:+.2%}'} | {'-' if diff is None else f'{diff:.4f}'} | "
            f"{r['skipped_updates']} | {r['real_tokens_per_s']:,.0f} | {'-' if peak is None else f'{peak:.1f}'} |"
        )
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {stem}.json, .md, .png")
    if any(codes.values()):
        raise SystemExit(1)
    return stem


if __name__ == "__main__":
    main()
