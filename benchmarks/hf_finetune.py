"""Fine-tune Hugging Face models with thdpack and check them against transformers (issue 22's GPU check).

    python benchmarks/hf_finetune.py --out benchmarks/results                  # llama3_1b-shaped, small Qwen3-MoE
    python benchmarks/hf_finetune.py --shapes tiny --steps 3 --out /tmp/hf     # a CPU smoke run (fp32, torch)

For each model: an HF directory made here (transformers from a config, random weights at transformers' own
initialisation, bf16 on GPU), ``model=hf model.pretrained=DIR`` set up in this process with the training loop's
own ``setup_run`` (on a GPU: Transformer Engine attention, bf16, packed micro-batches; MoE with grouped-GEMM
experts), then:

* the first global batch through transformers (same weights, the same padded micro-batches, per-token loss over
  all of them) and through thdpack's first training step: the two losses (target: within 0.5%), per micro-batch;
* the logits of the first micro-batch, thdpack's packed row against transformers' padded batch on real tokens;
* ``--steps`` training steps (fine-tuning rates: lr 1e-5 to 1e-6), the losses;
* a checkpoint, exported with ``python -m thdpack.export`` (one CPU process), compared bit for bit with the trained
  Megatron weights and loaded by ``AutoModelForCausalLM``; how far training moved the weights from the imported
  ones (a few lr steps: the optimizer's fp32 main parameters started from the imported weights).

Writes ``<out>/hf_finetune_<tag>_<date>.json`` and ``.md``. No network: everything is made here.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")

LLAMA3_ROPE = dict(
    rope_theta=500000.0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
)
SHAPES = {
    "full": {
        # Llama 3.2 1B's shape: 16 layers, hidden 2048, GQA 32/8, SwiGLU 8192, tied, llama3 RoPE scaling
        "llama3_1b": (
            "LlamaForCausalLM",
            "LlamaConfig",
            dict(
                vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
                tie_word_embeddings=True, max_position_embeddings=131072, **LLAMA3_ROPE,
            ),
        ),
        # a small Qwen3-MoE: 8 layers, hidden 1024, 16 experts top-4 (renormalised), q/k norms, untied
        "qwen3_moe_small": (
            "Qwen3MoeForCausalLM",
            "Qwen3MoeConfig",
            dict(
                vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
                num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=16, num_experts_per_tok=4,
                moe_intermediate_size=512, norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1000000.0,
                tie_word_embeddings=False,
            ),
        ),
    },
    "tiny": {
        "llama3_tiny": (
            "LlamaForCausalLM",
            "LlamaConfig",
            dict(
                vocab_size=512, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=131072, **LLAMA3_ROPE,
            ),
        ),
        "qwen3_moe_tiny": (
            "Qwen3MoeForCausalLM",
            "Qwen3MoeConfig",
            dict(
                vocab_size=512, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                norm_topk_prob=True,
            ),
        ),
        # Gemma 3 (4B+ text shape, tiny): a sliding layer (window 64) then a global one with linear RoPE scaling
        "gemma3_tiny": (
            "Gemma3ForCausalLM",
            "Gemma3TextConfig",
            dict(
                vocab_size=512, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32, sliding_window=64,
                layer_types=["sliding_attention", "full_attention"], rope_scaling={"rope_type": "linear", "factor": 8.0},
            ),
        ),
        # gpt-oss (tiny): sinks, a sliding layer (window 64) then a full one, YaRN biting at these lengths, MoE
        "gpt_oss_tiny": (
            "GptOssForCausalLM",
            "GptOssConfig",
            dict(
                vocab_size=512, hidden_size=128, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=64,
                layer_types=["sliding_attention", "full_attention"], max_position_embeddings=1024,
                rope_scaling={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                              "truncate": False, "original_max_position_embeddings": 128},
            ),
        ),
    },
}  # fmt: skip


def make_hf_directory(
    directory: Path, model_class: str, config_class: str, kwargs: dict, device, dtype
) -> Path:
    """transformers' model of that config at its own initialisation, saved (safetensors) to ``directory``."""
    import transformers

    config = getattr(transformers, config_class)(**kwargs)
    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(transformers, model_class)._from_config(config, dtype=dtype)
    shutil.rmtree(directory, ignore_errors=True)
    model.save_pretrained(directory)
    del model
    return directory


