"""Scale-out: thdpack against the Hugging Face stack (transformers + Liger + FSDP2 or DDP, tuned) on the same
fine-tuning job, on 1..N GPUs.

    python benchmarks/scale.py --smoke                          # CPU, gloo: tiny shape, 2 ranks
    python benchmarks/scale.py --shape llama3_1b --world-sizes 1,2,4 --hf-configs ddp,ddp:autocast
    python benchmarks/scale.py --shape llama3_8b --layouts tp2+ov,tp4+ov,tp2+ov+fp8 --world-sizes 4 \
        --hf-configs fsdp2,fsdp2:noreshard@8192,fsdp2:ac@32768

The job: a Hugging Face directory of the shape (made here from a seed, ``scale_job.make_hf_dir``), the same
synthetic samples (the chat-like length mix, or every sample ``--seq-length`` tokens with ``--mix full``), the
same global batches (``--samples-per-gpu`` x world size samples a step) cut by thdpack's own loader into
packed micro-batches of at most ``--micro-batch-tokens`` tokens, every data-parallel rank its share. Each side
trains it in its own ``torchrun`` launch per world size:

* thdpack (``scale_thdpack.py``) with each ``--layouts`` entry: ``dp``, or parallel sizes such as ``tp2``,
  ``pp2``, ``cp2``, ``ep2``, ``tp2pp2``, optionally ``:fold`` / ``:distinct`` for the packed alignment
  (``dataset.mode``); data parallelism is what the world size leaves;
* transformers + Liger (``scale_hf.py``), packed rows with varlen attention, in each of ``--hf-configs``
  (FSDP2 with its knobs, or DDP; ``scale_job.parse_peer``), all in one launch per world size.

The comparison pairs each thdpack layout with the fastest transformers configuration at the same world size.
Reported per side and world size: real tokens/s per GPU over the steady steps (``--warmup`` first steps
excluded), peak memory, scaling efficiency (tokens/s per GPU at N over that at the smallest world size the
side ran), first-step losses side by side with their difference, device, versions and date ->
``<out>/scale[-<label>]_<device>_<date>.{json,md}``. A run that fails (out of memory, a layout the world size
cannot hold) is recorded with its reason and the log's tail, and the others go on.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from scale_job import CPU_SHAPES, MIXES, SHAPES, dataset_config, make_hf_dir, parse_peer  # noqa: E402

_LAYOUT = re.compile(r"((?:tp|pp|cp|ep)\d+)+|dp")
# The CPU check (the L1 test): two ranks run each side's step as one rank does, plus the data-parallel split and
# reductions (one rank's launch without torchrun is the one-GPU test's). Defaults: --smoke --world-sizes 1,2 adds
# a world size.
SMOKE = dict(
    shape="tiny",
    world_sizes="2",
    layouts="dp",
    seq_length=256,
    micro_batch_tokens=512,
    samples_per_gpu=4,
    steps=2,
    warmup=1,
)


# thdpack's variants of a layout: +FLAG after it (tp2+ov+fp8), each a set of recipe overrides
LAYOUT_FLAGS = {
    "ov": ("trainer.overlap_grad_reduce=true", "trainer.overlap_param_gather=true"),
    "fp8": ("trainer.precision=fp8",),
    # FP8 with current (per-tensor) scaling: no amax history to reduce over the TP group every step
    "fp8cs": ("trainer.precision=fp8", "trainer.fp8_recipe=tensorwise"),
    "recompute": (
        "++model.config.recompute_granularity=full",
        "++model.config.recompute_method=uniform",
        "++model.config.recompute_num_layers=1",
    ),
    "selrec": ("++model.config.recompute_granularity=selective",),
    "bf16grad": ("trainer.main_grads_dtype=bf16",),
    # the MLP as TE's fused operations: model.te_op_fuser=auto leaves it off under FP8 delayed scaling
    "fuser": ("model.te_op_fuser=true",),
}


def parse_layout(text: str) -> dict:
    """``tp2pp2:fold+ov@8192`` -> ``{"name": ..., "tp": 2, "pp": 2, "cp": 1, "ep": 1, "mode": "fold",
    "overrides": [the +ov recipe overrides], "micro_batch_tokens": 8192}`` (flags: :data:`LAYOUT_FLAGS`; budget:
    this layout's micro-batch tokens instead of ``--micro-batch-tokens``)."""
    rest, _, budget = text.partition("@")
    rest, *flags = rest.split("+")
    spec, _, mode = rest.partition(":")
    bad = [f for f in flags if f not in LAYOUT_FLAGS]
    if (
        not _LAYOUT.fullmatch(spec)
        or mode not in ("", "auto", "fold", "distinct")
        or bad
        or (budget and not budget.isdigit())
    ):
        raise ValueError(
            f"layout '{text}': write dp, or sizes such as tp2, pp2, cp2, ep2, tp2pp2, optionally :fold or "
            f":distinct, then +FLAG for each of {sorted(LAYOUT_FLAGS)}, then @TOKENS"
        )
    sizes = {key: 1 for key in ("tp", "pp", "cp", "ep")}
    for key, size in re.findall(r"(tp|pp|cp|ep)(\d+)", spec):
        sizes[key] = int(size)
    overrides = [o for f in flags for o in LAYOUT_FLAGS[f]]
    return {
        "name": text,
        **sizes,
        "mode": mode or "auto",
        "overrides": overrides,
        "micro_batch_tokens": int(budget) if budget else None,
    }


def layout_fits(layout: dict, world: int) -> str | None:
    """Why ``layout`` cannot run on ``world`` ranks, or None."""
    model_parallel = layout["tp"] * layout["pp"] * layout["cp"]
    if world % model_parallel:
        return f"{world} ranks do not divide into tp x pp x cp = {model_parallel}"
    if (world // layout["pp"]) % layout["ep"]:
        return f"ep {layout['ep']} does not divide the {world // layout['pp']} ranks of a pipeline stage"
    return None


def launch(
    script: str,
    job: dict,
    work: Path,
    name: str,
    timeout: float,
    env: dict,
    reuse: bool = False,
    keep_out: bool = False,
) -> dict:
    """Run ``script`` under torchrun with ``job`` on ``job["world_size"]`` ranks; its result, or the
    failure. ``keep_out``: the worker adds to an existing result file (the transformers side's configurations)."""
    work.mkdir(parents=True, exist_ok=True)
    job_path, log_path = work / f"{name}.job.json", work / f"{name}.log"
    job = {**job, "out": str(work / f"{name}.result.json")}
    if (
        reuse
        and job_path.is_file()
        and json.loads(job_path.read_text()) == job
        and Path(job["out"]).is_file()
    ):
        return json.loads(Path(job["out"]).read_text()) | {"status": "ok", "reused": True}
    if not keep_out:
        Path(job["out"]).unlink(missing_ok=True)
    job_path.write_text(json.dumps(job, indent=1) + "\n")
    command = [sys.executable, str(HERE / script), str(job_path)]
    if job["world_size"] > 1:
        command[1:1] = [
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={job['world_size']}",
        ]
    else:  # one rank needs no torchrun agent (one process start less), only its environment
        env = env | {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
        env["MASTER_PORT"] = str(_free_port())
    started = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            code = subprocess.run(
                command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    text = log_path.read_text(errors="replace")
    if code == 0 and Path(job["out"]).is_file():
        result = json.loads(Path(job["out"]).read_text())
        result["status"] = "ok"
        result["te_backend_lines"] = sorted({line.strip() for line in text.splitlines() if _te_backend(line)})
        return result | {"launch_s": time.perf_counter() - started}
    status = "out of memory" if re.search(r"out of memory|OutOfMemoryError", text) else f"failed ({code})"
    return {"status": status, "log": str(log_path), "log_tail": error_excerpt(text)}


def launch_peer(job: dict, work: Path, name: str, timeout: float, env: dict, reuse: bool) -> list[dict]:
    """``scale_hf.py`` over ``job["hf_configs"]`` in one launch, and again over those left whenever a launch ends
    early (a configuration out of memory ends its process): one result per configuration, in the job's order,
    each with its ``config``."""
    from scale_hf import PEER_MARKER

    out, log_path = work / f"{name}.result.json", work / f"{name}.log"
    job_path = work / f"{name}.job.json"
    if not (reuse and job_path.is_file() and json.loads(job_path.read_text()) == job | {"out": str(out)}):
        out.unlink(missing_ok=True)
    results: dict[str, dict] = {}
    left = list(job["hf_configs"])
    for attempt in range(1, len(left) + 1):
        ended = launch("scale_hf.py", job | {"hf_configs": left}, work, name, timeout, env, keep_out=True)
        done = json.loads(out.read_text()) if out.is_file() else {}
        results |= {t: done[t] | {"status": "ok"} for t in left if t in done}
        left = [t for t in left if t not in done]
        if not left or ended["status"] == "ok":
            break
        log = log_path.read_text(errors="replace")
        shutil.copy(log_path, work / f"{name}.attempt{attempt}.log")
        marks = list(re.finditer(re.escape(PEER_MARKER) + r"(\S+)", log))
        failed = marks[-1].group(1) if marks and marks[-1].group(1) in left else left[0]
        tail = log[marks[-1].start() :] if marks else log
        status = "out of memory" if re.search(r"out of memory|OutOfMemoryError", tail) else ended["status"]
        results[failed] = {"status": status, "log_tail": error_excerpt(tail)}
        left.remove(failed)
    return [results.get(t, {"status": "not run"}) | {"config": t} for t in job["hf_configs"]]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _te_backend(line: str) -> bool:
    # Transformer Engine's attention backend choice, logged with NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2
    return "backend" in line and ("Selected" in line or "Running with" in line or "Available" in line)


def summarize(result: dict, warmup: int) -> dict:
    """Steady-state numbers of one run: real tokens/s per GPU, step time, peak memory, first-step loss."""
    if result["status"] != "ok":
        return result
    steps, world = result["steps"], result["world_size"]
    steady = steps[warmup:] or steps
    time_s = sum(s["time_s"] for s in steady)
    tokens = sum(s["real_tokens"] for s in steady)
    peaks = [p for p in result["peak_memory_gib"] if p is not None]
    return result | {
        "steps_measured": len(steady),
        "step_time_s": time_s / len(steady),
        "real_tokens_per_s": tokens / time_s,
        "real_tokens_per_s_per_gpu": tokens / time_s / world,
        "peak_memory_gib_max": max(peaks) if peaks else None,
        "peak_rss_gib_max": max(result["peak_rss_gib"]),
        "first_step_loss": steps[0]["loss"],
        "losses": [s["loss"] for s in steps],
    }


def add_scaling(runs: list[dict]) -> None:
    """``scaling_efficiency``: tokens/s per GPU at N over that of the same side and layout at its smallest
    world size that ran (``scaling_base_world_size``)."""
    for run in runs:
        peers = [
            r
            for r in runs
            if r["side"] == run["side"] and r["layout"] == run["layout"] and r["status"] == "ok"
        ]
        if run["status"] != "ok" or not peers:
            continue
        base = min(peers, key=lambda r: r["world_size"])
        run["scaling_base_world_size"] = base["world_size"]
        run["scaling_efficiency"] = run["real_tokens_per_s_per_gpu"] / base["real_tokens_per_s_per_gpu"]


def fastest(runs: list[dict], side: str, world: int) -> dict | None:
    """The side's fastest run that finished at ``world`` ranks (real tokens/s per GPU), or None."""
    done = [r for r in runs if r["side"] == side and r["world_size"] == world and r["status"] == "ok"]
    return max(done, key=lambda r: r["real_tokens_per_s_per_gpu"], default=None)


def compare(runs: list[dict]) -> list[dict]:
    """Per world size and thdpack layout: the speed ratio to the fastest transformers configuration that ran at
    that world size, and the first-step losses."""
    rows = []
    for world in sorted({r["world_size"] for r in runs if r["side"] == "hf"}):
        hf = fastest(runs, "hf", world)
        for ours in (r for r in runs if r["side"] == "thdpack" and r["world_size"] == world):
            if ours["status"].startswith("skipped"):
                continue  # the runs table says why
            row = {"world_size": world, "layout": ours["layout"]}
            if ours["status"] == "ok" and hf is not None:
                row |= {
                    "hf_config": hf["layout"],
                    "thdpack_tok_s_per_gpu": ours["real_tokens_per_s_per_gpu"],
                    "hf_tok_s_per_gpu": hf["real_tokens_per_s_per_gpu"],
                    "speedup": ours["real_tokens_per_s_per_gpu"] / hf["real_tokens_per_s_per_gpu"],
                    "first_step_loss_thdpack": ours["first_step_loss"],
                    "first_step_loss_hf": hf["first_step_loss"],
                    "first_step_loss_diff": ours["first_step_loss"] - hf["first_step_loss"],
                    "first_step_loss_rel_diff": (ours["first_step_loss"] - hf["first_step_loss"])
                    / abs(hf["first_step_loss"]),
                    "thdpack_peak_gib": ours["peak_memory_gib_max"],
                    "hf_peak_gib": hf["peak_memory_gib_max"],
                }
            else:
                row["status"] = f"thdpack {ours['status']}, transformers " + (
                    "ran none of its configurations" if hf is None else "ok"
                )
            rows.append(row)
    return rows


def headline(runs: list[dict], rows: list[dict]) -> dict:
    """At the largest world size both sides ran: thdpack's best layout against the fastest transformers
    configuration."""
    done = [r for r in rows if "speedup" in r]
    if not done:
        return {}
    world = max(r["world_size"] for r in done)
    best = max((r for r in done if r["world_size"] == world), key=lambda r: r["speedup"])
    ours = next(
        r
        for r in runs
        if r["side"] == "thdpack" and r["layout"] == best["layout"] and r["world_size"] == world
    )
    hf = fastest(runs, "hf", world)
    return {
        "world_size": world,
        "best_thdpack_layout": best["layout"],
        "fastest_hf_config": hf["layout"],
        "speedup_per_gpu": best["speedup"],
        "thdpack_tok_s_per_gpu": best["thdpack_tok_s_per_gpu"],
        "hf_tok_s_per_gpu": best["hf_tok_s_per_gpu"],
        "scaling_efficiency_thdpack": ours.get("scaling_efficiency"),
        "scaling_efficiency_hf": hf.get("scaling_efficiency"),
        "scaling_base_world_size": [ours.get("scaling_base_world_size"), hf.get("scaling_base_world_size")],
        "max_abs_first_step_loss_diff": max(abs(r["first_step_loss_diff"]) for r in done),
        "max_abs_first_step_loss_rel_diff": max(abs(r["first_step_loss_rel_diff"]) for r in done),
    }


def versions() -> dict:
    import importlib.metadata as md

    def version(name):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    names = ("torch", "transformers", "liger-kernel", "megatron-core", "transformer-engine", "thdpack")
    return {"python": platform.python_version(), **{n: version(n) for n in names}}


def device_name(runs: list[dict]) -> tuple[str, str]:
    """(the device's name as the workers saw it, its tag in file names). The driver itself never touches the
    GPU: a CUDA context here would hold memory on GPU 0 while the workers run."""
    import torch

    if not torch.cuda.is_available():
        return platform.processor() or "cpu", "cpu"
    name = next((r["device_name"] for r in runs if r.get("device_name")), None) or _smi_name()
    tag = "h200" if "H200" in name else "h100" if "H100" in name else "gpu"
    return f"{torch.cuda.device_count()}x {name}", tag


def _smi_name() -> str:
    """The first GPU's name from nvidia-smi (no CUDA context in this process), when no run reported one."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return out.stdout.splitlines()[0].strip() or "GPU"
    except (OSError, IndexError, subprocess.TimeoutExpired):
        return "GPU"


def error_excerpt(text: str, limit: int = 60) -> list[str]:
    """The first failing rank's traceback in a torchrun log (its lines carry a ``[rankN]:`` prefix), through the
    exception's line; else the log's last 25 lines. torchrun's own ChildFailedError report, which names no cause,
    comes after it and would push it out of a plain tail."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if re.match(r"\[rank\d+\]: Traceback", line)), None)
    if start is None:
        return lines[-25:]
    rank = lines[start].split("]")[0] + "]"
    own = [line for line in lines[start:] if line.startswith(rank)]
    end = next(
        (i for i, line in enumerate(own) if re.match(re.escape(rank) + r": [\w.]*(Error|Exception)\b", line)),
        len(own) - 1,
    )
    return own[: end + 1][-limit:]


def write_report(payload: dict, out: Path, label: str | None, quiet: bool = False) -> Path:
    date = payload["date"][:10]
    stem = out / f"scale{'-' + label if label else ''}_{payload['tag']}_{date}"
    out.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(payload, indent=1) + "\n")
    setup, v = payload["setup"], payload["versions"]
    lines = [
        f"# Scale-out: thdpack against transformers + Liger, {setup['shape']} on {payload['device']}, {date}",
        "",
        f"torch {v['torch']}, transformers {v['transformers']}, liger-kernel {v['liger-kernel']}, "
        f"megatron-core {v['megatron-core']}, Transformer Engine {v['transformer-engine']}. "
        f"Mix `{setup['mix']}`, seq_length "
        f"{setup['seq_length']}, "
        + (
            f"{setup['samples_per_step']} samples a step (transformers: {setup['hf_samples_per_step'] or setup['samples_per_step']})"
            if setup.get("samples_per_step")
            else f"{setup['samples_per_gpu']} samples per GPU a step"
        )
        + ", micro-batches of at most "
        f"{setup['micro_batch_tokens']} tokens (transformers: {setup['hf_micro_batch_tokens']}), "
        f"{setup['steps']} "
        f"steps, the first {setup['warmup']} not timed.",
        "",
        "| side | layout | GPUs | status | real tok/s/GPU | s/step | peak GiB | scaling eff. "
        "| first-step loss |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in payload["runs"]:
        if r["status"] != "ok":
            lines.append(
                f"| {r['side']} | {r['layout']} | {r['world_size']} | {r['status']} | - | - | - | - | - |"
            )
            continue
        lines.append(
            f"| {r['side']} | {r['layout']} | {r['world_size']} | ok | "
            f"{r['real_tokens_per_s_per_gpu']:,.0f} | "
            f"{r['step_time_s']:.3f} | {_fmt(r['peak_memory_gib_max'], '{:.1f}')} | "
            f"{_fmt(r.get('scaling_efficiency'), '{:.2f}')} (vs {r.get('scaling_base_world_size')}) | "
            f"{r['first_step_loss']:.6f} |"
        )
    lines += [
        "",
        "| GPUs | thdpack layout | vs transformers | speedup per GPU | first-step loss thdpack / hf | "
        "difference |",
        "|---|---|---|---|---|---|",
    ]
    for row in payload["comparison"]:
        if "speedup" in row:
            lines.append(
                f"| {row['world_size']} | {row['layout']} | {row['hf_config']} | {row['speedup']:.2f}x | "
                f"{row['first_step_loss_thdpack']:.6f} / {row['first_step_loss_hf']:.6f} | "
                f"{row['first_step_loss_diff']:+.2e} ({row['first_step_loss_rel_diff']:+.1e} rel.) |"
            )
        else:
            lines.append(f"| {row['world_size']} | {row['layout']} | - | {row['status']} | - | - |")
    peers = {r["layout"]: r for r in payload["runs"] if r["side"] == "hf" and r["status"] == "ok"}
    if peers:
        lines += ["", "transformers configurations (scale_job.parse_peer):"]
        for name, r in peers.items():
            lines.append(
                f"- `{name}`: attention {r['attention_detail']}; Liger: {r['liger']}; {r['precision']}; "
                f"experts: {r.get('experts_implementation') or 'n/a'}; {r['micro_batch_tokens']} tokens a "
                "micro-batch."
            )
    flags = {
        f for r in payload["runs"] if r["side"] == "thdpack" for f in r["layout"].split("@")[0].split("+")[1:]
    }
    if flags:
        lines += [
            "",
            "thdpack layout flags: "
            + "; ".join(f"`+{f}`: {', '.join(payload['setup']['layout_flags'][f])}" for f in sorted(flags)),
        ]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    if not quiet:
        print("\n".join(lines))
        print(f"wrote {stem}.json, .md")
    return stem


def _fmt(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help=f"the CPU check: {SMOKE}")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3_1b")
    parser.add_argument(
        "--hf-dir", type=Path, help="a Llama or Qwen3-MoE directory to use instead of --shape's"
    )
    parser.add_argument(
        "--layouts", default="dp", help="thdpack layouts, comma-separated (dp, tp2, pp2, cp2:fold, ...)"
    )
    parser.add_argument("--world-sizes", default="1")
    parser.add_argument("--sides", default="thdpack,hf")
    parser.add_argument(
        "--hf-configs",
        default="fsdp2",
        help="transformers configurations, comma-separated, run in this order in one launch "
        "(scale_job.parse_peer: fsdp2[:noreshard][:prefetchN][:ac][:bf16reduce], ddp[:autocast], @TOKENS)",
    )
    parser.add_argument("--layers", type=int, help="decoder layers of the made shape instead of its own")
    parser.add_argument("--mix", choices=MIXES, default="chat")
    parser.add_argument("--seq-length", type=int, default=8192)
    parser.add_argument("--micro-batch-tokens", type=int, default=16384)
    parser.add_argument("--hf-micro-batch-tokens", type=int, help="transformers' budget (default: the same)")
    parser.add_argument("--samples-per-gpu", type=int, default=32, help="samples a step per GPU")
    parser.add_argument(
        "--samples-per-step",
        type=int,
        help="samples a step at every world size instead (long samples under context parallelism: fewer than GPUs)",
    )
    parser.add_argument(
        "--hf-samples-per-step",
        type=int,
        help="the transformers side's samples a step (each of its data-parallel ranks needs one at least)",
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3, help="first steps not timed")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--hf-attention", choices=("auto", "varlen", "sdpa"), default="auto")
    parser.add_argument("--no-liger", action="store_true")
    parser.add_argument(
        "--log-te-backend", action="store_true", help="NVTE_DEBUG logs: TE's attention backend"
    )
    parser.add_argument(
        "--thdpack-override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a recipe override for thdpack's runs (repeatable), "
        "e.g. +model.config.recompute_granularity=selective (+: a Megatron key model=hf does not list)",
    )
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="take a run's result from --work when the same job ran there already (a sweep in several calls)",
    )
    parser.add_argument(
        "--hf-sync-each-microbatch",
        action="store_true",
        help="FSDP2 reduce-scatters after every micro-batch (less memory) instead of once per step",
    )
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per launch")
    parser.add_argument("--work", type=Path, default=REPO / "outputs" / "scale")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--label", help="in the report's name: scale-<label>_<device>_<date>")
    parser.add_argument("--tag", help="device tag in the report's name (default: from the GPU)")
    if parser.parse_known_args(argv)[0].smoke:
        parser.set_defaults(**SMOKE)
    args = parser.parse_args(argv)
    layouts = [parse_layout(t) for t in args.layouts.split(",")]
    hf_configs = args.hf_configs.split(",")
    for text in hf_configs:
        parse_peer(text)  # a misspelt configuration stops here, before any launch
    worlds = [int(n) for n in args.world_sizes.split(",")]
    if set(args.sides.split(",")) - {"thdpack", "hf"}:
        parser.error(f"--sides {args.sides}: thdpack, hf or both")
    import torch

    on_gpu = torch.cuda.is_available()
    if not on_gpu and args.hf_dir is None and args.shape not in CPU_SHAPES:
        parser.error(f"--shape {args.shape} is for GPUs; on a CPU use one of {list(CPU_SHAPES)}")

    hf_dir = args.hf_dir or make_model_dir(args)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    }
    if not on_gpu:
        env["OMP_NUM_THREADS"] = "1"
    budget = args.micro_batch_tokens
    common = {
        "hf_dir": str(hf_dir),
        "steps": args.steps,
        "seed": args.seed,
        "lr": args.lr,
        "weight_decay": 0.01,
        "betas": [0.9, 0.95],
        "clip_grad": 1.0,
        "hf_attention": args.hf_attention,
        "liger": not args.no_liger,
        "hf_micro_batch_tokens": args.hf_micro_batch_tokens or budget,
        "thdpack_overrides": args.thdpack_override,
        "hf_sync_each_microbatch": args.hf_sync_each_microbatch,
    }
    runs_dir = args.work / "runs" / Path(hf_dir).name  # one folder a model: run names repeat across shapes
    runs: list[dict] = []
    setup = {
        "shape": args.hf_dir.name if args.hf_dir else args.shape,
        "hf_dir": str(hf_dir),
        "mix": args.mix,
        "seq_length": args.seq_length,
        "micro_batch_tokens": budget,
        "hf_micro_batch_tokens": common["hf_micro_batch_tokens"],
        "samples_per_gpu": args.samples_per_gpu,
        "samples_per_step": args.samples_per_step,
        "hf_samples_per_step": args.hf_samples_per_step,
        "steps": args.steps,
        "warmup": args.warmup,
        "lr": args.lr,
        "seed": args.seed,
        "layouts": [layout["name"] for layout in layouts],
        "layout_flags": {k: list(v) for k, v in LAYOUT_FLAGS.items()},
        "hf_configs": hf_configs,
        "layers": args.layers,
        "world_sizes": worlds,
        "thdpack_overrides": args.thdpack_override,
        "smoke": args.smoke,
        "weights": "the same Hugging Face directory on both sides; thdpack imports it with model=hf "
        "model.pretrained=DIR (thdpack.hf)",
    }
    for run in run_all(args, worlds, layouts, hf_configs, common, env, budget, runs_dir):
        runs.append(run)
        report(args, runs, setup, quiet=True)  # after every run: a sweep cut short keeps what it measured
    return report(args, runs, setup)


def report(args, runs: list[dict], setup: dict, quiet: bool = False) -> Path:
    """The report of ``runs`` so far (``--out``), with scaling efficiencies and the comparison."""
    add_scaling(runs)
    rows = compare(runs)
    device, tag = device_name(runs)
    payload = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "tag": args.tag or tag,
        "device": device,
        "versions": versions(),
        "setup": setup,
        "headline": headline(runs, rows),
        "comparison": rows,
        "runs": runs,
    }
    return write_report(payload, args.out, args.label, quiet)


def run_all(args, worlds, layouts, hf_configs, common, env, budget, runs_dir):
    """Every run of the sweep, one after another, as each ends: thdpack's layouts, then the transformers
    configurations (one launch), per world size."""
    sides = args.sides.split(",")
    for world in worlds:
        samples = args.samples_per_step or args.samples_per_gpu * world
        dataset = dataset_config(
            seq_length=args.seq_length,
            global_batch_size=samples,
            micro_batch_tokens=budget,
            mix=args.mix,
            seed=args.seed,
        )
        job = {**common, "dataset": dataset, "world_size": world}
        if "thdpack" in sides:
            for layout in layouts:
                why = layout_fits(layout, world)
                name = f"thdpack_{layout['name'].replace(':', '-')}_{world}"
                print(f"== {name}", flush=True)
                if why:
                    result = {"status": f"skipped: {why}"}
                else:
                    run_env = env | (
                        {"NVTE_DEBUG": "1", "NVTE_DEBUG_LEVEL": "2"} if args.log_te_backend else {}
                    )
                    thdpack_job = job | {"layout": layout}
                    if layout["micro_batch_tokens"]:
                        thdpack_job["dataset"] = dataset | {
                            "micro_batch_tokens": layout["micro_batch_tokens"]
                        }
                    result = launch(
                        "scale_thdpack.py", thdpack_job, runs_dir, name, args.timeout, run_env, args.reuse
                    )
                run = summarize(
                    {"side": "thdpack", "layout": layout["name"], "world_size": world} | result, args.warmup
                )
                _print_run(run)
                yield run
        if "hf" in sides:
            name = f"hf_{world}"
            print(f"== {name}: {', '.join(hf_configs)}", flush=True)
            peer_job = job | {"hf_configs": hf_configs}
            if args.hf_samples_per_step:
                peer_job["dataset"] = dataset | {"global_batch_size": args.hf_samples_per_step}
            for result in launch_peer(peer_job, runs_dir, name, args.timeout, env, args.reuse):
                config = result.pop("config")
                run = summarize({"side": "hf", "layout": config, "world_size": world} | result, args.warmup)
                print(f"   transformers {config}:", flush=True)
                _print_run(run)
                yield run


def make_model_dir(args) -> Path:
    """The shape's directory under ``--work`` (``--layers`` in its name): a CPU shape here, a GPU shape in a
    child process on the GPU (drawn there fast, and the GPU's memory is free again for the workers)."""
    layers = f"_l{args.layers}" if args.layers else ""
    out = args.work / "models" / f"{args.shape}{layers}_seed{args.seed}"
    if args.shape in CPU_SHAPES:
        return make_hf_dir(args.shape, args.seed, out, layers=args.layers)
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import torch; from pathlib import Path; "
        "from scale_job import make_hf_dir; "
        "make_hf_dir(sys.argv[2], int(sys.argv[3]), Path(sys.argv[4]), "
        "'cuda' if torch.cuda.is_available() else 'cpu', int(sys.argv[5]) or None)"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    subprocess.run(
        [sys.executable, "-c", code, str(HERE), args.shape, str(args.seed), str(out), str(args.layers or 0)],
        check=True,
        env=env,
    )
    return out


def _print_run(run: dict) -> None:
    if run["status"] != "ok":
        print(f"   {run['status']}: {run.get('log', '')}", flush=True)
        for line in run.get("log_tail", [])[-8:]:
            print(f"   | {line}", flush=True)
        return
    print(
        f"   {run['real_tokens_per_s_per_gpu']:,.0f} real tok/s per GPU, {run['step_time_s']:.3f} s/step, "
        "peak "
        f"{_fmt(run['peak_memory_gib_max'], '{:.1f}')} GiB, losses {[round(x, 5) for x in run['losses']]}",
        flush=True,
    )


if __name__ == "__main__":
    main()
