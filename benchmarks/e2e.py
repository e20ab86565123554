"""End to end: does packing pay in training? The recipes run packed and padded on the same samples.

    python benchmarks/e2e.py                                  # llama3_1b, three length mixes, four batchings
    python benchmarks/e2e.py --model tiny_gpt --steps 4 --mixes embedded   # a CPU smoke run

For each length mix (the embedded corpus; chat-like lognormal: median 700, sigma 1.0, 32-8192; Megatron-LM's
synthetic spec: lognormal of mean 1024, sigma 1.5, 128-8192) and each batching of the same global batches:

* ``padded_seq``: padded BSHD rows of ``seq_length`` (Megatron's default), ``micro_batch_size`` per micro-batch;
* ``padded_longest``: padded to the longest sample of each micro-batch;
* ``packed_samples``: packed, ``micro_batch_size`` samples per micro-batch;
* ``packed_budget``: packed, micro-batches filled to ``micro_batch_size x seq_length`` tokens (equal memory).

Reported per run (steady-state steps, after ``--warmup``): real tokens/s, step time, peak memory, model TFLOP/s
per GPU on real tokens, one profiled step (wall against GPU busy time, host time in operators, kernel launches,
host-device syncs), the packer's host time per step (``get_batch``: pack, CP shard, copies), and the ideal
speedup over ``padded_seq`` from the FLOPs model (``thdpack.training.flops``) with ``fraction_of_ideal`` = measured /
ideal. Writes ``<out>/e2e_<gpu>_<date>.json`` (``headline``: ``packed_budget`` against ``padded_seq``),
``.md`` and ``.png``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

MIXES = {
    "embedded": ["dataset=embedded"],
    "chat": [
        "dataset=synthetic",
        "dataset.synthetic.median=700",
        "dataset.synthetic.sigma=1.0",
        "dataset.synthetic.min_length=32",
    ],
    "megatron": [
        "dataset=synthetic",
        "~dataset.synthetic.median",
        "+dataset.synthetic.mean=1024",
        "dataset.synthetic.sigma=1.5",
        "dataset.synthetic.min_length=128",
    ],
}
MODES = {
    "padded_seq": ["dataset.pack_sequences_in_batch=false", "dataset.pad_to=seq_length"],
    "padded_longest": ["dataset.pack_sequences_in_batch=false", "dataset.pad_to=longest"],
    "packed_samples": ["dataset.pack_sequences_in_batch=true", "dataset.micro_batch_tokens=null"],
    "packed_budget": [
        "dataset.pack_sequences_in_batch=true",
        "dataset.micro_batch_tokens={budget}",
        "dataset.pad_to=longest",
    ],
}
# The keys each mode sets: an extra override of one would change what the mode means.
MODE_KEYS = ("dataset.pack_sequences_in_batch", "dataset.micro_batch_tokens", "dataset.pad_to")


def run_overrides(common: list[str], mix: str, mode: str, budget: str, extra: list[str]) -> list[str]:
    """One run's recipe overrides: the common ones, the length mix, the batching mode (``packed_budget`` at
    ``budget`` tokens), then the command line's extra overrides, which win over all but the mode's own keys (an
    extra override of those is refused: use ``--budget`` or ``--modes``)."""
    for override in extra:
        key = override.lstrip("+~").split("=", 1)[0]
        if key in MODE_KEYS:
            raise SystemExit(
                f"e2e: the extra override {override!r} sets a key each batching mode sets itself ({key}): give the "
                "packed_budget token budget with --budget, and choose batchings with --modes"
            )
    return [*common, *MIXES[mix], *(o.format(budget=budget) for o in MODES[mode]), *extra]


def run_one(overrides: list[str], run_dir: Path) -> dict:
    """Train the composed recipe in this process; return its summary, its records and the packer's host time."""
    from hydra import compose, initialize_config_dir

    from thdpack.megatron import step
    from thdpack.training import loop as train_module

    with initialize_config_dir(str(train_module.recipes_dir()), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    packer_s: list[float] = []
    get_batch = step.get_batch

    def timed_get_batch(*args, **kwargs):
        start = time.perf_counter()
        try:
            return get_batch(*args, **kwargs)
        finally:
            packer_s.append(time.perf_counter() - start)

    step.get_batch = timed_get_batch
    shutil.rmtree(run_dir, ignore_errors=True)  # metrics.jsonl appends: start from an empty run directory
    os.environ.pop("MASTER_PORT", None)  # a fresh store for each run of this process
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    try:
        summary = train_module.train(cfg, run_dir)
    finally:
        step.get_batch = get_batch
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"summary": summary, "records": records, "packer_calls_s": packer_s}


