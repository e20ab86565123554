"""thdpack against transformers on one GPU: the same weights, the same samples, the same optimizer.

    python benchmarks/vs_hf.py                       # llama3_1b's shape, the chat-like mix, 32 samples a step
    python benchmarks/vs_hf.py --configs varlen_liger_bf16,sdpa_autocast --thdpack-budgets 32768
    python benchmarks/vs_hf.py --smoke               # CPU, a tiny Llama, the whole script in seconds

Weights: a ``LlamaConfig`` shaped like the ``llama3_1b`` recipe (hidden 2048, 16 layers, GQA 32/8, SwiGLU 8192, vocab
128,256, tied embeddings, RoPE base 500,000), initialised by transformers from ``--seed`` and saved; thdpack's model
gets the same tensors by name (fused QKV per query group, ``[gate; up]``; the mapping of docs/design.md section 5).

Samples: thdpack's own loader, the chat-like synthetic mix (lognormal median 700, sigma 1.0, 32-8192 tokens),
``--global-batch-size`` samples a step. Each side cuts a step into micro-batches of at most ``budget`` tokens with
the loader's plan (``thdpack.data.budget``); transformers gets each micro-batch as one packed row: the real tokens
back to back, ``position_ids`` restarting at every sample, no ``attention_mask``, ``use_cache=False``, the shifted
labels as ``shift_labels`` (the last token of a sample predicts nothing, as in thdpack) and the step's count of
counted tokens as ``num_items_in_batch``: the loss of a step is the same per-token mean on both sides.

transformers configurations (``--configs``; each in its own process, at the largest of ``--hf-budgets`` whose peak
memory fits within thdpack's peak, out-of-memory budgets skipped):

* ``sdpa``: its SDPA path with the block-diagonal mask it builds from the position ids;
* ``varlen``: flash-attention-class kernels, ``torch.nn.attention.varlen.varlen_attn`` registered through
  ``AttentionInterface``, ``cu_seq_lens_q/k`` and ``max_length_q/k`` from the sample lengths;
* ``varlen_liger``: the same with Liger-Kernel (``apply_liger_kernel_to_llama``: RoPE, RMSNorm, SwiGLU, fused linear
  cross entropy);

each ``_bf16`` (bf16 parameters and optimizer state) or ``_autocast`` (fp32 parameters, ``torch.autocast`` bf16).
Optimizer on both sides: AdamW (torch's fused kernel; thdpack's step runs it on the distributed optimizer's fp32
state) with the recipe's betas, weight decay and gradient clipping; transformers at the recipe's peak learning rate.

Reported: real tokens/s and TFLOP/s over ``--steps`` after ``--warmup``, peak memory, syncs of one steady step,
first-step loss of each configuration against thdpack's. Writes ``<out>/vs_hf_<gpu>_<date>.{json,md}`` with a
top-level ``headline``: ``speedup_vs_fastest_hf``, ``fastest_hf_config``, ``steady_state_syncs``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
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
CHAT_MIX = [
    "dataset=synthetic",
    "dataset.synthetic.median=700",
    "dataset.synthetic.sigma=1.0",
    "dataset.synthetic.min_length=32",
]
HF_CONFIGS = [f"{a}_{p}" for a in ("varlen_liger", "varlen", "sdpa") for p in ("bf16", "autocast")]

# llama3_1b (recipes/model/llama3_1b.yaml) and the CPU smoke shape, as transformers' LlamaConfig keys
LLAMA3_1B = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    max_position_embeddings=8192,
)
SMOKE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=384,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    max_position_embeddings=256,
)


def thdpack_overrides(args, shape: dict, budget: int) -> list[str]:
    """The recipe of thdpack's run: the model group from the Llama shape, the chat mix, the step."""
    steps = args.warmup + args.steps
    model = [
        f"model={'llama3_1b' if not args.smoke else 'tiny_gpt'}",
        f"model.vocab_size={shape['vocab_size']}",
        f"model.rotary_base={int(shape['rope_theta'])}",
        f"model.share_embeddings_and_output_weights={str(shape['tie_word_embeddings']).lower()}",
        f"model.config.num_layers={shape['num_hidden_layers']}",
        f"model.config.hidden_size={shape['hidden_size']}",
        f"model.config.ffn_hidden_size={shape['intermediate_size']}",
        f"model.config.num_attention_heads={shape['num_attention_heads']}",
        f"model.config.num_query_groups={shape['num_key_value_heads']}",
        f"++model.config.layernorm_epsilon={shape['rms_norm_eps']}",
    ]
    return [
        *model,
        *CHAT_MIX,
        f"dataset.seq_length={shape['max_position_embeddings']}",
        f"dataset.synthetic.max_length={shape['max_position_embeddings']}",
        f"dataset.global_batch_size={args.global_batch_size}",
        f"dataset.micro_batch_tokens={budget}",
        "dataset.pad_to=longest",
        f"trainer.seed={args.seed}",
        f"trainer.train_iters={steps}",
        "trainer.lr_warmup_iters=1",
        "trainer.log_interval=1",
        "trainer.progress_bar=false",
        *([f"trainer.profile_step={args.warmup + 2}"] if torch.cuda.is_available() else []),
        *args.extra,
    ]


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from thdpack.training.loop import recipes_dir

    with initialize_config_dir(str(recipes_dir()), version_base="1.3"):
        return hydra_compose("train", overrides=overrides)


