"""thdpack's LoRA against transformers + PEFT (+ Liger, varlen attention) on one GPU: the same base weights, the
same samples, the same adapters' rank, alpha and modules, the same optimizer, at equal memory.

    python benchmarks/lora_vs_peft.py                          # llama3_8b's shape (the headline), then llama3_1b's
    python benchmarks/lora_vs_peft.py --shapes llama3_1b --configs varlen_liger,sdpa
    python benchmarks/lora_vs_peft.py --smoke                  # CPU, a tiny Llama, the whole script in seconds

The sibling of ``vs_hf.py`` (full fine-tuning), whose pieces it reuses: the Llama shapes, the chat-like synthetic mix
through thdpack's loader and budget plan, transformers fed each micro-batch as one packed row (``position_ids``
restarting per sample, ``cu_seq_lens`` for the varlen kernels, ``shift_labels`` and ``num_items_in_batch``: the same
per-token mean loss), ``torch.nn.attention.varlen.varlen_attn`` as transformers' attention, Liger's kernels.

Base: transformers' Llama of the shape, initialised from ``--seed`` and saved in bf16; both sides keep it frozen in
bf16. Adapters: rank ``--rank``, alpha ``--alpha``, on q, k, v, o, gate, up and down (``all-linear``), B zero at
the start (the first step's loss is the base's on both sides). thdpack: ``python -m thdpack.train model=hf
model.pretrained=<base> peft=lora`` (bf16 adapters with fp32 main copies in the distributed optimizer, Transformer
Engine layers, the fused output loss). PEFT: ``get_peft_model`` (its default casts the adapters to fp32) under
``torch.autocast`` bf16 (the usual TRL/accelerate bf16 setting), torch's fused AdamW on the adapters. Peer
configurations (``--configs``, :func:`parse_peer`): ``varlen_liger`` (the headline peer), ``varlen_liger_gc`` (with
gradient checkpointing), ``varlen``, ``sdpa``; each in its own process at the largest of ``--peft-budgets`` whose
peak memory fits within thdpack's peak.

Reported (``<out>/lora_vs_peft_<shape>_<gpu>_<date>.{json,md}``): real tokens/s over ``--steps`` after ``--warmup``,
peak memory, syncs of one steady step, the first step's loss on both sides; ``headline``:
``speedup_vs_fastest_peft``, ``fastest_peft_config``, the budgets, device, versions and date.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vs_hf  # noqa: E402  (the sibling benchmark: shapes, data, packed rows, varlen attention)

REPO = Path(__file__).resolve().parents[1]
LLAMA3_8B = {
    **vs_hf.LLAMA3_1B,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "tie_word_embeddings": False,
}
SHAPES = {"llama3_8b": LLAMA3_8B, "llama3_1b": vs_hf.LLAMA3_1B, "smoke": vs_hf.SMOKE}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# attention (varlen | sdpa), then _liger (Liger's kernels) and _gc (transformers' gradient checkpointing, no
# reentrant: smaller activations for larger micro-batches, at one more forward)
PEER_CONFIGS = ["varlen_liger", "varlen_liger_gc", "varlen", "sdpa"]


def parse_peer(name: str) -> tuple[str, bool, bool]:
    """``"varlen_liger_gc"`` -> ``("varlen", True, True)``: attention, Liger, gradient checkpointing."""
    attention, *flags = name.split("_")
    if attention not in ("varlen", "sdpa") or set(flags) - {"liger", "gc"} or len(set(flags)) != len(flags):
        raise ValueError(f"PEFT configuration '{name}': attention varlen or sdpa, then _liger and/or _gc")
    return attention, "liger" in flags, "gc" in flags


def save_base(shape: dict, seed: int, directory: Path) -> None:
    """transformers' Llama of ``shape`` initialised from ``seed`` in bf16 (the 8B base in 16 GB of host memory),
    saved as safetensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        **shape, attention_bias=False, mlp_bias=False, hidden_act="silu", initializer_range=0.02
    )
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if torch.cuda.is_available() else torch.float32)
    try:
        LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    finally:
        torch.set_default_dtype(dtype)


