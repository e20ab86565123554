"""Where steady training steps leave the GPU idle, and what the host was doing then.

    python benchmarks/step_gaps.py --budget 16384 trainer.precision=fp8
    python benchmarks/step_gaps.py --smoke            # CPU, a tiny model: the whole script in seconds

Trains ``--warmup`` steps of ``llama3_1b`` on the chat mix (``benchmarks/e2e.py``'s packed_budget run), then
profiles ``--steps`` more with the torch profiler *without* draining the GPU first (``trainer.profile_step`` drains
it, so its one step starts idle), and reads the trace: the GPU's span from its first to its last operation, the
time some kernel, copy or memset ran (busy), and every idle gap between them, attributed to the innermost torch
operator the host was in when the gap began. Host time in CUDA launch calls far above their cost (a few us each)
means the launches waited on a full command buffer: the host was ahead and the GPU was the bottleneck.

Writes ``<out>/step_gaps_<tag>_<date>.{json,txt}``.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import heapq
import json
import os
import platform
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from thdpack.training.profiling import busy_and_gaps

sys.path.insert(0, str(Path(__file__).resolve().parent))

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
RUNTIME_CATEGORIES = ("cuda_runtime", "cuda_driver")
MIN_GAP_US = 10.0


def analyse(events: Iterable[Mapping], largest: int = 40) -> dict:
    """The GPU's busy time and idle gaps in a Chrome trace's ``traceEvents`` (times in us).

    A gap is a stretch between GPU operations where none runs; gaps of at least ``MIN_GAP_US`` are attributed to
    the shortest CPU operator of the main thread (the one with most operators) that spans the gap's start, or to
    ``(no op)`` when the host was outside every operator (Python between them, the data, the optimizer's host
    code). ``launch_after_us`` is how long after the gap began the host launched the operation that ended it.
    """
    events = list(events)
    gpu = sorted((e["ts"], e["ts"] + e.get("dur", 0.0), e) for e in events if e.get("cat") in GPU_CATEGORIES)
    runtime = [e for e in events if e.get("cat") in RUNTIME_CATEGORIES]
    calls: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for e in runtime:
        calls[e["name"]][0] += e.get("dur", 0.0)
        calls[e["name"]][1] += 1
    host_calls = {
        name: {"ms": round(total / 1e3, 3), "calls": count}
        for name, (total, count) in sorted(calls.items(), key=lambda kv: -kv[1][0])[:15]
    }
    if not gpu:
        return {"gpu_span_ms": 0.0, "gpu_busy_ms": 0.0, "busy_share": None, "idle_ms": 0.0, "gaps": 0,
                "idle_by_host_op_ms": {}, "largest_gaps": [], "host_runtime_calls": host_calls}  # fmt: skip
    launches = {e.get("args", {}).get("correlation"): e for e in runtime}
    ops = [e for e in events if e.get("cat") == "cpu_op" and "dur" in e]
    main = collections.Counter(e.get("tid") for e in ops).most_common(1)[0][0] if ops else None
    ops = sorted((e for e in ops if e.get("tid") == main), key=lambda e: e["ts"])

    busy, gaps = busy_and_gaps([(start, stop) for start, stop, _ in gpu])
    gaps = [(begin, finish, gpu[i][2]) for begin, finish, i in gaps]
    span = max(stop for _, stop, _ in gpu) - gpu[0][0]

    by_op: collections.Counter = collections.Counter()
    rows, active, next_op = [], [], 0  # active: a heap of (end, duration, name) of the operators begun so far
    for begin, finish, event in gaps:
        while next_op < len(ops) and ops[next_op]["ts"] <= begin:
            o = ops[next_op]
            heapq.heappush(active, (o["ts"] + o["dur"], o["dur"], o["name"]))
            next_op += 1
        while active and active[0][0] < begin:
            heapq.heappop(active)
        length = finish - begin
        if length < MIN_GAP_US:
            continue
        op = min(active, key=lambda a: a[1])[2] if active else "(no op)"
        launch = launches.get(event.get("args", {}).get("correlation"))
        by_op[op] += length
        rows.append({
            "us": round(length, 1), "host_op": op, "next": event.get("name", "")[:80],
            "launched_by": launch["name"] if launch else None,
            "launch_after_us": round(launch["ts"] - begin, 1) if launch else None,
        })  # fmt: skip
    rows.sort(key=lambda r: -r["us"])
    return {
        "gpu_span_ms": round(span / 1e3, 3),
        "gpu_busy_ms": round(busy / 1e3, 3),
        "busy_share": round(busy / span, 4) if span else None,
        "idle_ms": round((span - busy) / 1e3, 3),
        "gaps": len(gaps),
        "idle_in_gaps_under_10us_ms": round(sum(f - b for b, f, _ in gaps if f - b < MIN_GAP_US) / 1e3, 3),
        "idle_by_host_op_ms": {k: round(v / 1e3, 3) for k, v in by_op.most_common(25)},
        "largest_gaps": rows[:largest],
        "host_runtime_calls": host_calls,
    }


def text(report: Mapping) -> str:
    a = report["analysis"]
    lines = [
        f"{report['device']}, {report['setup']}",
        f"{report['setup']['steps']} steps: wall {report['wall_ms']:.0f} ms, GPU span {a['gpu_span_ms']:.0f} ms, "
        f"busy {a['gpu_busy_ms']:.0f} ms ({(a['busy_share'] or 0):.1%}), "
        f"idle {a['idle_ms']:.0f} ms in {a['gaps']} gaps",
        "",
        "idle by the host operator at the gap's start (ms):",
        *(f"  {ms:9.2f}  {op}" for op, ms in a["idle_by_host_op_ms"].items()),
        "",
        "largest gaps (us | host operator | next GPU operation | its launch | launched after us):",
        *(
            f"  {g['us']:9.0f} | {g['host_op']} | {g['next']} | {g['launched_by']} | {g['launch_after_us']}"
            for g in a["largest_gaps"]
        ),
        "",
        "host time in CUDA runtime and driver calls (ms, calls):",
        *(f"  {c['ms']:9.2f} {c['calls']:7d}  {name}" for name, c in a["host_runtime_calls"].items()),
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="llama3_1b")
    parser.add_argument("--budget", default="16384", help="dataset.micro_batch_tokens")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=4, help="steps profiled, after --warmup")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument(
        "--tag", default=None, help="hardware tag in the file name (default: from the GPU name)"
    )
    parser.add_argument("--smoke", action="store_true", help="CPU: tiny_gpt, two steps")
    parser.add_argument("extra", nargs="*", help="recipe overrides")
    args = parser.parse_args()

    from e2e import run_overrides
    from hydra import compose, initialize_config_dir
    from torch.profiler import ProfilerActivity, profile

    from thdpack.training.deferred import DeferredScalars
    from thdpack.training.loop import _shutdown, recipes_dir, setup_run, step_scalars, train_step

    common = [f"model={args.model}", "dataset.seq_length=8192", "dataset.micro_batch_size=2"]
    if args.smoke:
        args.warmup, args.steps, args.budget = 1, 1, "512"
        common = ["model=tiny_gpt", "dataset.seq_length=256", "dataset.max_files=20"]
    steps = args.warmup + args.steps
    common += ["dataset.global_batch_size=32", f"trainer.train_iters={steps}", "trainer.lr_warmup_iters=1",
               "trainer.progress_bar=false"]  # fmt: skip
    overrides = run_overrides(common, "chat", "packed_budget", args.budget, args.extra)
    os.environ.pop("MASTER_PORT", None)
    with initialize_config_dir(str(recipes_dir()), version_base="1.3"):
        run = setup_run(compose("train", overrides=overrides))
    scalars = DeferredScalars(run.runtime.device)
    cuda = run.runtime.device == "cuda"

    def step(i: int) -> None:  # as the training loop runs one: the scalars are read a step later
        losses, outcome = train_step(run, run.data.next_step())
        scalars.push(i, step_scalars(losses, outcome, True, run.step.loss))
        list(scalars.ready())

    try:
        for i in range(1, args.warmup + 1):
            step(i)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            for i in range(args.warmup + 1, steps + 1):
                step(i)
            if cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - start
        trace = args.out / "step_gaps_trace.json"
        args.out.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace))
    finally:
        _shutdown()
    events = json.loads(trace.read_text())["traceEvents"]
    trace.unlink()

    device = torch.cuda.get_device_name() if cuda else platform.processor() or "cpu"
    tag = args.tag or (
        "h200" if "H200" in device else "h100" if "H100" in device else "gpu" if cuda else "cpu"
    )
    import megatron.core

    report = {
        "date": datetime.date.today().isoformat(),
        "device": device,
        "versions": {"torch": torch.__version__, "megatron-core": megatron.core.__version__},
        "setup": {
            "model": "tiny_gpt" if args.smoke else args.model,
            "budget": args.budget,
            "warmup": args.warmup,
            "steps": args.steps,
            "extra": args.extra,
        },  # fmt: skip
        "wall_ms": round(wall * 1e3, 1),
        "analysis": analyse(events),
    }
    stem = args.out / f"step_gaps_{tag}_{report['date']}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    stem.with_suffix(".txt").write_text(text(report))
    print(text(report))


if __name__ == "__main__":
    main()