# --- the weights ----------------------------------------------------------------------------------------------


def save_hf_model(shape: dict, seed: int, directory: Path) -> None:
    """transformers' Llama initialised from ``seed`` (fp32), saved as safetensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        **shape, attention_bias=False, mlp_bias=False, hidden_act="silu", initializer_range=0.02
    )
    LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)


def hf_to_megatron(
    hf: dict[str, torch.Tensor], names: set[str], heads: int, groups: int
) -> dict[str, torch.Tensor]:
    """HF Llama tensors under megatron-core GPTModel names, for either layer spec: Transformer Engine's (norms
    fused into ``linear_qkv`` / ``linear_fc1``) or the local one (``input_layernorm`` / ``pre_mlp_layernorm``)."""
    te = any(n.endswith("linear_qkv.layer_norm_weight") for n in names)
    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"]}
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
    if "output_layer.weight" in names:
        out["output_layer.weight"] = hf.get("lm_head.weight", hf["model.embed_tokens.weight"])
    layers = 1 + max(int(n.split(".")[2]) for n in names if n.startswith("decoder.layers."))
    for i in range(layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        q, k, v = (hf[f"{src}self_attn.{p}_proj.weight"] for p in "qkv")
        per_group = heads // groups
        dim = q.shape[0] // heads
        qkv = []
        for g in range(groups):  # [q heads of group g..., k_g, v_g], group after group
            qkv += [
                q[g * per_group * dim : (g + 1) * per_group * dim],
                k[g * dim : (g + 1) * dim],
                v[g * dim : (g + 1) * dim],
            ]
        out[f"{dst}self_attention.linear_qkv.weight"] = torch.cat(qkv)
        out[f"{dst}self_attention.linear_proj.weight"] = hf[f"{src}self_attn.o_proj.weight"]
        gate, up = hf[f"{src}mlp.gate_proj.weight"], hf[f"{src}mlp.up_proj.weight"]
        out[f"{dst}mlp.linear_fc1.weight"] = torch.cat([gate, up])
        out[f"{dst}mlp.linear_fc2.weight"] = hf[f"{src}mlp.down_proj.weight"]
        norms = (
            ("self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight")
            if te
            else ("input_layernorm.weight", "pre_mlp_layernorm.weight")
        )
        out[dst + norms[0]] = hf[f"{src}input_layernorm.weight"]
        out[dst + norms[1]] = hf[f"{src}post_attention_layernorm.weight"]
    missing = sorted(n for n in names if n not in out and not n.endswith("_extra_state"))
    if missing:
        raise KeyError(f"no HF tensor for megatron parameters {missing[:5]} (of {len(missing)})")
    return out


def load_into_thdpack(run, hf_dir: Path, shape: dict) -> None:
    """Copy the saved HF weights into the run's model and refresh the optimizer's fp32 main parameters."""
    from safetensors.torch import load_file

    from thdpack.megatron.unwrap import unwrap_model

    model = unwrap_model(run.model)
    hf = {}
    for path in sorted(hf_dir.glob("*.safetensors")):
        hf.update(load_file(path))
    params = dict(model.named_parameters())
    mapped = hf_to_megatron(hf, set(params), shape["num_attention_heads"], shape["num_key_value_heads"])
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(mapped[name].to(param.dtype))
    run.optimizer.reload_model_params()


# --- thdpack's run --------------------------------------------------------------------------------------------


def run_thdpack(args, shape: dict, hf_dir: Path) -> dict:
    """thdpack's training loop at the first of ``--thdpack-budgets`` that runs; its steady-state figures."""
    from thdpack.megatron.output_loss import resolve_output_loss
    from thdpack.training import loop

    original = loop.setup_run

    def setup_with_hf_weights(cfg):
        run = original(cfg)
        load_into_thdpack(run, hf_dir, shape)
        return run

    errors = {}
    for budget in args.thdpack_budgets:
        cfg = compose(thdpack_overrides(args, shape, budget))
        run_dir = args.work / f"thdpack_{budget}"
        shutil.rmtree(run_dir, ignore_errors=True)
        os.environ.pop("MASTER_PORT", None)
        loop.setup_run = setup_with_hf_weights
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        try:
            summary = loop.train(cfg, run_dir)
        except torch.cuda.OutOfMemoryError as error:
            errors[budget] = f"out of memory: {str(error)[:160]}"
            loop._shutdown()
            continue
        finally:
            loop.setup_run = original
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        return {
            **run_figures(run_dir, args.warmup, summary, budget),
            "output_loss": resolve_output_loss(cfg.model, "cuda" if torch.cuda.is_available() else "cpu"),
            "errors": errors,
        }
    raise RuntimeError(f"thdpack ran at none of the budgets {args.thdpack_budgets}: {errors}")