def overrides(args, shape: dict, hf_dir: Path, budget: int) -> list[str]:
    """thdpack's recipe: the base as ``model=hf``, LoRA, the chat mix, the step."""
    steps = args.warmup + args.steps
    return [
        "model=hf",
        f"model.pretrained={hf_dir}",
        "dataset.tokenizer=byte",
        "peft=lora",
        f"peft.rank={args.rank}",
        f"peft.alpha={args.alpha}",
        "peft.target_modules=all-linear",
        *vs_hf.CHAT_MIX,
        f"dataset.seq_length={shape['max_position_embeddings']}",
        f"dataset.synthetic.max_length={shape['max_position_embeddings']}",
        f"dataset.global_batch_size={args.global_batch_size}",
        f"dataset.micro_batch_tokens={budget}",
        "dataset.pad_to=longest",
        f"trainer.seed={args.seed}",
        f"trainer.train_iters={steps}",
        f"trainer.lr={args.lr}",
        f"trainer.min_lr={args.lr / 10}",
        "trainer.lr_warmup_iters=1",
        "trainer.weight_decay=0.0",
        "trainer.log_interval=1",
        "trainer.progress_bar=false",
        *([f"trainer.profile_step={args.warmup + 2}"] if torch.cuda.is_available() else []),
        *args.extra,
    ]


def run_thdpack(args, shape: dict, hf_dir: Path) -> dict:
    """thdpack's LoRA run at the first of ``--thdpack-budgets`` that runs; its steady-state figures."""
    from thdpack.training import loop

    errors = {}
    for budget in args.thdpack_budgets:
        cfg = vs_hf.compose(overrides(args, shape, hf_dir, budget))
        run_dir = args.work / f"thdpack_{budget}"
        shutil.rmtree(run_dir, ignore_errors=True)
        os.environ.pop("MASTER_PORT", None)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        try:
            summary = loop.train(cfg, run_dir)
        except torch.cuda.OutOfMemoryError as error:
            errors[budget] = f"out of memory: {str(error)[:160]}"
            loop._shutdown()
            continue
        finally:
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        return {**vs_hf.run_figures(run_dir, args.warmup, summary, budget), "errors": errors}
    raise RuntimeError(f"thdpack ran at none of the budgets {args.thdpack_budgets}: {errors}")


def run_peft(args, config_name: str, hf_dir: Path, shape: dict, cap_gib: float | None) -> dict:
    """One transformers + PEFT configuration at the largest budget that runs within ``cap_gib``."""
    tried = {}
    for budget in args.peft_budgets:
        try:
            result = _peft_at_budget(args, config_name, budget, hf_dir, shape, cap_gib)
        except torch.cuda.OutOfMemoryError:
            result = {"error": "out of memory"}
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if "error" not in result and (cap_gib is None or result["peak_memory_gib"] <= cap_gib):
            return {**result, "budget": budget, "tried": tried}
        tried[budget] = result.get("error", "over the memory cap")
    return {"error": "no budget fits", "tried": tried}


