"""The scale-out benchmark's job (``benchmarks/scale.py``): model shapes as Hugging Face directories made
locally, the recipe that trains the same model on the same samples with thdpack, and what each side's worker
reports.

A shape is a transformers config (``LlamaConfig`` or ``Qwen3MoeConfig``); :func:`make_hf_dir` writes it with
random weights drawn from a seed (``save_pretrained``: fp32 for the CPU shapes, bf16 for the GPU ones, as real
checkpoints ship). :func:`thdpack_overrides` imports a directory into thdpack as a user does
(``model=hf model.pretrained=DIR``), and :func:`dataset_config` is the one data recipe
both sides read (thdpack through its overrides, transformers through :func:`thdpack.data.build_train_data`).
"""

from __future__ import annotations

import json
from pathlib import Path

# Shapes: (transformers model type, config keyword arguments). The vocabularies divide by 8 (tensor parallel
# up to 8 cuts the embedding into whole rows without padding it).
SHAPES: dict[str, tuple[str, dict]] = {
    # CPU: a dense Llama with tied embeddings (like llama3_1b) and a Qwen3-MoE with untied ones
    "tiny": (
        "llama",
        dict(
            vocab_size=1024,
            hidden_size=128,
            intermediate_size=384,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
        ),
    ),
    "tiny_moe": (
        "qwen3_moe",
        dict(
            vocab_size=1024,
            hidden_size=128,
            intermediate_size=384,
            moe_intermediate_size=96,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            rope_theta=1e6,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
    ),
    # GPU: the shapes of Llama 3.2 1B, Llama 3 8B and Qwen3-30B-A3B (thdpack's recipes of the same names)
    "llama3_1b": (
        "llama",
        dict(
            vocab_size=128256,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            rope_theta=500000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
        ),
    ),
    "llama3_8b": (
        "llama",
        dict(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            rope_theta=500000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
        ),
    ),
    "qwen3_30b_a3b": (
        "qwen3_moe",
        dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            rope_theta=1e6,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
    ),
}
CPU_SHAPES = ("tiny", "tiny_moe")
MARKER = (
    "thdpack_scale_shape.json"  # what made the directory: a later run with the same shape and seed reuses it
)

# Length mixes of the synthetic samples (thdpack.data.synthetic): the chat-like lognormal, a long-sample lognormal
# (median 6,000 tokens), or every sample seq_length tokens long (the long-context runs under context parallelism).
MIXES = ("chat", "long", "full")


# The transformers side's configurations (``scale_hf.py``), as a user of that stack tunes it:
#   fsdp2[:noreshard][:prefetchN][:ac][:bf16reduce][@TOKENS]   torch's fully_shard per decoder layer, then the root
#   ddp[:autocast][@TOKENS]                                     torch's DistributedDataParallel, the model whole
# noreshard: reshard_after_forward=False (parameters stay gathered from forward to backward: fewer all-gathers,
# more memory); prefetchN: explicit forward and backward prefetch of the next N layers (FSDP2's own is one layer,
# implicit); ac: activation checkpointing per decoder layer (transformers' gradient_checkpointing_enable, non-reentrant);
# bf16reduce: gradients reduce-scattered in bf16 instead of fp32. FSDP2 keeps fp32 sharded master weights and
# computes in bf16 (MixedPrecisionPolicy). ddp: bf16 parameters and optimizer state (the model loaded in bf16);
# ddp:autocast: fp32 parameters under torch.autocast (what Trainer's bf16=True does with an fp32 model).
# @TOKENS: this configuration's micro-batch budget (default: the job's).
PEER_FLAGS = ("noreshard", "ac", "bf16reduce", "autocast")


def parse_peer(text: str) -> dict:
    """``fsdp2:noreshard:prefetch2@8192`` -> the configuration ``scale_hf.py`` runs (see the table above)."""
    spec, _, budget = text.partition("@")
    kind, *flags = spec.split(":")
    peer = {
        "name": text,
        "parallel": kind,
        "reshard_after_forward": True,
        "prefetch": 0,
        "activation_checkpointing": False,
        "reduce_dtype": "fp32",
        "precision": "mixed" if kind == "fsdp2" else "bf16",
        "micro_batch_tokens": int(budget) if budget.isdigit() else None,
    }
    allowed = {"fsdp2": ("noreshard", "ac", "bf16reduce", "prefetchN"), "ddp": ("autocast", "ac")}.get(kind)
    bad = allowed is None or (budget and not budget.isdigit())
    for flag in flags:
        name = "prefetchN" if flag.startswith("prefetch") and flag[8:].isdigit() else flag
        if allowed is None or name not in allowed:
            bad = True
        elif name == "prefetchN":
            peer["prefetch"] = int(flag[8:])
        elif name == "noreshard":
            peer["reshard_after_forward"] = False
        elif name == "ac":
            peer["activation_checkpointing"] = True
        elif name == "bf16reduce":
            peer["reduce_dtype"] = "bf16"
        elif name == "autocast":
            peer["precision"] = "autocast"
    if bad:
        raise ValueError(
            f"transformers configuration '{text}': write fsdp2[:noreshard][:prefetchN][:ac][:bf16reduce] or "
            "ddp[:autocast][:ac], optionally @TOKENS"
        )
    return peer


def hf_config(shape: str, layers: int | None = None):
    """The transformers config of ``shape`` (with ``layers`` decoder layers instead of the shape's own)."""
    if shape not in SHAPES:
        raise ValueError(f"shape '{shape}' is unknown: choose one of {sorted(SHAPES)}")
    model_type, kwargs = SHAPES[shape]
    from transformers import LlamaConfig, Qwen3MoeConfig

    config_class = {"llama": LlamaConfig, "qwen3_moe": Qwen3MoeConfig}[model_type]
    kwargs = kwargs | ({"num_hidden_layers": layers} if layers else {})
    # room for the longest sample the benchmark gives (RoPE needs no table, transformers checks the bound)
    return config_class(**kwargs, max_position_embeddings=262144)


def make_hf_dir(shape: str, seed: int, out: Path, device: str = "cpu", layers: int | None = None) -> Path:
    """``out`` holding ``shape`` (``layers`` decoder layers if given) with random weights from ``seed``
    (``torch.manual_seed`` before the transformers constructor), as ``save_pretrained`` writes it. A directory
    already made from the same shape, seed and config is kept as it is."""
    import torch
    from transformers import AutoModelForCausalLM

    config = hf_config(shape, layers)
    marker = {"shape": shape, "seed": seed, "config": config.to_dict()}
    marker.pop("transformers_version", None)
    marker["config"].pop("transformers_version", None)
    path = out / MARKER
    if path.is_file() and json.loads(path.read_text()) == json.loads(json.dumps(marker)):
        return out
    # drawn in bf16 for the GPU shapes: a 30B model in fp32 would not fit a GPU (or most hosts)
    dtype = torch.float32 if shape in CPU_SHAPES else torch.bfloat16
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    path.write_text(json.dumps(marker, indent=1) + "\n")
    return out


def thdpack_overrides(hf_dir: Path, device: str) -> list[str]:
    """Recipe overrides that import ``hf_dir`` as a user does: ``model=hf model.pretrained=DIR`` (its
    config.json builds the model and its weights are loaded under the run's layout, :mod:`thdpack.models`, which
    refuses what it cannot import exactly). Only the benchmark's one choice that config.json leaves open is added:
    on ``device`` "cuda" a mixture of experts runs as Transformer Engine's grouped GEMM, on a CPU one module
    per expert."""
    from thdpack.hf.checkpoint import HFCheckpoint

    checkpoint = HFCheckpoint.open(hf_dir)
    config = checkpoint.config
    if config.get("model_type") not in ("llama", "qwen3_moe"):
        raise ValueError(
            f"{checkpoint.path}: model_type '{config.get('model_type')}' is not llama or qwen3_moe (the two "
            "families the transformers side applies Liger's kernels to)"
        )
    overrides = ["model=hf", f"model.pretrained={Path(hf_dir).resolve()}"]
    if config["model_type"] == "qwen3_moe":
        overrides.append(f"model.config.moe_grouped_gemm={str(device == 'cuda').lower()}")
    return overrides


def dataset_config(
    *,
    seq_length: int,
    global_batch_size: int,
    micro_batch_tokens: int,
    mix: str,
    num_samples: int = 100_000,
    seed: int = 0,
) -> dict:
    """The data recipe of both sides: synthetic samples of the ``mix`` (byte-level ids), ``global_batch_size``
    samples a step, packed micro-batches of at most ``micro_batch_tokens`` tokens (thdpack's loader plans them
    and balances them over the data-parallel ranks)."""
    if mix == "chat":
        lengths = dict(median=700, sigma=1.0, min_length=32, max_length=seq_length)
    elif mix == "long":  # long fine-tuning samples (documents, long chats): median 6k tokens
        lengths = dict(median=6000, sigma=0.6, min_length=1024, max_length=seq_length)
    elif mix == "full":
        lengths = dict(median=seq_length, sigma=0.0, min_length=seq_length, max_length=seq_length)
    else:
        raise ValueError(f"mix '{mix}' is unknown: choose one of {list(MIXES)}")
    return {
        "name": "synthetic",
        "tokenizer": "byte",
        "seq_length": seq_length,
        "global_batch_size": global_batch_size,
        "micro_batch_size": 1,
        "micro_batch_tokens": micro_batch_tokens,
        "pack_sequences_in_batch": True,
        "pad_to": "longest",
        "shuffle": True,
        "overlong": "truncate",
        "synthetic": {"num_samples": num_samples, "seed": seed, **lengths},
    }


def dataset_overrides(dataset: dict) -> list[str]:
    """:func:`dataset_config` as thdpack recipe overrides."""
    flat = []
    for key, value in dataset.items():
        if isinstance(value, dict):
            flat += [f"++dataset.{key}.{k}={_value(v)}" for k, v in value.items()]
        else:
            flat.append(f"++dataset.{key}={_value(value)}")
    return ["dataset=synthetic", "~dataset.synthetic", *flat]


def _value(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    return str(value)


def step_record(step: int, time_s: float, real_tokens: int, microbatches: int, loss, grad_norm) -> dict:
    """One timed step of a worker: wall time on this rank, the global batch's real tokens, this rank's
    micro-batches, the global per-token loss (None where this rank has none) and gradient norm."""
    return {
        "step": step,
        "time_s": time_s,
        "real_tokens": int(real_tokens),
        "microbatches": int(microbatches),
        "loss": None if loss is None else float(loss),
        "grad_norm": float(grad_norm),
    }


def gather_worker_result(side: dict, steps: list[dict]) -> dict | None:
    """Every rank's steps and peak memory gathered on global rank 0 (None elsewhere): per step the slowest rank's
    time and the loss of the rank that has it; peak GPU memory (``max_memory_allocated``) and peak host memory
    (max RSS) of every rank."""
    import resource

    import torch
    import torch.distributed as dist

    mine = {
        "steps": steps,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,  # Linux: KiB
    }
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if dist.get_rank() != 0:
        return None
    merged = []
    for i, step in enumerate(steps):
        losses = [r["steps"][i]["loss"] for r in ranks if r["steps"][i]["loss"] is not None]
        merged.append(
            step
            | {
                "time_s": max(r["steps"][i]["time_s"] for r in ranks),
                "loss": losses[0] if losses else None,
                "microbatches": max(r["steps"][i]["microbatches"] for r in ranks),
            }
        )
    return {
        **side,
        "world_size": dist.get_world_size(),
        "steps": merged,
        "peak_memory_gib": [r["peak_memory_gib"] for r in ranks],
        "peak_rss_gib": [r["peak_rss_gib"] for r in ranks],
    }


def write_worker_result(out: Path, side: dict, steps: list[dict]) -> None:
    """:func:`gather_worker_result`, written to ``out`` by global rank 0."""
    result = gather_worker_result(side, steps)
    if result is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")


def device_label() -> str:
    """This worker's device: the GPU's name, or the CPU's."""
    import platform

    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
