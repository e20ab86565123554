"""Vision-language fine-tuning on a GPU: a Qwen2.5-VL (or, with ``--family qwen3_vl``, Qwen3-VL) directory made
here, trained packed (TE, bf16) and padded on the same image chat batches; the first step's loss against
transformers' on the same batch and weights.

    python benchmarks/vlm_gpu.py --out benchmarks/results             # GPU: small model, 20 steps each
    python benchmarks/vlm_gpu.py --out benchmarks/results --family qwen3_vl
    python benchmarks/vlm_gpu.py --out /tmp/vlm --size tiny --steps 3   # a CPU smoke run (fp32, torch attention)

1. The model: ``tests/vlm_models.py``'s builder at ``--size`` (small: a 12-layer, 1024-wide Qwen2 text model and
   an 8-block vision tower; transformers' own random initialisation) with its tokenizer, chat template and image
   processor, saved to ``<out>/vlm_model`` (or ``--directory``, an existing Qwen2.5-VL or Qwen3-VL directory).
2. The data: ``dataset=embedded_vlm`` with pictures of 56 to ``--max-side`` pixels a side (4 to 256 image tokens
   each at 448), one or two pictures or none per sample: a vision-language length mix.
3. Two runs of ``python -m thdpack.train model=hf model.pretrained=DIR`` on the same global batches:
   ``packed`` (micro-batches filled to ``micro_batch_size x seq_length`` tokens) and ``padded`` (BSHD rows padded
   to the longest sample of each micro-batch, ``micro_batch_size`` per micro-batch). Steady-state real tokens/s
   (steps after ``--warmup``), peak memory, the loss curve.
4. transformers' own model (``Qwen2_5_VLForConditionalGeneration``, ``Qwen3VLForConditionalGeneration``) on the
   first global batch (each sample alone, the same
   pixels, the assistant targets): its per-token loss in bf16 and in fp32, against the packed run's step-1 loss.

Writes ``<out>/vlm_gpu_<device>_<date>.json`` and ``.md``. Exit status 1 when the first-step loss differs from
transformers' (same precision) by more than ``--tolerance`` (0.5%).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

MODES = {
    "packed": [
        "dataset.pack_sequences_in_batch=true",
        "dataset.micro_batch_tokens=auto",
        "dataset.pad_to=longest",
    ],
    "padded": ["dataset.pack_sequences_in_batch=false", "dataset.pad_to=longest"],
}


def data_overrides(args) -> list[str]:
    return [
        "dataset=embedded_vlm",
        f"dataset.vlm.num_samples={args.samples}",
        "dataset.vlm.min_side=56",
        f"dataset.vlm.max_side={args.max_side}",
        f"dataset.seq_length={args.seq_length}",
        f"dataset.global_batch_size={args.global_batch}",
        f"dataset.micro_batch_size={args.micro_batch}",
        f"trainer.seed={args.seed}",
    ]


def train(directory: Path, mode: str, args, run_dir: Path) -> dict:
    """One ``python -m thdpack.train`` run (a fresh process); its metrics records and summary."""
    overrides = [
        "model=hf",
        f"model.pretrained={directory}",
        *data_overrides(args),
        *MODES[mode],
        f"trainer.train_iters={args.steps}",
        "trainer.log_interval=1",
        f"trainer.lr={args.lr}",
        f"trainer.min_lr={args.lr / 10}",
        "trainer.lr_warmup_iters=2",
        "trainer.progress_bar=false",
        f"hydra.run.dir={run_dir}",
    ]
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    command = [sys.executable, "-m", "thdpack.train", *overrides]
    print("+", " ".join(command), flush=True)
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    (run_dir / "stdout.txt").parent.mkdir(parents=True, exist_ok=True)
    (run_dir / "stdout.txt").write_text(done.stdout + done.stderr)
    if done.returncode:
        raise SystemExit(f"{mode} run failed ({done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    steady = [r for r in records if r["step"] > args.warmup]
    return {
        "overrides": overrides,
        "losses": [r.get("loss") for r in records],
        "real_tokens_per_s": statistics.median(r["real_tokens_per_s"] for r in steady),
        "all_tokens_per_s": statistics.median(r["all_tokens_per_s"] for r in steady),
        "step_time_s": statistics.median(r["step_time_s"] for r in steady),
        "pad_fraction": statistics.mean(r["pad_fraction"] for r in steady),
        "peak_memory_gib": summary.get("peak_memory_gib"),
        "steps_measured": len(steady),
    }


def first_batch_rows(directory: Path, args):
    """The first global batch as the training loop reads it (the same dataset, seed and overlong rule), one
    ``(tokens, target mask, pixel_values, image_grid_thw)`` per sample."""
    from thdpack.data.embedded_vlm import EmbeddedVLDataset
    from thdpack.data.loader import TrainData
    from thdpack.hf.processor import VLProcessor

    processor = VLProcessor(directory)
    dataset = EmbeddedVLDataset(
        processor, num_samples=args.samples, seed=0, min_side=56, max_side=args.max_side
    )
    data = TrainData(
        dataset,
        seq_length=args.seq_length,
        global_batch_size=args.global_batch,
        micro_batch_size=args.global_batch,
        dp_rank=0,
        dp_size=1,
        seed=args.seed,
        overlong="error",
        pad_to="longest",
        pad_id=processor.pad_id,
    )
    (batch,) = data.next_step()
    rows, image = [], 0
    grids = batch.get("image_grid_thw", torch.zeros(0, 3, dtype=torch.int64))
    patches = (
        np.concatenate([[0], np.cumsum(grids.prod(-1).numpy())]) if len(grids) else np.zeros(1, np.int64)
    )
    for b in range(batch["tokens"].shape[0]):
        length = int(batch["attention_mask"][b].sum())
        tokens = batch["tokens"][b, :length]
        index = batch["vision_index"][b, :length] if "vision_index" in batch else torch.zeros(length)
        runs = int(((index[1:] > 0) & (index[:-1] == 0)).sum() + (index[:1] > 0).sum())
        rows.append(
            (
                tokens,
                batch["labels"][b, :length],
                batch["pixel_values"][patches[image] : patches[image + runs]] if runs else None,
                grids[image : image + runs] if runs else None,
            )
        )
        image += runs
    return rows


def transformers_loss(directory: Path, rows, dtype: torch.dtype, device: str) -> float:
    """transformers' per-token loss over ``rows`` (each sample alone), the targets being the collated labels."""
    import inspect

    import transformers

    (architecture,) = json.loads((Path(directory) / "config.json").read_text())["architectures"]
    model_class = getattr(transformers, architecture)
    model = model_class.from_pretrained(str(directory), dtype=dtype).to(device).eval()
    takes_types = "mm_token_type_ids" in inspect.signature(model.model.forward).parameters
    total, count = 0.0, 0
    with torch.no_grad():
        for tokens, labels, pixels, grids in rows:
            ids = tokens[None].to(device)
            kwargs = {}
            if grids is not None:
                kwargs = {"pixel_values": pixels.to(device, dtype), "image_grid_thw": grids.to(device)}
                if takes_types:
                    kwargs["mm_token_type_ids"] = (ids == model.config.image_token_id).long()
            logits = model(input_ids=ids, use_cache=False, **kwargs).logits[0].float()
            keep = labels >= 0
            losses = torch.nn.functional.cross_entropy(
                logits[keep.to(device)], labels[keep].to(device), reduction="sum"
            )
            total += float(losses)
            count += int(keep.sum())
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return total / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--directory", type=Path, default=None, help="an existing Qwen2.5-VL or Qwen3-VL directory"
    )
    parser.add_argument("--family", default="qwen2_5_vl", choices=["qwen2_5_vl", "qwen3_vl"])
    parser.add_argument("--size", default="small", choices=["tiny", "small"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--samples", type=int, default=4000)
    parser.add_argument("--max-side", type=int, default=448)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--tolerance", type=float, default=0.005)
    args = parser.parse_args()
    os.environ["HF_HUB_OFFLINE"] = "1"
    args.out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    directory = args.directory
    if directory is None:
        from tests.vlm_models import build_tiny_vl

        directory = build_tiny_vl(args.out / "vlm_model", size=args.size, sharp=False, family=args.family)

    rows = first_batch_rows(directory, args)
    lengths = [len(t) for t, *_ in rows]
    images = [0 if g is None else len(g) for *_, g in rows]
    reference = {"fp32": transformers_loss(directory, rows, torch.float32, device)}
    if device == "cuda":
        reference["bf16"] = transformers_loss(directory, rows, torch.bfloat16, device)
    runs = {mode: train(directory, mode, args, args.out / f"vlm_{mode}") for mode in MODES}
    first = runs["packed"]["losses"][0]
    same_precision = reference["bf16" if device == "cuda" else "fp32"]
    result = {
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "versions": {
            "torch": torch.__version__,
            "transformers": _version("transformers"),
            "megatron-core": _version("megatron-core"),
            "transformer-engine": _version("transformer_engine"),
        },
        "model_directory": str(directory),
        "size": args.size if args.directory is None else "given",
        "first_batch": {
            "samples": len(rows),
            "tokens": int(sum(lengths)),
            "length_min_median_max": [min(lengths), int(np.median(lengths)), max(lengths)],
            "images_per_sample": {str(k): images.count(k) for k in sorted(set(images))},
        },
        "first_step_loss": {
            "thdpack_packed": first,
            "thdpack_padded": runs["padded"]["losses"][0],
            "transformers": reference,
            "relative_difference_same_precision": abs(first - same_precision) / abs(same_precision),
            "relative_difference_fp32": abs(first - reference["fp32"]) / abs(reference["fp32"]),
            "tolerance": args.tolerance,
        },
        "runs": runs,
        "packed_over_padded_real_tokens_per_s": runs["packed"]["real_tokens_per_s"]
        / runs["padded"]["real_tokens_per_s"],
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    family = "" if args.family == "qwen2_5_vl" or args.directory is not None else f"{args.family}_"
    tag = f"vlm_gpu_{family}{'h100' if 'H100' in result['device'] else 'h200' if 'H200' in result['device'] else device}_{datetime.now().strftime('%Y-%m-%d')}"
    (args.out / f"{tag}.json").write_text(json.dumps(result, indent=1))
    (args.out / f"{tag}.md").write_text(report(result))
    print(report(result))
    if result["first_step_loss"]["relative_difference_same_precision"] > args.tolerance:
        raise SystemExit(1)


def report(r: dict) -> str:
    loss = r["first_step_loss"]
    lines = [
        f"# Vision-language fine-tuning, {r['device']}, {r['date']}",
        "",
        f"Model: {r['model_directory']} ({r['size']}); versions {r['versions']}.",
        f"First global batch: {r['first_batch']}.",
        "",
        "| first-step loss | value |",
        "|---|---|",
        f"| thdpack packed | {loss['thdpack_packed']:.6f} |",
        f"| thdpack padded | {loss['thdpack_padded']:.6f} |",
        *[f"| transformers {k} | {v:.6f} |" for k, v in loss["transformers"].items()],
        f"| relative difference, same precision | {loss['relative_difference_same_precision']:.2e} (tolerance {loss['tolerance']}) |",
        f"| relative difference to fp32 | {loss['relative_difference_fp32']:.2e} |",
        "",
        "| run | real tok/s | all tok/s | step s | pad | peak GiB | loss first -> last |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, run in r["runs"].items():
        losses = [x for x in run["losses"] if x is not None]
        memory = "-" if run["peak_memory_gib"] is None else f"{run['peak_memory_gib']:.1f}"
        lines.append(
            f"| {mode} | {run['real_tokens_per_s']:,.0f} | {run['all_tokens_per_s']:,.0f} | {run['step_time_s']:.3f} | "
            f"{run['pad_fraction']:.1%} | {memory} | {losses[0]:.4f} -> {losses[-1]:.4f} |"
        )
    lines += ["", f"Packed over padded, real tokens/s: {r['packed_over_padded_real_tokens_per_s']:.2f}x", ""]
    return "\n".join(lines)


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