def _peft_at_budget(
    args, config_name: str, budget: int, hf_dir: Path, shape: dict, cap_gib: float | None
) -> dict:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from thdpack.data import build_train_data

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    attention, liger, checkpointing = parse_peer(config_name)
    implementation = vs_hf.register_varlen_attention() if attention == "varlen" else "sdpa"
    if liger:
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(
            rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=True
        )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    base = LlamaForCausalLM.from_pretrained(hf_dir, dtype=dtype, attn_implementation=implementation).to(
        device
    )
    if checkpointing:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = LoraConfig(r=args.rank, lora_alpha=args.alpha, target_modules=TARGETS, lora_dropout=0.0)
    model = get_peft_model(base, lora)
    model.train()
    cfg = vs_hf.compose(overrides(args, shape, hf_dir, budget))
    trainer = cfg.trainer
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        trained,
        lr=float(trainer.lr),
        betas=(float(trainer.adam_beta1), float(trainer.adam_beta2)),
        weight_decay=float(trainer.weight_decay),
        fused=device.type == "cuda",
    )
    data = build_train_data(cfg.dataset, dp_rank=0, dp_size=1, seed=int(trainer.seed))
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    result = vs_hf.timed_steps(
        args, model, trained, optimizer, data, attention, autocast, cap_gib, float(trainer.clip_grad)
    )
    return {
        **result,
        "trainable_parameters": sum(p.numel() for p in trained),
        "adapter_dtype": str(trained[0].dtype),
    }


def _child(args, name: str, shape_name: str, cap: float | None) -> dict:
    """One peer configuration in a fresh process (Liger patches transformers process-wide; each peak from zero)."""
    command = [
        sys.executable, str(Path(__file__).resolve()), "--peft-child", name, "--shapes", shape_name,
        "--peft-budgets", ",".join(map(str, args.peft_budgets)), "--global-batch-size", str(args.global_batch_size),
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--seed", str(args.seed), "--rank", str(args.rank),
        "--alpha", str(args.alpha), "--lr", str(args.lr), "--work", str(args.work),
        *(["--cap-gib", str(cap)] if cap is not None else []), *args.extra,
    ]  # fmt: skip
    return vs_hf.run_child(command, "LORA_RESULT ", timeout=3600)


