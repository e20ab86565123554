"""The output layer + cross entropy alone: time, peak memory and syncs of each implementation, one GPU.

    python benchmarks/output_loss.py                          # llama3_1b's shape: hidden 2048, vocab 128,256
    python benchmarks/output_loss.py --tokens 8192,16384,32768,65536 --chunks 512,1024,2048,4096
    python benchmarks/output_loss.py --smoke                  # CPU, tiny shapes, a few seconds

For each token count, one micro-batch's hidden states ``[tokens, hidden]`` (bf16 on CUDA) and an output weight
``[vocab, hidden]`` go through forward and backward of the per-token loss summed over counted tokens (90 % of them),
as thdpack's loss (``thdpack.megatron.loss.LM_LOSS``) sums it:

* ``megatron``: the output GEMM (bf16 logits) then megatron-core's ``vocab_parallel_cross_entropy`` (it takes
  ``logits.float()``): what ``GPTModel`` does with ``model.output_loss=megatron``;
* ``megatron_te``: the same logits through Transformer Engine's ``parallel_cross_entropy`` (megatron-core's
  ``cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="te"``: the gradient written over the bf16 logits);
* ``chunked`` / ``chunked_eager``: ``thdpack.megatron.output_loss.linear_cross_entropy`` with its element-wise parts
  compiled or not, at each ``--chunks`` size;
* ``liger``: the same function on Liger-Kernel's fused linear cross entropy (``model.output_loss=liger``);
* ``liger_flce``: Liger's own ``LigerFusedLinearCrossEntropyFunction`` (``reduction="sum"``), for reference.

Reported: median forward+backward time over ``--iters`` after ``--warmup`` (CUDA events), the peak memory above the
inputs, host-device syncs per call (``set_sync_debug_mode("warn")``), and the summed loss against ``megatron``'s.
Writes ``<out>/output_loss_<gpu>_<date>.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch


def candidates(args) -> dict:
    """name -> a function ``(hidden, weight, labels, mask) -> summed loss`` (a 0-dim tensor with gradients)."""
    from thdpack.megatron.output_loss import linear_cross_entropy

    out = {"megatron": _megatron}
    if torch.cuda.is_available():
        out["megatron_te"] = _megatron_te
    for chunk in args.chunks:
        for compiled in (True, False) if torch.cuda.is_available() else (False,):
            name = f"chunked{'' if compiled else '_eager'}_{chunk}"
            out[name] = lambda h, w, y, m, c=chunk, k=compiled: (
                linear_cross_entropy(h, w, y, m, chunk_tokens=c, compiled=k) * m
            ).sum()
    if torch.cuda.is_available():
        out["liger"] = lambda h, w, y, m: (linear_cross_entropy(h, w, y, m, impl="liger") * m).sum()
        out["liger_flce"] = _liger_flce
    return out


def _megatron(hidden, weight, labels, mask):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = hidden @ weight.t()
    losses = vocab_parallel_cross_entropy(logits[:, None], labels[:, None])[:, 0]
    return torch.where(mask > 0, losses * mask, 0.0).sum()


def _megatron_te(hidden, weight, labels, mask):
    from megatron.core import parallel_state as ps
    from megatron.core.extensions.transformer_engine import te_parallel_cross_entropy

    logits = hidden @ weight.t()
    losses = te_parallel_cross_entropy(logits[:, None], labels[:, None], ps.get_tensor_model_parallel_group())
    return torch.where(mask > 0, losses.reshape(-1) * mask, 0.0).sum()


def _liger_flce(hidden, weight, labels, mask):
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    target = torch.where(mask > 0, labels, -100)
    loss, *_ = LigerFusedLinearCrossEntropyFunction.apply(
        hidden, weight, target, None, None, -100, 0.0, 0.0, "sum"
    )
    return loss


def measure(fn, hidden, weight, labels, mask, args) -> dict:
    cuda = hidden.device.type == "cuda"
    times = []
    loss = None
    for i in range(args.warmup + args.iters):
        hidden.grad = weight.grad = None
        if cuda:
            torch.cuda.synchronize()
            if i == args.warmup:
                torch.cuda.reset_peak_memory_stats()
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        began = time.perf_counter()
        loss = fn(hidden, weight, labels, mask)
        loss.backward()
        if cuda:
            stop.record()
            torch.cuda.synchronize()
            elapsed = start.elapsed_time(stop) / 1e3
        else:
            elapsed = time.perf_counter() - began
        if i >= args.warmup:
            times.append(elapsed)
    result = {"time_ms": statistics.median(times) * 1e3, "loss_sum": float(loss.detach())}
    if cuda:
        from thdpack.training.profiling import catch_syncs

        result["peak_gib_above_inputs"] = (torch.cuda.max_memory_allocated() - args.inputs_bytes) / 2**30
        with catch_syncs() as sites:
            hidden.grad = weight.grad = None
            fn(hidden, weight, labels, mask).backward()
        result["syncs"] = len(sites)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="8192,16384,32768")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--chunks", default="1024,4096")
    parser.add_argument("--only", default=None, help="comma-separated candidate names (prefixes)")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--smoke", action="store_true", help="CPU-sized shapes, one iteration")
    args = parser.parse_args()
    if args.smoke:
        args.tokens, args.hidden, args.vocab, args.chunks, args.iters, args.warmup = "64", 16, 96, "24", 1, 0
    args.chunks = [int(c) for c in str(args.chunks).split(",")]
    _init_one_rank()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gpu = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"
    tag = "h200" if "H200" in gpu else "h100" if "H100" in gpu else "cpu" if device == "cpu" else "gpu"
    results: dict[str, dict] = {}
    for tokens in (int(t) for t in args.tokens.split(",")):
        torch.manual_seed(0)
        hidden = (torch.randn(tokens, args.hidden, device=device) * 0.5).to(dtype).requires_grad_()
        weight = (torch.randn(args.vocab, args.hidden, device=device) * 0.02).to(dtype).requires_grad_()
        labels = torch.randint(0, args.vocab, (tokens,), device=device)
        mask = (torch.rand(tokens, device=device) < 0.9).float()
        if device == "cuda":
            torch.cuda.synchronize()
            args.inputs_bytes = torch.cuda.memory_allocated()
        results[str(tokens)] = row = {}
        for name, fn in candidates(args).items():
            if args.only and not any(name.startswith(p) for p in args.only.split(",")):
                continue
            try:
                row[name] = measure(fn, hidden, weight, labels, mask, args)
            except torch.cuda.OutOfMemoryError:
                row[name] = {"error": "out of memory"}
            except Exception as error:  # a candidate that cannot run here is reported, not fatal
                row[name] = {"error": f"{type(error).__name__}: {str(error)[:200]}"}
            if device == "cuda":
                torch.cuda.empty_cache()
            reference = row.get("megatron", {}).get("loss_sum")
            if reference is not None and "loss_sum" in row[name]:
                row[name]["loss_rel_diff"] = abs(row[name]["loss_sum"] - reference) / abs(reference)
            print(f"{tokens} tokens | {name}: {row[name]}", flush=True)
        del hidden, weight
    write(results, args, gpu, tag)


def _init_one_rank() -> None:
    """megatron-core's vocab-parallel cross entropy asks parallel_state for its TP group: a world of one."""
    import os
    import socket

    from megatron.core import parallel_state as ps

    if torch.cuda.is_available():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        for key, value in {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": "0",
            "WORLD_SIZE": "1",
        }.items():
            os.environ.setdefault(key, value)
        torch.distributed.init_process_group("nccl")
        ps.initialize_model_parallel()
    else:
        from thdpack.megatron.cpu import initialize_model_parallel_cpu

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ.setdefault("MASTER_PORT", str(s.getsockname()[1]))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        initialize_model_parallel_cpu()