def measure(result: dict, warmup: int) -> dict:
    steady = [r for r in result["records"] if r["step"] > warmup]
    time_s = sum(r["step_time_s"] for r in steady)
    real = sum(r["real_tokens"] for r in steady)
    profiled = next((r for r in result["records"] if "profile_wall_s" in r), {})
    steps = len(result["records"])
    # get_batch's calls are not tied to steps: their mean over every step, warm-up included (an upper bound)
    packer_per_step = sum(result["packer_calls_s"]) / max(steps, 1)
    summary = result["summary"]
    out = {
        "steps_measured": len(steady),
        "step_time_s": time_s / len(steady),
        "real_tokens_per_s": real / time_s,
        "all_tokens_per_s": sum(r["all_tokens"] for r in steady) / time_s,
        "pad_fraction": 1 - real / sum(r["all_tokens"] for r in steady),
        "tflops_per_gpu_real": float(np.mean([r["tflops"] for r in steady])),
        "peak_memory_gib": summary.get("peak_memory_gib"),
        "peak_reserved_gib": summary.get("peak_reserved_gib"),
        "alloc_retries": summary.get("alloc_retries"),
        "final_loss": summary.get("final_loss"),
        "packer_host_s_per_step": packer_per_step,
        "packer_share_of_step": packer_per_step / (time_s / len(steady)),
        "profiled_step": {
            k.removeprefix("profile_"): v for k, v in profiled.items() if k.startswith("profile_")
        },
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama3_1b")
    parser.add_argument("--mixes", default=",".join(MIXES))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--seq-length", type=int, default=8192)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--global-batch-size", type=int, default=32)
    # Host-timed steps of a packed run vary (0.14-0.97 s around a 0.56 s mean for llama3_1b on an H100: the host runs
    # ahead of the GPU, and new shapes cost one-time work early in a run): time many steps after a long warm-up.
    parser.add_argument("--steps", type=int, default=12, help="steady-state steps timed (after --warmup)")
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument(
        "--budget",
        default="auto",
        help="packed_budget's dataset.micro_batch_tokens (auto = micro_batch_size x seq_length, fit, or a number)",
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--tag", default=None, help="hardware tag in file names (default: from the GPU name)")
    parser.add_argument("--work", type=Path, default=Path("outputs/e2e"), help="run directories")
    parser.add_argument("--combine", type=Path, nargs="+", help="merge these e2e JSON files into one report")
    parser.add_argument(
        "--notes", type=Path, help="with --combine: a markdown file of findings for the report"
    )
    parser.add_argument("extra", nargs="*", help="recipe overrides for every run")
    args = parser.parse_args()
    if args.combine:
        combine(args.combine, args.out, args.notes)
        return

    from hydra import compose, initialize_config_dir

    from thdpack.megatron.config import padded_vocab_size, transformer_config
    from thdpack.megatron.runtime import Runtime
    from thdpack.training.flops import FlopsModel
    from thdpack.training.loop import recipes_dir

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    tag = args.tag or (
        "h200" if "H200" in gpu else "h100" if "H100" in gpu else "cpu" if gpu == "cpu" else "gpu"
    )
    steps = args.warmup + args.steps
    common = [
        f"model={args.model}",
        f"dataset.seq_length={args.seq_length}",
        f"dataset.micro_batch_size={args.micro_batch_size}",
        f"dataset.global_batch_size={args.global_batch_size}",
        f"trainer.train_iters={steps}",
        "trainer.lr_warmup_iters=1",
        "trainer.progress_bar=false",
        f"trainer.profile_step={args.warmup + 2}",
    ]
    with initialize_config_dir(str(recipes_dir()), version_base="1.3"):
        cfg = compose("train", overrides=[*common, *args.extra])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = transformer_config(
        cfg.model, cfg.parallel, Runtime(device, "bf16" if device == "cuda" else "fp32", "torch")
    )
    from thdpack.data import build_tokenizer

    flops = FlopsModel.of(config, padded_vocab_size(cfg.model, build_tokenizer("byte").vocab_size, 1))

    results: dict[str, dict] = {}
    for mix in args.mixes.split(","):
        results[mix] = {}
        for mode in args.modes.split(","):
            run_dir = args.work / mix / mode
            overrides = run_overrides(common, mix, mode, args.budget, args.extra)
            print(f"== {mix} / {mode}: {' '.join(overrides)}", flush=True)
            result = run_one(overrides, run_dir)
            results[mix][mode] = measure(result, args.warmup)
            results[mix][mode]["records"] = result["records"]
            m = results[mix][mode]
            print(
                f"   {m['real_tokens_per_s']:,.0f} real tok/s, {m['step_time_s']:.3f} s/step, "
                f"{m['tflops_per_gpu_real']:.0f} TFLOP/s, peak {m['peak_memory_gib'] or 0:.1f} GiB, "
                f"packer {m['packer_share_of_step']:.2%}, profiled {m['profiled_step']}",
                flush=True,
            )
        add_ideal(results[mix], flops, args)
    write_report(results, args, gpu, tag, flops)


def add_ideal(by_mode: dict, flops, args) -> None:
    """Ideal speedup of each mode over ``padded_seq`` from the FLOPs model, on the same steady-state steps, and
    ``fraction_of_ideal`` = measured speedup / ideal speedup."""
    if "padded_seq" not in by_mode:
        return
    base = by_mode["padded_seq"]
    steady = [r for r in base["records"] if r["step"] > args.warmup]
    # the padded run computes every row at seq_length; the packed ones compute the real tokens only
    padded_flops = sum(flops.padded_training_flops(r["samples"], args.seq_length) for r in steady)
    real_flops = sum(r["model_flops"] for r in steady)
    for mode, m in by_mode.items():
        if mode == "padded_longest":
            ideal = None  # needs each micro-batch's longest sample; reported as measured only
        else:
            ideal = padded_flops / real_flops if mode.startswith("packed") else 1.0
        measured = m["real_tokens_per_s"] / base["real_tokens_per_s"]
        m["speedup_over_padded_seq"] = measured
        m["ideal_speedup"] = ideal
        m["fraction_of_ideal"] = measured / ideal if ideal else None


def combine(paths: list[Path], out: Path, notes: Path | None = None) -> None:
    """One report from several runs of this script (e.g. one length mix per device call)."""
    payloads = [json.loads(p.read_text()) for p in paths]
    payload = payloads[0]
    for other in payloads[1:]:
        if other["setup"] != payload["setup"] or other["device"] != payload["device"]:
            raise ValueError(f"cannot combine runs of different setups or devices: {paths}")
        payload["results"].update(other["results"])
    payload["headline"] = _headline(payload["results"])
    if notes is not None:
        payload["notes"] = notes.read_text()
    _write(payload, out, payload["tag"])


def _headline(results: dict) -> dict:
    keys = (
        "fraction_of_ideal",
        "speedup_over_padded_seq",
        "ideal_speedup",
        "tflops_per_gpu_real",
        "packer_share_of_step",
    )
    headline = {}
    for mix, by_mode in results.items():
        budget = by_mode.get("packed_budget", {})
        headline[mix] = {k: budget.get(k) for k in keys}
        headline[mix]["steady_state_syncs"] = budget.get("profiled_step", {}).get("syncs")
        padded = by_mode.get("padded_seq", {})
        headline[mix]["peak_memory_gib_packed_vs_padded"] = [
            budget.get("peak_memory_gib"),
            padded.get("peak_memory_gib"),
        ]
    return headline


def write_report(results: dict, args, gpu: str, tag: str, flops) -> None:
    import importlib.metadata as md

    def version(name):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    results = {
        mix: {mode: {k: v for k, v in m.items() if k != "records"} for mode, m in by_mode.items()}
        for mix, by_mode in results.items()
    }
    payload = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "tag": tag,
        "device": gpu,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "megatron-core": version("megatron-core"),
            "transformer-engine": version("transformer-engine") or version("transformer_engine"),
            "thdpack": version("thdpack"),
        },
        "setup": {
            "model": args.model,
            "seq_length": args.seq_length,
            "micro_batch_size": args.micro_batch_size,
            "global_batch_size": args.global_batch_size,
            "steps": args.steps,
            "warmup": args.warmup,
            "budget": args.budget,
            "extra": args.extra,
            "flops_model": {"gemm_params": flops.gemm_params, "attn_coeff": flops.attn_coeff},
        },
        "headline": _headline(results),
        "results": results,
    }
    _write(payload, args.out, tag)


