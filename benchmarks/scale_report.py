"""The four-GPU report: several ``scale.py`` reports (the phases of ``scale_x4.sh``) combined into
``scale_<gpu>x<n>_<date>.{md,json}`` with the top-level ``headline`` the scale-out targets are read from.

    python benchmarks/scale_report.py outputs/scale_x4/results --out benchmarks/results --notes notes.md

Headline (each value None where no pair of runs measured it, with the reason under ``missing``):

* ``per_gpu_speedup_8b``, ``per_gpu_speedup_moe``: real tokens/s per GPU of thdpack's fastest layout over the
  fastest transformers configuration, at the largest world size, on the chat mix of the ``llama3_8b`` and the
  ``qwen3_30b_a3b`` shapes;
* ``longest_sample_thdpack``, ``longest_sample_peer``: the longest sample (``--mix full``) each side trained;
* ``scaling_efficiency_1_to_4``: thdpack's tokens/s per GPU at 4 GPUs over 1 (its fastest layout at each), on the
  ``llama3_1b`` shape (``scaling_efficiency_1_to_4_peer``: the same for transformers);
* ``peer_configs``: every transformers configuration that was tried, with its status and speed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

TARGETS = {
    "per_gpu_speedup_8b": 1.5,
    "per_gpu_speedup_moe": 2.5,
    "longest_sample_ratio": 4.0,
    "scaling_efficiency_1_to_4": 0.95,
    "first_step_loss_rel_diff": 0.005,
}


def _paths(paths: list[Path]) -> list[Path]:
    return [f for p in paths for f in (sorted(p.glob("scale*.json")) if p.is_dir() else [p])]


def load(paths: list[Path]) -> list[dict]:
    """The reports under ``paths`` (files or folders of ``scale*.json``), each with its file name."""
    return [json.loads(f.read_text()) | {"file": f.name, "path": f} for f in _paths(paths)]


def _runs(reports, side, shape=None, mix=None):
    for report in reports:
        setup = report["setup"]
        if shape and not setup["shape"].startswith(shape) or mix and setup["mix"] != mix:
            continue
        for run in report["runs"]:
            if run["side"] == side:
                yield report, run


def _fastest(reports, side, shape, mix, world):
    done = [
        run
        for _, run in _runs(reports, side, shape, mix)
        if run["status"] == "ok" and run["world_size"] == world
    ]
    return max(done, key=lambda r: r["real_tokens_per_s_per_gpu"], default=None)


def speedup(reports, shape: str) -> tuple[float | None, str | None, dict]:
    worlds = sorted({r["world_size"] for _, r in _runs(reports, "thdpack", shape, "chat")}, reverse=True)
    for world in worlds:
        ours, peer = (_fastest(reports, s, shape, "chat", world) for s in ("thdpack", "hf"))
        if ours and peer:
            ratio = ours["real_tokens_per_s_per_gpu"] / peer["real_tokens_per_s_per_gpu"]
            detail = {
                "world_size": world,
                "thdpack": ours["layout"],
                "peer": peer["layout"],
                "thdpack_tok_s_per_gpu": ours["real_tokens_per_s_per_gpu"],
                "peer_tok_s_per_gpu": peer["real_tokens_per_s_per_gpu"],
            }
            return ratio, None, detail
    ran = {r["status"] for _, r in _runs(reports, "thdpack", shape, "chat")}
    peer = {r["status"] for _, r in _runs(reports, "hf", shape, "chat")}
    return (
        None,
        f"{shape}: thdpack runs {sorted(ran) or 'none'}, transformers runs {sorted(peer) or 'none'}",
        {},
    )


def longest(reports, side: str) -> int | None:
    lengths = [
        report["setup"]["seq_length"]
        for report, run in _runs(reports, side, mix="full")
        if run["status"] == "ok"
    ]
    return max(lengths, default=None)


def unfinished(reports, side: str, name: str) -> str:
    """Why ``side`` has no longest sample: each full-length run it tried, with its length and status."""
    tried = sorted(
        (int(r["setup"]["seq_length"]), run["status"]) for r, run in _runs(reports, side, mix="full")
    )
    if not tried:
        return f"no {name} run of the full-length mix"
    runs = ", ".join(f"{length:,} tokens {status}" for length, status in tried)
    return f"no {name} run of the full-length mix finished ({runs})"


def scaling(reports, side: str) -> float | None:
    one, four = (_fastest(reports, side, "llama3_1b", "chat", w) for w in (1, 4))
    if one and four:
        return four["real_tokens_per_s_per_gpu"] / one["real_tokens_per_s_per_gpu"]
    return None


def combine(reports: list[dict]) -> dict:
    missing = {}
    s8, why8, d8 = speedup(reports, "llama3_8b")
    smoe, whymoe, dmoe = speedup(reports, "qwen3_30b_a3b")
    for key, why in (("per_gpu_speedup_8b", why8), ("per_gpu_speedup_moe", whymoe)):
        if why:
            missing[key] = why
    ours_long, peer_long = longest(reports, "thdpack"), longest(reports, "hf")
    if ours_long is None:
        missing["longest_sample_thdpack"] = unfinished(reports, "thdpack", "thdpack")
    if peer_long is None:
        missing["longest_sample_peer"] = unfinished(reports, "hf", "transformers")
    eff, eff_peer = scaling(reports, "thdpack"), scaling(reports, "hf")
    if eff is None:
        missing["scaling_efficiency_1_to_4"] = "llama3_1b lacks a finished run at 1 or at 4 GPUs"
    peers = [
        {
            "shape": report["setup"]["shape"],
            "mix": report["setup"]["mix"],
            "seq_length": report["setup"]["seq_length"],
            "world_size": run["world_size"],
            "config": run["layout"],
            "status": run["status"],
            "tok_s_per_gpu": run.get("real_tokens_per_s_per_gpu"),
            "peak_gib": run.get("peak_memory_gib_max"),
        }
        for report, run in _runs(reports, "hf")
    ]
    headline = {
        "per_gpu_speedup_8b": s8,
        "per_gpu_speedup_moe": smoe,
        "longest_sample_thdpack": ours_long,
        "longest_sample_peer": peer_long,
        "scaling_efficiency_1_to_4": eff,
        "scaling_efficiency_1_to_4_peer": eff_peer,
        "peer_configs": peers,
        "detail_8b": d8,
        "detail_moe": dmoe,
        "missing": missing,
    }
    ratio = ours_long / peer_long if ours_long and peer_long else None
    loss = loss_agreement(reports)
    headline["max_first_step_loss_rel_diff"] = loss
    measured = {
        "per_gpu_speedup_8b": s8,
        "per_gpu_speedup_moe": smoe,
        "longest_sample_ratio": ratio,
        "scaling_efficiency_1_to_4": eff,
    }
    headline["targets"] = {
        key: {
            "target": TARGETS[key],
            "measured": value,
            "met": None if value is None else value >= TARGETS[key],
        }
        for key, value in measured.items()
    }
    headline["targets"]["first_step_loss_rel_diff"] = {
        "target": TARGETS["first_step_loss_rel_diff"],
        "measured": loss,
        "met": None if loss is None else loss <= TARGETS["first_step_loss_rel_diff"],
    }
    return headline


def loss_agreement(reports: list[dict]) -> float | None:
    """The largest relative first-step loss difference between thdpack and transformers over the reports whose
    two sides trained the same global batches (not the long-context ones, where the sides' sample counts
    differ)."""
    diffs = [
        abs(row["first_step_loss_rel_diff"])
        for report in reports
        if not report["setup"].get("hf_samples_per_step")
        for row in report["comparison"]
        if "first_step_loss_rel_diff" in row
    ]
    return max(diffs, default=None)


def write(reports: list[dict], out: Path, notes: str = "") -> Path:
    devices = sorted({r["device"] for r in reports})
    dates = sorted(r["date"][:10] for r in reports)
    tag = next((r["tag"] for r in reports if r["tag"] not in ("gpu", "cpu")), reports[0]["tag"])
    gpus = max(r["runs"][0]["world_size"] for r in reports if r["runs"])
    stem = out / f"scale_{tag}x{gpus}_{dates[-1]}"
    headline = combine(reports)
    payload = {
        "date": dates[-1],
        "devices": devices,
        "versions": reports[0]["versions"],
        "headline": headline,
        "reports": [r["file"] for r in reports],
    }
    stem.with_suffix(".json").write_text(json.dumps(payload, indent=1) + "\n")
    lines = [f"# thdpack against the tuned Hugging Face stack on {gpus} GPUs, {dates[-1]}", ""]
    v = reports[0]["versions"]
    lines += [
        f"Devices: {', '.join(devices)}. torch {v['torch']}, transformers {v['transformers']}, liger-kernel "
        f"{v['liger-kernel']}, megatron-core {v['megatron-core']}, Transformer Engine {v['transformer-engine']}, "
        f"Python {v['python']}.",
        "",
        "| target | goal | measured | met |",
        "|---|---|---|---|",
    ]
    for key, t in headline["targets"].items():
        value = "-" if t["measured"] is None else f"{t['measured']:.3g}"
        if key == "first_step_loss_rel_diff":
            t = t | {"target": f"<= {t['target']}"}
        met = "not measured" if t["met"] is None else ("yes" if t["met"] else "no")
        lines.append(f"| {key} | {t['target']} | {value} | {met} |")
    if headline["missing"]:
        lines += ["", "Not measured:"] + [f"- `{k}`: {why}" for k, why in headline["missing"].items()]
    lines += [
        "",
        "| shape | mix | seq | GPUs | transformers configuration | status | tok/s/GPU | peak GiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in headline["peer_configs"]:
        tok = "-" if p["tok_s_per_gpu"] is None else f"{p['tok_s_per_gpu']:,.0f}"
        peak = "-" if p["peak_gib"] is None else f"{p['peak_gib']:.1f}"
        lines.append(
            f"| {p['shape']} | {p['mix']} | {p['seq_length']} | {p['world_size']} | `{p['config']}` | "
            f"{p['status']} | {tok} | {peak} |"
        )
    lines += [
        "",
        "thdpack runs:",
        "",
        "| shape | mix | seq | GPUs | layout | status | tok/s/GPU | peak GiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for report, run in _runs(reports, "thdpack"):
        tok = run.get("real_tokens_per_s_per_gpu")
        peak = run.get("peak_memory_gib_max")
        setup = report["setup"]
        lines.append(
            f"| {setup['shape']} | {setup['mix']} | {setup['seq_length']} | {run['world_size']} | `{run['layout']}` | "
            f"{run['status']} | {'-' if tok is None else f'{tok:,.0f}'} | "
            f"{'-' if peak is None else f'{peak:.1f}'} |"
        )
    lines += ["", "Per-phase reports (`scale.py`): " + ", ".join(f"`{r['file']}`" for r in reports)]
    if notes:
        lines += ["", notes.strip()]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return stem


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", nargs="+", type=Path, help="scale*.json files or folders holding them")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--notes", type=Path, help="a Markdown file appended to the report")
    args = parser.parse_args(argv)
    reports = [r for r in load(args.reports) if r.get("runs")]
    for report in reports:
        path = report.pop("path")
        try:  # named from the report's folder, where the reader finds it
            report["file"] = str(path.resolve().relative_to(args.out.resolve()))
        except ValueError:
            report["file"] = str(path)
    stem = write(reports, args.out, args.notes.read_text() if args.notes else "")
    print(f"wrote {stem}.json, .md")
    return stem


if __name__ == "__main__":
    main()