def transformers_reference(directory: Path, batches: list[dict], device, dtype, rows: int = 4) -> dict:
    """transformers on each padded micro-batch, ``rows`` rows at a time: per-token loss sums and counts (the
    collator's shifted labels), and the first micro-batch's logits on each sample's real tokens."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    model = (
        AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, local_files_only=True).to(device).eval()
    )
    sums, counts, first_logits = [], [], []
    with torch.no_grad():
        for i, batch in enumerate(batches):
            total, count = 0.0, 0
            for start in range(0, batch["tokens"].shape[0], rows):
                part = slice(start, start + rows)
                tokens, mask = batch["tokens"][part].to(device), batch["attention_mask"][part].to(device)
                labels = batch["labels"][part].to(device).masked_fill(mask == 0, -100)
                logits = model(tokens, attention_mask=mask).logits
                total += float(
                    F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum")
                )
                count += int((labels != -100).sum())
                if i == 0:
                    first_logits += [logits[r, :n].clone() for r, n in enumerate(mask.sum(1).tolist())]
                del logits
            sums.append(total)
            counts.append(count)
    del model
    return {"sums": sums, "counts": counts, "first_logits": first_logits}


def thdpack_logits(run, batch) -> tuple[torch.Tensor, list[int]]:
    """thdpack's packed logits ``[1, T, V]`` of one micro-batch and the samples' starts in the row."""
    from thdpack.megatron.batch import BatchConfig, get_batch
    from thdpack.megatron.unwrap import unwrap_model

    inputs = get_batch(iter([batch]), unwrap_model(run.model).config, BatchConfig())
    with torch.no_grad():
        logits = run.model(
            inputs.tokens,
            inputs.position_ids,
            None,
            packed_seq_params=inputs.packed_seq_params,
            padding_mask=inputs.padding_mask,
        )
    return logits, inputs.packed_seq_params.cu_seqlens_q_padded.tolist()


def compare_logits(ours: torch.Tensor, starts: list[int], reference: list[torch.Tensor]) -> dict:
    """thdpack's packed row against transformers' per-sample logits on real tokens."""
    diffs, refs = [], []
    for i, ref in enumerate(reference):
        a = ours[0, starts[i] : starts[i] + len(ref), : ref.shape[-1]].float()
        diffs.append((a - ref.float()).flatten())
        refs.append(ref.float().flatten())
    diff, ref = torch.cat(diffs), torch.cat(refs)
    rms_logit = ref.pow(2).mean().sqrt()
    # per token: a mixture of experts may route a token whose router scores tie within bf16's rounding to another
    # expert on one side; such tokens differ by much more than the rest, which the per-token figures separate
    vocab = reference[0].shape[-1]
    per_token = diff.view(-1, vocab).pow(2).mean(dim=1).sqrt() / rms_logit
    return {
        "max_abs_diff": float(diff.abs().max()),
        "mean_abs_diff": float(diff.abs().mean()),
        "rms_diff_over_rms_logit": float(diff.pow(2).mean().sqrt() / rms_logit),
        "median_token_rms_diff_over_rms_logit": float(per_token.median()),
        "tokens_over_2e-2": float((per_token > 2e-2).float().mean()),
        "tokens": sum(len(r) for r in reference),
    }


def run_model(name: str, spec: tuple, args, work: Path) -> dict:
    from hydra import compose, initialize_config_dir
    from megatron.core import parallel_state as ps
    from safetensors.torch import load_file

    from thdpack.hf.checkpoint import HFCheckpoint
    from thdpack.hf.checkpoint_hf import hf_state
    from thdpack.hf.directory import keep_with_checkpoint
    from thdpack.hf.gpt_oss_experts import fuse_experts
    from thdpack.megatron.checkpoint import save_checkpoint
    from thdpack.megatron.loss import LM_LOSS
    from thdpack.megatron.unwrap import unwrap_model
    from thdpack.models import family_of
    from thdpack.training.loop import recipes_dir, setup_run, train_step

    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    model_class, config_class, kwargs = spec
    moe = "num_experts" in kwargs or "num_local_experts" in kwargs
    started = time.perf_counter()
    directory = make_hf_directory(work / name / "hf", model_class, config_class, kwargs, device, dtype)
    made_s = time.perf_counter() - started
    ckpt = work / name / "ckpt"
    shutil.rmtree(ckpt, ignore_errors=True)
    overrides = [
        "model=hf",
        f"model.pretrained={directory}",
        "dataset=embedded",
        "dataset.tokenizer=byte",  # the model's ids cover the byte tokenizer's 259
        f"dataset.seq_length={args.seq_length}",
        f"dataset.micro_batch_size={args.micro_batch_size}",
        f"dataset.global_batch_size={args.global_batch_size}",
        "dataset.pad_to=longest",  # transformers' reference runs the padded micro-batches
        f"trainer.train_iters={args.steps}",
        "trainer.lr=1e-5",
        "trainer.min_lr=1e-6",
        "trainer.lr_warmup_iters=1",
        "trainer.progress_bar=false",
        f"checkpoint.dir={ckpt}",
        *(["model.config.moe_grouped_gemm=true"] if moe and cuda else []),
        *args.extra,
    ]
    with initialize_config_dir(str(recipes_dir()), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    os.environ.pop("MASTER_PORT", None)  # a fresh store for each model of this process
    run = setup_run(cfg)
    setup_s = time.perf_counter() - started - made_s

    batches = run.data.next_step()
    reference = transformers_reference(directory, batches, device, dtype)
    ours, starts = thdpack_logits(run, batches[0])
    logits = compare_logits(ours, starts, reference.pop("first_logits"))
    del ours
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()

    reports, _ = train_step(run, batches)  # the first step's forward runs on the imported weights
    first = [[float(x) for x in r[LM_LOSS.key]] for r in reports]
    thd_loss = sum(s for s, _ in first) / sum(c for _, c in first)
    hf_loss = sum(reference["sums"]) / sum(reference["counts"])
    losses = [float(LM_LOSS.reduce(reports))]
    step_started = time.perf_counter()
    for _ in range(args.steps - 1):
        reports, _ = train_step(run, run.data.next_step())
        losses.append(float(LM_LOSS.reduce(reports)))
    train_s = time.perf_counter() - step_started

    save_checkpoint(
        ckpt, args.steps, run.model, run.optimizer, run.scheduler, {"data": run.data.state_dict()}
    )
    keep_with_checkpoint(ckpt, run.cfg.model, run.runtime.precision)
    checkpoint = HFCheckpoint.open(directory)
    family = family_of(checkpoint)
    mapping, vocab = family.mapping, int(checkpoint.config["vocab_size"])
    trained = {k: v.detach().cpu() for k, v in hf_state(unwrap_model(run.model), mapping, vocab).items()}
    if family.name == "gpt_oss":  # its checkpoints hold each layer's experts fused
        trained = fuse_experts(trained)
    rope = {k: run.cfg.model.get(k) for k in ("rotary_base", "rope_scaling", "local_rotary_base")}
    peak_gib = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    del run
    ps.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()

    out = work / name / "exported"
    shutil.rmtree(out, ignore_errors=True)
    export_started = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-m", "thdpack.export", str(ckpt), str(out)], env=env, capture_output=True, text=True
    )
    export_s = time.perf_counter() - export_started
    if done.returncode:
        raise RuntimeError(f"python -m thdpack.export failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    exported = {}
    for file in sorted(out.glob("model-*.safetensors")):
        exported |= load_file(str(file))
    imported = {}
    for file in sorted(directory.glob("*.safetensors")):
        imported |= load_file(str(file))
    bitwise = sorted(exported) == sorted(trained) and all(
        torch.equal(exported[k], trained[k]) for k in trained
    )
    moved = max(float((exported[k].float() - imported[k].float()).abs().max()) for k in imported)

    from transformers import AutoModelForCausalLM

    loaded = type(AutoModelForCausalLM.from_pretrained(out, local_files_only=True)).__name__
    return {
        "model": name,
        "hf_config": {k: v for k, v in kwargs.items()},
        "rope_as_imported": json.loads(json.dumps(rope, default=dict)),  # the model group's RoPE keys
        "first_step_loss": {
            "thdpack": thd_loss,
            "transformers": hf_loss,
            "relative_difference": (thd_loss - hf_loss) / hf_loss,
            "per_micro_batch_thdpack": [s / max(c, 1) for s, c in first],
            "per_micro_batch_transformers": [
                s / max(c, 1) for s, c in zip(reference["sums"], reference["counts"], strict=True)
            ],
            "tokens": sum(reference["counts"]),
        },
        "first_micro_batch_logits": logits,
        "losses": losses,
        "export": {
            "bitwise_equal_to_trained_weights": bitwise,
            "tensors": len(exported),
            "loaded_by_transformers_as": loaded,
            "max_abs_change_from_imported": moved,
            "seconds": export_s,
        },
        "seconds": {"make_hf_directory": made_s, "setup": setup_s, "steps_2_to_n": train_s},
        "peak_memory_gib": peak_gib,
        "overrides": overrides,
    }


def versions() -> dict:
    import megatron.core
    import transformers

    found = {"torch": torch.__version__, "transformers": transformers.__version__}
    found["megatron-core"] = megatron.core.__version__
    try:
        import transformer_engine

        found["transformer-engine"] = transformer_engine.__version__
    except ImportError:
        found["transformer-engine"] = None
    return found


def write_report(result: dict, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"hf_finetune_{result['name']}_{result['tag']}_{result['date']}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"# Hugging Face models fine-tuned with thdpack ({result['device']}, {result['date']})",
        "",
        f"Command: `{result['command']}`; versions: {result['versions']}",
        "",
        "| model | first-step loss thdpack | transformers | rel. diff | logits max abs diff | rms diff / rms | "
        "loss after steps | export bitwise | export max change |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["models"]:
        f, g, e = r["first_step_loss"], r["first_micro_batch_logits"], r["export"]
        lines.append(
            f"| {r['model']} | {f['thdpack']:.5f} | {f['transformers']:.5f} | {f['relative_difference']:+.2e} | "
            f"{g['max_abs_diff']:.3g} | {g['rms_diff_over_rms_logit']:.2e} | {r['losses'][-1]:.4f} "
            f"({len(r['losses'])} steps) | {e['bitwise_equal_to_trained_weights']} | {e['max_abs_change_from_imported']:.2e} |"
        )
    lines += ["", "Losses per step:", ""]
    lines += [f"- {r['model']}: " + ", ".join(f"{x:.4f}" for x in r["losses"]) for r in result["models"]]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return stem.with_suffix(".json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="where the JSON and MD reports go")
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="full")
    parser.add_argument("--models", default=None, help="comma-separated subset of the shapes' models")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--work", type=Path, default=Path("outputs/hf_finetune"), help="HF dirs, checkpoints")
    parser.add_argument("--tag", default=None, help="hardware tag in file names (default: from the GPU name)")
    parser.add_argument("extra", nargs="*", help="recipe overrides for every run")
    args = parser.parse_args()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    tag = args.tag or (
        "h200" if "H200" in gpu else "h100" if "H100" in gpu else "cpu" if gpu == "cpu" else "gpu"
    )
    shapes = SHAPES[args.shapes]
    names = args.models.split(",") if args.models else list(shapes)
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device": gpu,
        "tag": tag,
        "name": "_".join(names) if args.models else args.shapes,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "versions": versions(),
        "models": [],
    }
    for name in names:
        result["models"].append(run_model(name, shapes[name], args, args.work))
        path = write_report(result, args.out)  # after each model: a later failure keeps what was measured
        r = result["models"][-1]["first_step_loss"]
        print(f"{name}: first-step loss {r['thdpack']:.5f} vs transformers {r['transformers']:.5f} "
              f"({r['relative_difference']:+.2e}); report {path}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
