"""Where pack_bshd's time goes: torch.profiler over repeated calls, one table per case and variant.

    python benchmarks/profile_pack.py                 # CPU batch
    python benchmarks/profile_pack.py --device cuda   # GPU batch: host mask -> segments, then the GPU batch

Prints per-call averages of the top operators by self CPU time and the number of kernel launches and
host-to-device copies per call. Timing numbers belong to ``python -m thdpack.bench``; this shows the parts.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import thdpack
from thdpack.bench import DEFAULT_CASES, make_batch, parse_cases, sample_lengths

# Runtime and driver entry points a kernel launch goes through (torch uses the first, Triton the driver API).
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--cases", type=parse_cases, default=parse_cases(DEFAULT_CASES))
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--rows", type=int, default=20, help="operators listed per table")
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
