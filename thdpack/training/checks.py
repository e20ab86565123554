"""Start-up checks of a training recipe: each says what to change, before any process group or model exists."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping

from thdpack.megatron.fp8 import check_fp8
from thdpack.megatron.optimizer_precision import check_optimizer_precision
from thdpack.megatron.output_loss import check_output_loss
from thdpack.packing.layout import Alignment

__all__ = ["ConfigError", "check_recipe", "micro_batch_tokens"]


class ConfigError(ValueError):
    """A recipe that cannot run; the message names the keys and what to change."""


def micro_batch_tokens(dataset: Mapping) -> int | None:
    """The token budget of a packed micro-batch: ``dataset.micro_batch_tokens``, where ``auto`` means the memory
    the padded micro-batch would use (``micro_batch_size x seq_length``); None = ``micro_batch_size`` samples."""
    budget = dataset.get("micro_batch_tokens", "auto")
    if not dataset["pack_sequences_in_batch"]:
        if budget not in (None, "auto"):
            raise ConfigError(
                f"dataset.micro_batch_tokens={budget} needs dataset.pack_sequences_in_batch=true: the padded "
                "baseline batches micro_batch_size samples (set micro_batch_tokens=null)"
            )
        return None
    if budget == "auto":
        return int(dataset["micro_batch_size"]) * int(dataset["seq_length"])
    return None if budget is None else int(budget)


def check_recipe(cfg: Mapping, *, world_size: int, device: str, backend: str) -> list[str]:
    """Raise :class:`ConfigError` for a recipe that cannot run on ``world_size`` processes on ``device`` with the
    attention ``backend``; return warnings (settings that run, but not as a user may expect)."""
    model, dataset, parallel, trainer = cfg["model"], cfg["dataset"], cfg["parallel"], cfg["trainer"]
    config = model.get("config") or {}
    tp, pp = int(parallel["tensor_model_parallel_size"]), int(parallel["pipeline_model_parallel_size"])
    cp, ep = int(parallel["context_parallel_size"]), int(parallel["expert_model_parallel_size"])
    packed = bool(dataset["pack_sequences_in_batch"])
    warnings: list[str] = []

    if world_size % (tp * pp * cp):
        raise ConfigError(
            f"world size {world_size} is not divisible by parallel.tensor_model_parallel_size x "
            f"pipeline_model_parallel_size x context_parallel_size = {tp} x {pp} x {cp}: change them or the number "
            "of processes (data parallelism is what is left)"
        )
    heads = int(config["num_attention_heads"])
    groups = int(config.get("num_query_groups") or heads)
    if heads % tp or groups % tp:
        raise ConfigError(
            f"parallel.tensor_model_parallel_size={tp} must divide model.config.num_attention_heads ({heads}) and "
            f"num_query_groups ({groups})"
        )
    experts = config.get("num_moe_experts")
    if ep > 1 and not experts:
        raise ConfigError(
            f"parallel.expert_model_parallel_size={ep} needs a model with experts (model=tiny_moe)"
        )
    if experts and int(experts) % ep:
        raise ConfigError(
            f"parallel.expert_model_parallel_size={ep} must divide model.config.num_moe_experts ({experts})"
        )
    if experts and world_size % (pp * ep * tp):
        raise ConfigError(
            f"world size {world_size} is not divisible by parallel.pipeline_model_parallel_size x "
            f"expert_model_parallel_size x tensor_model_parallel_size = {pp} x {ep} x {tp}"
        )
    if cp > 1 and not packed:
        raise ConfigError(
            f"parallel.context_parallel_size={cp} needs dataset.pack_sequences_in_batch=true: the padded BSHD "
            "baseline is not sharded for context parallelism"
        )
    mode = dataset.get("mode", "auto")
    if mode == "fold" and model.get("attention_mask_type", "causal") != "causal":
        raise ConfigError(
            "dataset.mode=fold lets pad join its sample, which only causal attention never sees: use "
            f"dataset.mode=distinct with model.attention_mask_type={model.get('attention_mask_type')}"
        )
    if model.get("attention_mask_type", "causal") != "causal":
        raise ConfigError("thdpack's GPT recipes are causal: model.attention_mask_type must be causal")

    sequence_parallel = bool(parallel.get("sequence_parallel", False))
    if sequence_parallel and tp == 1:
        warnings.append("parallel.sequence_parallel=true with tensor_model_parallel_size=1: ignored")
        sequence_parallel = False
    seq_length = int(dataset["seq_length"])
    full_rows = dataset.get("pad_to", "seq_length") == "seq_length" and seq_length % tp == 0
    if not packed and sequence_parallel and not full_rows:
        raise ConfigError(
            f"the padded baseline with sequence parallelism splits every row over {tp} TP ranks: set "
            f"dataset.pad_to=seq_length and a dataset.seq_length divisible by {tp} (is {seq_length})"
        )
    budget = micro_batch_tokens(dataset)
    if packed:
        alignment = Alignment(cp_size=cp, tp_size=tp, sequence_parallel=sequence_parallel)
        bucket = dataset.get("pad_total_to")
        if bucket is not None:
            bucket = int(bucket)
            if bucket % alignment.total_multiple:
                raise ConfigError(
                    f"dataset.pad_total_to={bucket} must be a multiple of {alignment.total_multiple} (the packed row's "
                    f"alignment for cp={cp}, tp={tp}, sequence_parallel={sequence_parallel})"
                )
            largest = budget if budget is not None else int(dataset["micro_batch_size"]) * seq_length
            if bucket < largest:
                raise ConfigError(
                    f"dataset.pad_total_to={bucket} is smaller than a full micro-batch ({largest} tokens): raise it "
                    "to at least micro_batch_tokens (or micro_batch_size x seq_length), plus CP alignment pad"
                )
        if budget is not None and budget < alignment.sample_multiple:
            raise ConfigError(
                f"dataset.micro_batch_tokens={budget} is below the alignment of one sample under "
                f"parallel.context_parallel_size={cp} ({alignment.sample_multiple} tokens)"
            )
        if ep > 1 and config.get("moe_token_dispatcher_type", "allgather") == "allgather" and bucket is None:
            raise ConfigError(
                "model.config.moe_token_dispatcher_type=allgather all-gathers equal-sized token tensors over the "
                "expert-parallel group, but packed rows differ in length from rank to rank: set "
                "dataset.pad_total_to (a fixed token bucket) or model.config.moe_token_dispatcher_type=alltoall"
            )

    precision = trainer.get("precision", "auto")
    if precision == "auto":
        precision = "bf16" if device == "cuda" else "fp32"
    try:
        check_output_loss(model, parallel, device)
        check_optimizer_precision(trainer, device, precision)
        check_fp8(trainer, device, backend)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if backend == "te":
        if device != "cuda":
            raise ConfigError(
                "model.attention_backend=te needs a CUDA GPU: use attention_backend=torch (or auto) on CPU"
            )
        if importlib.util.find_spec("transformer_engine") is None:
            raise ConfigError(
                "model.attention_backend=te needs Transformer Engine: pip install 'thdpack[gpu]', or set "
                "model.attention_backend=torch"
            )
    elif device == "cuda" and packed:
        warnings.append(
            "attention_backend=torch on CUDA: RoPE runs unfused (Megatron's fused THD RoPE needs Transformer "
            "Engine); the unfused THD RoPE reads boundaries back from the GPU twice per layer"
        )

    iters = int(trainer["train_iters"])
    decay = int(trainer.get("lr_decay_iters") or iters)
    if int(trainer["lr_warmup_iters"]) >= decay:
        raise ConfigError(
            f"trainer.lr_warmup_iters ({trainer['lr_warmup_iters']}) must be below the decay iterations ({decay}: "
            "trainer.lr_decay_iters, or train_iters when null)"
        )
    if trainer.get("on_nonfinite", "error") not in ("error", "skip"):
        raise ConfigError(
            f"trainer.on_nonfinite is '{trainer.get('on_nonfinite')}': it must be error or skip"
        )
    return warnings
