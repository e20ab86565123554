"""Start-up checks of a training recipe: each says what to change, before any process group or model exists."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace

from thdpack.megatron.batch import alignment_for, allgather_dispatch_rule
from thdpack.megatron.distributed import check_tp_comm_overlap
from thdpack.megatron.fp8 import check_fp8, check_fp8_attention
from thdpack.megatron.fused_mlp import check_te_op_fuser
from thdpack.megatron.optimizer_precision import check_optimizer_precision
from thdpack.megatron.output_loss import check_output_loss
from thdpack.megatron.parallel_layout import first_stage_layers
from thdpack.models import COMMON_MODEL_KEYS, get_family

from .config_error import ConfigError
from .memory import check_memory
from .recipe_keys import recipes_dir
from .recipe_values import check_values

__all__ = ["ConfigError", "check_recipe", "layouts_that_fit"]


def layouts_that_fit(
    heads: int, groups: int, layers: int, tp: int, pp: int, cp: int, world_size: int, packed: bool
) -> str:
    """What to ask for instead of a TP size that does not divide the heads: the TP sizes that do (and divide the
    world size with PP and CP), and the other ways to use the ``tp`` ranks TP would have taken."""
    fits = [
        t
        for t in range(2, groups + 1)
        if heads % t == 0 and groups % t == 0 and world_size % (t * pp * cp) == 0
    ]
    ways = [f"parallel.tensor_model_parallel_size={t}" for t in fits]
    ways.append(f"tensor_model_parallel_size=1 ({world_size // (pp * cp)} data-parallel rank(s))")
    if layers % (pp * tp) == 0:
        ways.append(f"pipeline_model_parallel_size={pp * tp} (with tensor_model_parallel_size=1)")
    if packed:
        ways.append(f"context_parallel_size={cp * tp} (with tensor_model_parallel_size=1)")
    return "layouts that fit: " + ", or ".join(ways)


def check_recipe(
    cfg: Mapping,
    *,
    world_size: int,
    device: str,
    recipes: Path | None = None,
    available_memory: int | None = None,
    memory: bool = True,
) -> list[str]:
    """Raise :class:`ConfigError` for a resolved recipe (:func:`thdpack.training.recipe.resolve_recipe`, which
    refuses unknown keys) that cannot run on ``world_size`` processes on ``device``; return warnings (settings
    that run, but not as a user may expect).

    In order: every value is one megatron-core, torch and the loader accept (:mod:`thdpack.training.recipe_values`),
    the layout fits the model and the world size, and the model's estimated memory fits the device
    (``available_memory`` bytes for this host's processes, default measured: :func:`thdpack.training.memory.check_memory`;
    ``memory=False`` leaves it to the caller, sized by the data).
    """
    model, dataset, parallel = cfg["model"], cfg["dataset"], cfg["parallel"]
    backend = model["attention_backend"]
    if "auto" in (backend, dataset.get("micro_batch_tokens"), model.get("te_op_fuser")):
        raise ValueError(
            "check_recipe takes a resolved recipe: pass it through thdpack.training.recipe.resolve_recipe"
        )
    check_values(cfg, world_size=world_size, recipes=recipes or recipes_dir())
    config = model.get("config") or {}
    tp, pp = int(parallel["tensor_model_parallel_size"]), int(parallel["pipeline_model_parallel_size"])
    cp, ep = int(parallel["context_parallel_size"]), int(parallel["expert_model_parallel_size"])
    packed = bool(dataset["pack_sequences_in_batch"])
    warnings: list[str] = []

    try:
        family = get_family(model.get("family", "gpt"))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    known = COMMON_MODEL_KEYS + family.model_keys
    unknown = sorted(set(model) - set(known))
    if unknown:
        raise ConfigError(f"model has unknown keys {unknown}: the '{family.name}' family reads {list(known)}")

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
            f"num_query_groups ({groups}); "
            + layouts_that_fit(heads, groups, int(config["num_layers"]), tp, pp, cp, world_size, packed)
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
    try:
        first_stage_layers(config, pp)
    except ValueError as e:
        raise ConfigError(str(e)) from None
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
    budget = dataset.get("micro_batch_tokens")
    if packed:
        # The alignment the run builds after start-up (thdpack.megatron.batch.alignment_for), from the recipe.
        precision = SimpleNamespace(
            sequence_parallel=sequence_parallel, fp8=config.get("fp8"), fp8_recipe=config.get("fp8_recipe")
        )
        try:
            alignment = alignment_for(precision, cp, tp, dataset.get("mode", "auto"))
        except ValueError as e:
            raise ConfigError(f"dataset.mode is '{dataset.get('mode')}': {e}") from None
        bucket = dataset.get("pad_total_to")
        if bucket is not None:
            bucket = int(bucket)
            if bucket % alignment.total_multiple:
                raise ConfigError(
                    f"dataset.pad_total_to={bucket} must be a multiple of {alignment.total_multiple} (the packed row's "
                    f"alignment for cp={cp}, tp={tp}, sequence_parallel={sequence_parallel}, "
                    f"fp8={alignment.fp8})"
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
        rule = allgather_dispatch_rule(
            True, experts, ep, config.get("moe_token_dispatcher_type", "allgather"), bucket
        )
        if rule:
            raise ConfigError(
                f"model.config.{rule}: set dataset.pad_total_to (a fixed token bucket) or "
                "model.config.moe_token_dispatcher_type=alltoall"
            )

    try:
        if family.check is not None:
            family.check(cfg)
        check_output_loss(model, parallel, device)
        check_optimizer_precision(cfg["trainer"], device, cfg["trainer"]["precision"])
        check_fp8(cfg["trainer"], device, backend)
        check_tp_comm_overlap(config)
        if device == "cuda":
            check_fp8_attention(config, cfg["trainer"]["precision"], packed)
        warnings += check_te_op_fuser(model, cfg["trainer"], backend)
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

    if memory:  # else the caller checks it once the data's micro-batches are known
        check_memory(cfg, world_size=world_size, device=device, backend=backend, available=available_memory)
    return warnings
