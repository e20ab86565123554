"""Peak memory against the packed token budget: the memory model of ``dataset.micro_batch_tokens: fit``.

    python benchmarks/token_budget.py                                   # llama3_1b, the chat mix, one GPU
    python benchmarks/token_budget.py --budgets 16384,32768,49152 model.output_loss=megatron
    python benchmarks/token_budget.py trainer.use_precision_aware_optimizer=true trainer.exp_avg_dtype=bf16 \\
        trainer.exp_avg_sq_dtype=bf16                                    # one row per optimizer-state setting

Trains the recipe (``--model``, the chat-like synthetic mix, 32 samples a step) for ``--steps`` steps at each
budget, reads the peak memory (``torch.cuda.max_memory_allocated``), fits ``peak = fixed + per_token * budget`` by
least squares over the budgets that ran (out of memory is recorded, not fatal) and prints the
``thdpack.training.token_budget.MEASURED`` entry, the budget ``fit`` would pick on this GPU, and the loss and
real tokens/s of each budget. Writes ``<out>/token_budget_<gpu>_<date>.{json,md}``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

CHAT_MIX = [
    "dataset=synthetic",
    "dataset.synthetic.median=700",
    "dataset.synthetic.sigma=1.0",
    "dataset.synthetic.min_length=32",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama3_1b")
    parser.add_argument("--budgets", default="8192,16384,32768,49152")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--work", type=Path, default=Path("outputs/token_budget"))
    parser.add_argument("extra", nargs="*", help="recipe overrides for every run")
    args = parser.parse_args()

    from hydra import compose, initialize_config_dir

    from thdpack.megatron.output_loss import resolve_output_loss
    from thdpack.training import loop
    from thdpack.training.token_budget import MemoryModel, largest_budget, setting_key

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    rows = {}
    cfg = None
    for budget in (int(b) for b in args.budgets.split(",")):
        overrides = [
            f"model={args.model}",
            *CHAT_MIX,
            "dataset.seq_length=8192",
            "dataset.global_batch_size=32",
            f"dataset.micro_batch_tokens={budget}",
            "dataset.pad_to=longest",
            f"trainer.train_iters={args.steps}",
            "trainer.lr_warmup_iters=1",
            "trainer.progress_bar=false",
            *args.extra,
        ]
        with initialize_config_dir(str(loop.recipes_dir()), version_base="1.3"):
            cfg = compose("train", overrides=overrides)
        run_dir = args.work / str(budget)
        shutil.rmtree(run_dir, ignore_errors=True)
        os.environ.pop("MASTER_PORT", None)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        try:
            summary = loop.train(cfg, run_dir)
            rows[budget] = {
                "peak_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None,
                "real_tokens_per_s": summary.get("real_tokens_per_s"),
                "final_loss": summary.get("final_loss"),
            }
        except torch.cuda.OutOfMemoryError as error:
            rows[budget] = {"error": f"out of memory: {str(error)[:160]}"}
            loop._shutdown()
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        print(f"{budget} tokens: {rows[budget]}", flush=True)

    ran = [(b, r["peak_bytes"]) for b, r in rows.items() if r.get("peak_bytes")]
    key = (cfg.model.get("name"), resolve_output_loss(cfg.model, device), setting_key(cfg.trainer))
    entry = None
    if len(ran) >= 2:
        budgets, peaks = np.array([b for b, _ in ran], float), np.array([p for _, p in ran], float)
        per_token, fixed = np.polyfit(budgets, peaks, 1)
        entry = MemoryModel(fixed, per_token, gpu)
    total = torch.cuda.get_device_properties(0).total_memory if device == "cuda" else None
    payload = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": gpu,
        "device_memory_bytes": total,
        "versions": {"torch": torch.__version__},
        "key": list(key),
        "overrides": args.extra,
        "rows": rows,
        "memory_model": None if entry is None else {"fixed_bytes": entry[0], "per_token_bytes": entry[1]},
        "fit_budget": largest_budget(entry, total) if entry is not None and total else None,
    }
    tag = "h200" if "H200" in gpu else "h100" if "H100" in gpu else device
    stem = args.out / f"token_budget_{tag}_{payload['date'][:10]}"
    args.out.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(payload, indent=2) + "\n")
    lines = [
        f"# Peak memory against the token budget: {key} on {gpu}, {payload['date'][:10]}",
        "",
        "| tokens a micro-batch | peak GiB | real tok/s | final loss |",
        "|---|---|---|---|",
    ]
    for budget, r in rows.items():
        if "error" in r:
            lines.append(f"| {budget} | {r['error'][:60]} | | |")
        else:
            peak = r["peak_bytes"] / 2**30 if r["peak_bytes"] else float("nan")
            lines.append(f"| {budget} | {peak:.1f} | {r['real_tokens_per_s']:,.0f} | {r['final_loss']:.4f} |")
    if entry is not None:
        lines += [
            "",
            f"peak = {entry[0] / 2**30:.2f} GiB + {entry[1] / 2**20:.3f} MiB x tokens; `fit` on this GPU: "
            f"{payload['fit_budget']} tokens. Entry for `thdpack.training.token_budget.MEASURED`:",
            "",
            f"    {key}: MemoryModel({entry[0]:.0f}, {entry[1]:.0f}, {gpu!r}),",
        ]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {stem}.json, .md")


if __name__ == "__main__":
    main()