def run_figures(run_dir: Path, warmup: int, summary: dict, budget: int) -> dict:
    """A thdpack run's steady-state figures from its ``metrics.jsonl`` (the steps after ``warmup``)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in records if r["step"] > warmup]
    seconds = sum(r["step_time_s"] for r in steady)
    profiled = next((r for r in records if "profile_syncs" in r), {})
    return {
        "budget": budget,
        "real_tokens_per_s": sum(r["real_tokens"] for r in steady) / seconds,
        "tflops": sum(r["model_flops"] for r in steady) / seconds / 1e12,
        "timed_model_flops": sum(r["model_flops"] for r in steady),
        "step_time_s": seconds / len(steady),
        "peak_memory_gib": summary.get("peak_memory_gib"),
        "first_step_loss": records[0]["loss"],
        "losses": [r["loss"] for r in records],
        "steady_state_syncs": profiled.get("profile_syncs"),
        "sync_sites": profiled.get("profile_sync_sites"),
    }


# --- transformers' runs ---------------------------------------------------------------------------------------


def packed_row(batch: dict, device) -> dict:
    """A collated micro-batch (right-padded rows) as one packed row for transformers."""
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    tokens = torch.cat([batch["tokens"][b, :n] for b, n in enumerate(lengths)])
    labels = torch.cat([batch["labels"][b, :n] for b, n in enumerate(lengths)])
    positions = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return {
        "input_ids": tokens[None].to(device, non_blocking=True),
        "position_ids": positions[None].to(device, non_blocking=True),
        "shift_labels": labels[None].to(device, non_blocking=True),
        "cu_seq_lens_q": cu.to(device, non_blocking=True),
        "cu_seq_lens_k": cu.to(device, non_blocking=True),
        "max_length_q": max(lengths),
        "max_length_k": max(lengths),
        "counted": int((labels != -100).sum()),
        "real": int(sum(lengths)),
        "lengths": lengths,
    }


def register_varlen_attention() -> str:
    """``torch.nn.attention.varlen.varlen_attn`` as a transformers attention implementation (name returned);
    the boundaries come in as ``cu_seq_lens_q`` / ``max_length_q`` keyword arguments of the model call."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn
    from transformers import AttentionInterface

    parameters = inspect.signature(varlen_attn).parameters
    # torch 2.9-2.10 take is_causal; later ones a window (-1, 0); enable_gqa from 2.12 on
    causal = {"is_causal": True} if "is_causal" in parameters else {"window_size": (-1, 0)}
    native_gqa = "enable_gqa" in parameters

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        batch, heads, length, dim = query.shape
        # flash kernels take fp16/bf16 only; under autocast transformers' fp32 RoPE hands q and k over in fp32
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else value.dtype
        q = query.transpose(1, 2).reshape(batch * length, heads, dim).to(dtype)
        k = key.transpose(1, 2).reshape(batch * length, key.shape[1], dim).to(dtype)
        v = value.transpose(1, 2).reshape(batch * length, value.shape[1], dim).to(dtype)
        extra = dict(causal)
        if k.shape[1] != heads:
            if native_gqa:
                extra["enable_gqa"] = True
            else:
                k = k.repeat_interleave(heads // k.shape[1], dim=1)
                v = v.repeat_interleave(heads // v.shape[1], dim=1)
        cu, longest = kwargs["cu_seq_lens_q"], kwargs["max_length_q"]
        out = varlen_attn(q, k, v, cu, cu, longest, longest, scale=scaling, **extra)
        return out.reshape(batch, length, heads, dim), None

    AttentionInterface.register("thdpack_varlen", attention)
    return "thdpack_varlen"


def run_hf(args, config_name: str, hf_dir: Path, shape: dict, cap_gib: float | None) -> dict:
    """One transformers configuration at the largest budget that runs within ``cap_gib``."""
    attention, precision = config_name.rsplit("_", 1)
    results = {}
    for budget in args.hf_budgets:
        try:
            result = _hf_at_budget(args, attention, precision, budget, hf_dir, shape, cap_gib)
        except torch.cuda.OutOfMemoryError:
            result = {"error": "out of memory"}
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        results[budget] = result
        fits = "error" not in result and (cap_gib is None or result["peak_memory_gib"] <= cap_gib)
        if fits:
            return {
                **result,
                "budget": budget,
                "tried": {
                    b: r.get("error", "over the memory cap") for b, r in results.items() if b != budget
                },
            }
    return {"error": "no budget fits", "tried": results}


def _hf_at_budget(
    args, attention: str, precision: str, budget: int, hf_dir: Path, shape: dict, cap_gib: float | None
) -> dict:
    from transformers import LlamaForCausalLM

    from thdpack.data import build_train_data

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    implementation = "sdpa"
    if attention.startswith("varlen"):
        implementation = register_varlen_attention()
    if attention.endswith("liger"):
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(
            rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=True
        )
    dtype = torch.bfloat16 if precision == "bf16" and device.type == "cuda" else torch.float32
    model = LlamaForCausalLM.from_pretrained(hf_dir, dtype=dtype, attn_implementation=implementation).to(
        device
    )
    model.train()
    cfg = compose(thdpack_overrides(args, shape, budget))
    trainer = cfg.trainer
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=float(trainer.lr),
        betas=(float(trainer.adam_beta1), float(trainer.adam_beta2)),
        weight_decay=float(trainer.weight_decay),
        eps=1e-8,
        fused=True,
    )
    data = build_train_data(cfg.dataset, dp_rank=0, dp_size=1, seed=int(trainer.seed))
    autocast = torch.autocast(
        device.type, dtype=torch.bfloat16, enabled=precision == "autocast" and device.type == "cuda"
    )
    clip = float(trainer.clip_grad)
    result = timed_steps(
        args, model, list(model.parameters()), optimizer, data, attention, autocast, cap_gib, clip
    )
    return {**result, "attn_implementation": implementation, "dtype": str(dtype)}


def timed_steps(
    args, model, trained, optimizer, data, attention: str, autocast, cap_gib, clip: float
) -> dict:
    """transformers' training steps on thdpack's micro-batches as packed rows: ``--warmup`` steps, then ``--steps``
    timed ones; the gradients of ``trained`` clipped at ``clip``; the syncs of the second timed step. Stops after
    the first step when the peak memory passes ``cap_gib``. Shared with ``lora_vs_peft.py``."""
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    losses, real, started, syncs = [], 0, None, None
    for step in range(1, args.warmup + args.steps + 1):
        rows = [packed_row(b, device) for b in data.next_step()]
        counted = sum(r["counted"] for r in rows)
        if step == args.warmup + 1:
            if device.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
        profiled = device.type == "cuda" and step == args.warmup + 2
        if profiled:
            from thdpack.training.profiling import catch_syncs

            context = catch_syncs()
        else:
            import contextlib

            context = contextlib.nullcontext([])
        with context as sites:
            loss = torch.zeros((), device=device)
            for row in rows:
                kwargs = {k: row[k] for k in ("input_ids", "position_ids", "shift_labels")}
                if attention.startswith("varlen"):
                    kwargs |= {
                        k: row[k] for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
                    }
                with autocast:
                    out = model(
                        **kwargs, labels=row["shift_labels"], num_items_in_batch=counted, use_cache=False
                    )
                out.loss.backward()
                loss += out.loss.detach()
            torch.nn.utils.clip_grad_norm_(trained, clip, foreach=True)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if profiled:
            syncs = len(sites)
        if step > args.warmup:
            real += sum(r["real"] for r in rows)
        losses.append(loss)
        # after the first step (optimizer state included) the peak is known: a budget over the cap stops here
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
        if step == 1 and cap_gib is not None and peak is not None and peak > cap_gib:
            return {"error": "over the memory cap", "peak_memory_gib": peak}
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    return {
        "real_tokens_per_s": real / seconds,
        "timed_seconds": seconds,
        "step_time_s": seconds / args.steps,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        "first_step_loss": float(losses[0]),
        "losses": [float(x) for x in losses],
        "steady_state_syncs": syncs,
    }


# --- the report -----------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(HF_CONFIGS))
    parser.add_argument("--thdpack-budgets", default="65536,49152,32768,16384")
    parser.add_argument("--hf-budgets", default="65536,49152,32768,24576,16384,8192,4096")
    parser.add_argument("--global-batch-size", type=int, default=32)
    # Host-timed steps of a packed run vary (0.14-0.97 s around a 0.56 s mean for llama3_1b on an H100: the host runs
    # ahead of the GPU, and new shapes cost one-time work early in a run): time many steps after a long warm-up.
    parser.add_argument("--steps", type=int, default=12, help="timed steps, after --warmup")
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--work", type=Path, default=Path("outputs/vs_hf"))
    parser.add_argument("--smoke", action="store_true", help="CPU: a tiny Llama, sdpa in fp32, one budget")
    parser.add_argument(
        "--hf-child", default=None, help=argparse.SUPPRESS
    )  # one HF configuration, in-process
    parser.add_argument("--cap-gib", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("extra", nargs="*", help="recipe overrides for thdpack's run")
    args = parser.parse_args()
    if args.smoke:
        args.configs, args.thdpack_budgets, args.hf_budgets = "sdpa_bf16", "1024", "1024"
        args.global_batch_size, args.steps, args.warmup = 4, 1, 1
        args.extra = [
            *args.extra,
            "dataset.synthetic.median=40",
            "dataset.synthetic.min_length=8",
            "dataset.synthetic.num_samples=64",
        ]
    args.thdpack_budgets = [int(b) for b in str(args.thdpack_budgets).split(",")]
    args.hf_budgets = [int(b) for b in str(args.hf_budgets).split(",")]
    shape = SMOKE if args.smoke else LLAMA3_1B
    hf_dir = args.work / "hf_model"

    if args.hf_child:  # a child process: one configuration, its result as JSON on the last line
        result = run_hf(args, args.hf_child, hf_dir, shape, args.cap_gib)
        print("VS_HF_RESULT " + json.dumps(result), flush=True)
        return

    args.work.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(hf_dir, ignore_errors=True)
    save_hf_model(shape, args.seed, hf_dir)
    thdpack = run_thdpack(args, shape, hf_dir)
    print(f"thdpack: {_short(thdpack)}", flush=True)
    cap = thdpack["peak_memory_gib"]
    hf = {}
    for name in args.configs.split(","):
        hf[name] = run_hf(args, name, hf_dir, shape, cap) if args.smoke else _child(args, name, cap)
        if "first_step_loss" in hf[name]:
            hf[name]["first_step_loss_diff"] = hf[name]["first_step_loss"] - thdpack["first_step_loss"]
            # the same samples in the same timed steps: thdpack's FLOPs model counts the work of both sides
            hf[name]["tflops"] = thdpack["timed_model_flops"] / hf[name]["timed_seconds"] / 1e12
        print(f"{name}: {_short(hf[name])}", flush=True)
    write(args, shape, thdpack, hf)


def _child(args, name: str, cap: float | None) -> dict:
    """One transformers configuration in a fresh process (Liger patches transformers' classes process-wide,
    and each peak memory is measured from zero)."""
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--hf-child",
        name,
        "--hf-budgets",
        ",".join(map(str, args.hf_budgets)),
        "--global-batch-size",
        str(args.global_batch_size),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--seed",
        str(args.seed),
        "--work",
        str(args.work),
        *(["--cap-gib", str(cap)] if cap is not None else []),
        *args.extra,
    ]
    return run_child(command, "VS_HF_RESULT ", timeout=1800)


def run_child(command: list[str], marker: str, timeout: float) -> dict:
    """Run a child benchmark process (this checkout first on the path); its result: the JSON after ``marker`` on the
    last line that starts with it, or the error."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
    }
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(marker):
            return json.loads(line.removeprefix(marker))
    return {"error": f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-600:]}"}


def _short(result: dict) -> str:
    keys = (
        "budget",
        "real_tokens_per_s",
        "peak_memory_gib",
        "first_step_loss",
        "steady_state_syncs",
        "error",
    )
    return ", ".join(
        f"{k} {result[k]:.4g}" if isinstance(result.get(k), float) else f"{k} {result.get(k)}"
        for k in keys
        if k in result
    )


def package_version(name: str) -> str | None:
    import importlib.metadata as md

    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def device_tag() -> tuple[str, str]:
    """``(device name, short tag for file names: h200, h100, gpu or cpu)``."""
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    if not torch.cuda.is_available():
        return device, "cpu"
    return device, "h200" if "H200" in device else "h100" if "H100" in device else "gpu"


def write(args, shape: dict, thdpack: dict, hf: dict) -> None:
    version = package_version
    device, tag = device_tag()
    ran = {k: v for k, v in hf.items() if "real_tokens_per_s" in v}
    fastest = max(ran, key=lambda k: ran[k]["real_tokens_per_s"]) if ran else None
    date = datetime.now(timezone.utc).isoformat(timespec="seconds")
    payload = {
        "date": date,
        "device": device,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": version("transformers"),
            "liger-kernel": version("liger-kernel") or version("liger_kernel"),
            "megatron-core": version("megatron-core"),
            "transformer-engine": version("transformer-engine") or version("transformer_engine"),
        },
        "headline": {
            "speedup_vs_fastest_hf": thdpack["real_tokens_per_s"] / ran[fastest]["real_tokens_per_s"]
            if fastest
            else None,
            "fastest_hf_config": fastest,
            "steady_state_syncs": thdpack["steady_state_syncs"],
        },
        "setup": {
            "shape": shape,
            "global_batch_size": args.global_batch_size,
            "steps": args.steps,
            "warmup": args.warmup,
            "seed": args.seed,
            "mix": CHAT_MIX,
            "extra": args.extra,
        },
        "thdpack": thdpack,
        "transformers": hf,
    }
    stem = args.out / f"vs_hf_{tag}{'_smoke' if args.smoke else ''}_{date[:10]}"
    args.out.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
    head = payload["headline"]
    lines = [
        f"# thdpack against transformers on {device}, {date[:10]}",
        "",
        f"Llama shape {shape['hidden_size']}x{shape['num_hidden_layers']}, vocab {shape['vocab_size']}; the chat mix, "
        f"{args.global_batch_size} samples a step, {args.steps} timed steps after {args.warmup}; same weights and "
        f"samples on both sides. Versions: {payload['versions']}.",
        "",
        f"**Headline**: thdpack {_fmt(head['speedup_vs_fastest_hf'], '{:.2f}')}x the fastest transformers "
        f"configuration ({head['fastest_hf_config']}); {head['steady_state_syncs']} syncs in thdpack's steady step.",
        "",
        "| system | tokens a micro-batch | real tok/s | TFLOP/s | peak GiB | syncs/step | first-step loss (diff) |",
        "|---|---|---|---|---|---|---|",
        f"| thdpack ({thdpack['output_loss']} output loss) | {thdpack['budget']} | {thdpack['real_tokens_per_s']:,.0f} | "
        f"{thdpack['tflops']:.3g} | {_fmt(thdpack['peak_memory_gib'], '{:.1f}')} | {thdpack['steady_state_syncs']} | "
        f"{thdpack['first_step_loss']:.4f} |",
    ]
    for name, r in hf.items():
        if "error" in r:
            lines.append(f"| transformers {name} | {r['error']} | | | | | |")
            continue
        lines.append(
            f"| transformers {name} | {r['budget']} | {r['real_tokens_per_s']:,.0f} | {r['tflops']:.3g} | "
            f"{_fmt(r['peak_memory_gib'], '{:.1f}')} | {r['steady_state_syncs']} | {r['first_step_loss']:.4f} "
            f"({r['first_step_loss_diff']:+.1e}) |"
        )
    lines += [
        "",
        "TFLOP/s: model FLOPs on real tokens from thdpack's FLOPs model (`thdpack.training.flops`), the same work on "
        "both sides (the same samples in the same timed steps), over each side's time.",
    ]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {stem}.json, .md")


def _fmt(value, fmt: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else fmt.format(value)


if __name__ == "__main__":
    main()
