"""Where pack_bshd's time goes: torch.profiler over repeated calls, one table per case and variant.

    python benchmarks/profile_pack.py                 # CPU batch
    python benchmarks/profile_pack.py --device cuda   # GPU batch: host mask -> segments, then the GPU batch
    python benchmarks/profile_pack.py --phases        # median wall time of each step instead

Prints per-call averages of the top operators by self CPU time and the number of kernel launches and
host-to-device copies per call; with ``--phases``, the median time of each step of ``pack_bshd`` run alone
(warm caches, so the steps need not add up to a whole call). Timing numbers belong to
``benchmarks/pack_vs_bridge.py``; this shows the parts.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from pack_vs_bridge import DEFAULT_CASES, make_batch, parse_cases, sample_lengths, time_ms  # this directory
from torch.profiler import ProfilerActivity, profile

import thdpack
from thdpack.packing import assemble
from thdpack.packing.layout import plan_layout

# Runtime and driver entry points a kernel launch may go through.
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--cases", type=parse_cases, default=parse_cases(DEFAULT_CASES))
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--rows", type=int, default=20, help="operators listed per table")
    parser.add_argument("--phases", action="store_true", help="median time of each step instead")
    args = parser.parse_args()
    if args.phases:
        for case in args.cases:
            print_phases(case, args.device, args.calls)
        return
    cuda = args.device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    for case in args.cases:
        host = make_batch(sample_lengths(case.batch_size, case.seq_len, seed=0), case.seq_len, seed=0)
        mask = host["attention_mask"]
        batch = {k: v.to(args.device) for k, v in host.items() if k != "attention_mask"}
        alignment = thdpack.Alignment(cp_size=case.cp_size)

        def call(batch=batch, mask=mask, alignment=alignment):
            return thdpack.pack_bshd(batch, alignment=alignment, segments=thdpack.find_segments(mask))

        for _ in range(5):
            call()
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=activities) as prof:
            for _ in range(args.calls):
                call()
            if cuda:
                torch.cuda.synchronize()
        events = prof.key_averages()
        launches = sum(e.count for e in events if e.key in LAUNCH_CALLS)
        copies = sum(e.count for e in events if e.key == "cudaMemcpyAsync")
        print(
            f"\n== {case.name} on {args.device}: {launches / args.calls:.1f} kernel launches and "
            f"{copies / args.calls:.1f} cudaMemcpyAsync per call (host mask -> find_segments -> pack_bshd)"
        )
        print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))


def print_phases(case, device: str, calls: int) -> None:
    """Each step of ``pack_bshd`` on its own, on a batch built like the benchmark's."""
    cuda = device == "cuda"
    host = make_batch(sample_lengths(case.batch_size, case.seq_len, seed=0), case.seq_len, seed=0)
    mask, position_ids = host["attention_mask"], host["position_ids"]
    batch = {k: v.to(device) for k, v in host.items() if k != "attention_mask"}
    alignment = thdpack.Alignment(cp_size=case.cp_size)
    segments = thdpack.find_segments(mask, position_ids=position_ids)
    layout = plan_layout(segments.length, alignment)
    table = assemble._segment_table(segments, layout, case.seq_len, derive_labels=False)
    with_mask = {**batch, "attention_mask": mask.to(device)}
    steps = {
        "find_segments(host mask, position ids)": lambda: thdpack.find_segments(
            mask, position_ids=position_ids
        ),
        "find_segments(host mask)": lambda: thdpack.find_segments(mask),
        "Segments.check": lambda: segments.check(tuple(mask.shape)),
        "plan_layout": lambda: plan_layout(segments.length, alignment),
        "_segment_table": lambda: assemble._segment_table(
            segments, layout, case.seq_len, derive_labels=False
        ),
        "pack_bshd(batch, segments=...)": lambda: thdpack.pack_bshd(
            batch, alignment=alignment, segments=segments
        ),
        "pack_bshd(batch with mask)": lambda: thdpack.pack_bshd(with_mask, alignment=alignment),
    }
    if cuda:
        steps["find_segments(GPU mask)"] = lambda: thdpack.find_segments(with_mask["attention_mask"])
        steps["torch.cuda.synchronize()"] = torch.cuda.synchronize
    else:
        steps["host plan and gathers"] = lambda: assemble._gather_outputs(
            assemble._expand_on_host(table), host["tokens"], host["labels"], host["loss_mask"], 0, -100
        )
    print(f"\n== {case.name} on {device}: T = {layout.total_tokens}, {len(segments)} samples")
    for name, fn in steps.items():
        times = time_ms({name: fn}, repeats=calls, warmup=5, cuda=cuda)[name]
        print(f"  {name:42s} {statistics.median(times) * 1e3:9.1f} us")


if __name__ == "__main__":
    main()