def _write(payload: dict, out: Path, tag: str) -> None:
    results, setup = payload["results"], payload["setup"]
    date = payload["date"][:10]
    stem = out / f"e2e_{tag}_{date}"
    out.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(payload, indent=2) + "\n")
    gpu, versions = payload["device"], payload["versions"]
    lines = [
        f"# End-to-end packing benchmark: {setup['model']} on {gpu}, {date}",
        "",
        f"torch {versions['torch']}, megatron-core {versions['megatron-core']}, Transformer "
        f"Engine {versions['transformer-engine']}; seq_length {setup['seq_length']}, micro_batch_size "
        f"{setup['micro_batch_size']}, global_batch_size {setup['global_batch_size']} samples, {setup['steps']} "
        f"timed steps after {setup['warmup']}. Extra overrides: `{' '.join(setup['extra'])}`.",
        "",
        "| mix | batching | real tok/s | s/step | TFLOP/s/GPU (real) | peak GiB | pad | speedup | ideal | of ideal "
        "| GPU busy | syncs | packer |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mix, by_mode in results.items():
        for mode, m in by_mode.items():
            p = m["profiled_step"]
            busy = p.get("device_busy_s", 0) / p["wall_s"] if p.get("wall_s") else None
            lines.append(
                f"| {mix} | {mode} | {m['real_tokens_per_s']:,.0f} | {m['step_time_s']:.3f} | "
                f"{m['tflops_per_gpu_real']:.3g} | {m['peak_memory_gib'] or 0:.1f} | {m['pad_fraction']:.1%} | "
                f"{_fmt(m.get('speedup_over_padded_seq'), '{:.2f}x')} | {_fmt(m.get('ideal_speedup'), '{:.2f}x')} | "
                f"{_fmt(m.get('fraction_of_ideal'), '{:.2f}')} | {_fmt(busy, '{:.0%}')} | {p.get('syncs', '-')} | "
                f"{m['packer_share_of_step']:.2%} |"
            )
    if payload.get("notes"):
        lines += ["", payload["notes"].rstrip()]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    plot(results, stem.with_suffix(".png"), f"{setup['model']} on {gpu}")
    print("\n".join(lines))
    print(f"wrote {stem}.json, .md, .png")


def _fmt(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def plot(results: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mixes = list(results)
    modes = list(next(iter(results.values())))
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        values = [results[mix][mode]["real_tokens_per_s"] for mix in mixes]
        ax.bar(np.arange(len(mixes)) + i * width, values, width, label=mode)
    ax.set_xticks(np.arange(len(mixes)) + width * (len(modes) - 1) / 2, mixes)
    ax.set(ylabel="real tokens / s", title=title)
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
