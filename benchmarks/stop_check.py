"""What the end-of-step stop agreement costs (thdpack.training.stopping.EarlyStop.agreed: one all-reduce of two
host ints over gloo), per call, on every rank:

    torchrun --standalone --nproc-per-node 2 benchmarks/stop_check.py            # CPU: gloo world group
    torchrun --standalone --nproc-per-node 8 benchmarks/stop_check.py --nccl     # GPU: a gloo group beside NCCL

Prints the median and the 99th percentile over ``--calls`` calls (after ``--warmup``), from rank 0. The ranks
call it back to back, as after a training step (they already meet at the step's gradient-norm all-reduce).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from thdpack.training.stopping import EarlyStop


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--nccl", action="store_true", help="world group on NCCL (one GPU a rank)")
    args = parser.parse_args()
    if args.nccl:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if args.nccl else "gloo")
    stop = EarlyStop()
    aligned = dist.new_group(backend="gloo")  # each call starts with the ranks together, as after a step
    times = []
    for i in range(args.warmup + args.calls):
        dist.barrier(group=aligned)
        start = time.perf_counter()
        assert stop.agreed() is None
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    stop.close()
    if dist.get_rank() == 0:
        times.sort()
        p99 = times[int(0.99 * (len(times) - 1))]
        print(
            f"EarlyStop.agreed on {dist.get_world_size()} ranks ({'gloo beside NCCL' if args.nccl else 'gloo'}): "
            f"median {statistics.median(times) * 1e6:.0f} us, p99 {p99 * 1e6:.0f} us over {len(times)} calls"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