def write(results: dict, args, gpu: str, tag: str) -> None:
    import importlib.metadata as md

    def version(name):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    date = datetime.now(timezone.utc).isoformat(timespec="seconds")
    payload = {
        "date": date,
        "device": gpu,
        "versions": {
            "torch": torch.__version__,
            "megatron-core": version("megatron-core"),
            "transformer-engine": version("transformer-engine") or version("transformer_engine"),
            "liger-kernel": version("liger-kernel") or version("liger_kernel"),
        },
        "setup": {"hidden": args.hidden, "vocab": args.vocab, "iters": args.iters, "warmup": args.warmup},
        "results": results,
    }
    stem = args.out / f"output_loss_{tag}{'_smoke' if args.smoke else ''}_{date[:10]}"
    args.out.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(payload, indent=2) + "\n")
    lines = [
        f"# Output layer + cross entropy on {gpu}, {date[:10]}",
        "",
        f"hidden {args.hidden}, vocab {args.vocab}; forward + backward of the summed per-token loss; median of "
        f"{args.iters} after {args.warmup}. Versions: {payload['versions']}.",
        "",
        "| tokens | implementation | ms | peak GiB above inputs | syncs | loss vs megatron |",
        "|---|---|---|---|---|---|",
    ]
    for tokens, row in results.items():
        for name, r in row.items():
            if "error" in r:
                lines.append(f"| {tokens} | {name} | {r['error']} | | | |")
                continue
            peak = r.get("peak_gib_above_inputs")
            diff = r.get("loss_rel_diff")
            lines.append(
                f"| {tokens} | {name} | {r['time_ms']:.1f} | {'-' if peak is None else f'{peak:.2f}'} | "
                f"{r.get('syncs', '-')} | {'-' if diff is None else f'{diff:.1e}'} |"
            )
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {stem}.json, .md")


if __name__ == "__main__":
    main()