def write(args, shape_name: str, shape: dict, thdpack: dict, peers: dict) -> Path:
    device, tag = vs_hf.device_tag()
    ran = {k: v for k, v in peers.items() if "real_tokens_per_s" in v}
    fastest = max(ran, key=lambda k: ran[k]["real_tokens_per_s"]) if ran else None
    date = datetime.now(timezone.utc).isoformat(timespec="seconds")
    versions = {
        name: vs_hf.package_version(name)
        for name in ("torch", "transformers", "peft", "liger-kernel", "megatron-core", "transformer-engine")
    } | {"python": platform.python_version()}
    payload = {
        "date": date,
        "device": device,
        "versions": versions,
        "headline": {
            "shape": shape_name,
            "speedup_vs_fastest_peft": thdpack["real_tokens_per_s"] / ran[fastest]["real_tokens_per_s"]
            if fastest
            else None,
            "fastest_peft_config": fastest,
            "thdpack_budget": thdpack["budget"],
            "peft_budget": ran[fastest]["budget"] if fastest else None,
            "steady_state_syncs": thdpack["steady_state_syncs"],
        },
        "setup": {
            "shape": shape,
            "rank": args.rank,
            "alpha": args.alpha,
            "targets": TARGETS,
            "lr": args.lr,
            "global_batch_size": args.global_batch_size,
            "steps": args.steps,
            "warmup": args.warmup,
            "seed": args.seed,
            "mix": vs_hf.CHAT_MIX,
            "extra": args.extra,
        },  # fmt: skip
        "thdpack": thdpack,
        "peft": peers,
    }
    stem = args.out / f"lora_vs_peft_{shape_name}_{tag}{'_smoke' if args.smoke else ''}_{date[:10]}"
    args.out.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
    head = payload["headline"]
    speedup = "-" if head["speedup_vs_fastest_peft"] is None else f"{head['speedup_vs_fastest_peft']:.2f}"
    lines = [
        f"# thdpack LoRA against transformers + PEFT, {shape_name} on {device}, {date[:10]}",
        "",
        f"LoRA rank {args.rank}, alpha {args.alpha:g}, all-linear; the base frozen ({'bf16' if torch.cuda.is_available() else 'fp32, CPU'}); the chat mix, "
        f"{args.global_batch_size} samples a step, {args.steps} timed steps after {args.warmup}. Versions: {versions}.",
        "",
        f"**Headline**: thdpack {speedup}x the fastest PEFT configuration ({head['fastest_peft_config']}) at equal "
        f"memory; {head['steady_state_syncs']} syncs in thdpack's steady step.",
        "",
        "| system | tokens a micro-batch | real tok/s | peak GiB | syncs/step | first-step loss |",
        "|---|---|---|---|---|---|",
        f"| thdpack peft=lora | {thdpack['budget']} | {thdpack['real_tokens_per_s']:,.0f} | "
        f"{vs_hf._fmt(thdpack['peak_memory_gib'], '{:.1f}')} | {thdpack['steady_state_syncs']} | "
        f"{thdpack['first_step_loss']:.4f} |",
    ]
    for name, r in peers.items():
        if "error" in r:
            lines.append(f"| transformers + PEFT {name} | {r['error']} | | | | |")
            continue
        lines.append(
            f"| transformers + PEFT {name} | {r['budget']} | {r['real_tokens_per_s']:,.0f} | "
            f"{vs_hf._fmt(r['peak_memory_gib'], '{:.1f}')} | {r['steady_state_syncs']} | {r['first_step_loss']:.4f} |"
        )
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return stem


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="llama3_8b,llama3_1b")
    parser.add_argument("--configs", default=",".join(PEER_CONFIGS))
    parser.add_argument("--thdpack-budgets", default="32768,24576,16384,8192")
    parser.add_argument("--peft-budgets", default="32768,24576,16384,12288,8192,4096")
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10, help="timed steps, after --warmup")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--work", type=Path, default=Path("outputs/lora_vs_peft"))
    parser.add_argument("--smoke", action="store_true", help="CPU: a tiny Llama, sdpa in fp32, one budget")
    parser.add_argument("--peft-child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cap-gib", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("extra", nargs="*", help="recipe overrides for thdpack's run")
    args = parser.parse_args()
    if args.smoke:
        args.shapes, args.configs = "smoke", "sdpa,sdpa_gc"
        args.thdpack_budgets, args.peft_budgets = "1024", "1024"
        args.global_batch_size, args.steps, args.warmup, args.rank = 4, 1, 1, 4
        args.extra = [
            *args.extra,
            "dataset.synthetic.median=40",
            "dataset.synthetic.min_length=8",
            "dataset.synthetic.num_samples=64",
        ]
    for name in args.configs.split(","):  # a misspelt configuration stops here, before the base is made
        parse_peer(name)
    args.thdpack_budgets = [int(b) for b in str(args.thdpack_budgets).split(",")]
    args.peft_budgets = [int(b) for b in str(args.peft_budgets).split(",")]
    for shape_name in args.shapes.split(","):
        shape = SHAPES[shape_name]
        hf_dir = args.work / f"base_{shape_name}"
        if args.peft_child:  # a child process: one configuration, its result as JSON on the last line
            result = run_peft(args, args.peft_child, hf_dir, shape, args.cap_gib)
            print("LORA_RESULT " + json.dumps(result), flush=True)
            return
        args.work.mkdir(parents=True, exist_ok=True)
        if not (hf_dir / "config.json").is_file():
            save_base(shape, args.seed, hf_dir)
        thdpack = run_thdpack(args, shape, hf_dir)
        cap = thdpack["peak_memory_gib"]
        peers = {}
        for name in args.configs.split(","):
            peers[name] = (
                run_peft(args, name, hf_dir, shape, cap)
                if args.smoke
                else _child(args, name, shape_name, cap)
            )
            if "first_step_loss" in peers[name]:
                peers[name]["first_step_loss_diff"] = (
                    peers[name]["first_step_loss"] - thdpack["first_step_loss"]
                )
        write(args, shape_name, shape, thdpack, peers)


if __name__ == "__main__":
    main()
