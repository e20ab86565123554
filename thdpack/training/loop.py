"""``python -m thdpack.train``: train a Megatron-core GPT with thdpack's forward step, from a Hydra recipe.

    python -m thdpack.train                                   # tiny_gpt on the embedded corpus, packed
    python -m thdpack.train dataset.pack_sequences_in_batch=false   # the padded BSHD baseline
    torchrun --nproc-per-node 2 -m thdpack.train parallel=tp2 model=tiny_moe
    python -m thdpack.train --cfg job                         # the resolved recipe;  --help: the groups

The recipes live in the top-level ``recipes/`` (shipped inside the package as ``thdpack/recipes``). CUDA and NCCL
when a GPU is visible, else CPU and gloo (``thdpack.megatron.cpu``). The run directory (Hydra's, or
``hydra.run.dir=...``) receives ``metrics.jsonl``, TensorBoard events, ``summary.json`` and ``curves.png``.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hydra
import numpy as np
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from thdpack.megatron.checkpoint_dir import CheckpointWriteError

from .checkpointing import RunCheckpoints, check_checkpoint_dir
from .checks import check_recipe
from .config_error import ConfigError, exit_with
from .deferred import DeferredScalars
from .flops import FlopsModel
from .memory import check_memory
from .metrics import MetricsWriter, memory_summary, summarize
from .nonfinite import NonfiniteGuard
from .overrides import check_overrides
from .profiling import profile
from .recipe import resolve_recipe
from .recipe_keys import recipes_dir
from .resume import continue_metrics, nothing_to_train, schedule_changes
from .signals import StopNow
from .stopping import MARKER, EarlyStop

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer.transformer_config import TransformerConfig

    from thdpack.data import TrainData
    from thdpack.data.samples import SampleDataset
    from thdpack.megatron.device_step import OptimizerStep
    from thdpack.megatron.loss import TokenLoss
    from thdpack.megatron.runtime import Runtime
    from thdpack.megatron.step import StepConfig

log = logging.getLogger("thdpack")

# What megatron-core says at import on a machine without Apex or Transformer Engine (it falls back by design),
# and torch's renames of the collectives megatron-core calls: noise on every rank, not news.
for _message in (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
    "The .grad attribute of a Tensor that is not a leaf",
    "full scope is deprecated",
):
    warnings.filterwarnings("ignore", message=_message)
warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")


def run_stamp() -> str:
    """The run directory's name, the same on every rank of one launch: ``$THDPACK_RUN_STAMP`` if set, else the
    start time of the process that launched this one (torchrun's agent, shared by its workers), else now."""
    stamp = os.environ.get("THDPACK_RUN_STAMP")
    if stamp:
        return stamp
    started = time.time()
    if "LOCAL_RANK" in os.environ:
        started = _process_start_time(os.getppid()) or started
    return datetime.fromtimestamp(started).strftime("%Y-%m-%d_%H-%M-%S")


def _process_start_time(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


OmegaConf.register_new_resolver("thdpack_run_stamp", lambda: run_stamp(), use_cache=True, replace=True)


def main() -> None:
    """Train; a recipe that cannot run prints its message (naming the key) and exits with code 2, no traceback.
    The command line's overrides are checked before Hydra composes them (:mod:`thdpack.training.overrides`)."""
    try:
        check_overrides(sys.argv[1:], recipes_dir())
    except ConfigError as error:
        exit_with(error)
    _hydra_main()


@hydra.main(config_path=str(recipes_dir()), config_name="train", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    try:
        train(cfg, Path(HydraConfig.get().runtime.output_dir))
    except ConfigError as error:
        exit_with(error)
    except (FloatingPointError, CheckpointWriteError) as error:  # said in full by the message
        print(f"thdpack: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    except StopNow as error:
        print(f"thdpack: {error} (the steps since the last checkpoint are lost)", file=sys.stderr, flush=True)
        raise SystemExit(130) from None


@dataclass
class Run:
    """Everything a training step needs, built from a recipe by :func:`setup_run`."""

    cfg: DictConfig  # the resolved recipe (thdpack.training.recipe.resolve_recipe)
    runtime: Runtime
    data: TrainData  # this data-parallel rank's stream
    held_out: SampleDataset  # the evaluation samples (empty unless trainer.eval_interval)
    data_kwargs: dict[str, Any]
    config: TransformerConfig
    model: DistributedDataParallel  # the model family's module, wrapped (thdpack.megatron.distributed)
    optimizer: MegatronOptimizer
    scheduler: OptimizerParamScheduler
    optimizer_step: OptimizerStep  # gradient norm, clipping and the non-finite skip on the device
    step: StepConfig  # the batch (packing, alignment, hook), the model family, the loss
    forward_step: Callable
    forward_backward: Callable
    flops: FlopsModel
    logging_rank: bool


def setup_run(cfg: DictConfig) -> Run:
    """Resolve and check the recipe, start the process groups, build the data stream, the model, the optimizer
    and the schedule (``torch.distributed`` from the torchrun environment; one process without it)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from thdpack.data.loader import startup_report
    from thdpack.megatron.batch import BatchConfig, model_alignment
    from thdpack.megatron.checkpoint import resume_vocab_size
    from thdpack.megatron.config import padded_vocab_size, transformer_config
    from thdpack.megatron.device_step import OptimizerStep
    from thdpack.megatron.distributed import te_wgrad_fusion, wrap_model
    from thdpack.megatron.loss import LM_LOSS
    from thdpack.megatron.optimizer import build_optimizer
    from thdpack.megatron.optimizer_precision import ddp_grad_reduce_in_fp32
    from thdpack.megatron.runtime import init_distributed, resolve_runtime, serialize_cuda_connections
    from thdpack.megatron.step import StepConfig, make_forward_step
    from thdpack.models import get_family
    from thdpack.models.lora import apply_peft, lora_enabled

    _setup_logging()
    # before the CUDA context exists (resolve_recipe only asks whether there is a GPU)
    sizes = [cfg.parallel.get(f"{k}_parallel_size") for k in ("tensor_model", "context")]  # checked below
    connections = serialize_cuda_connections(*(n if type(n) is int else 1 for n in sizes))
    if connections:
        log.warning(connections)
    cfg = resolve_recipe(cfg)
    trainer, data_cfg, parallel = cfg.trainer, cfg.dataset, cfg.parallel
    packed = bool(data_cfg.pack_sequences_in_batch)
    runtime = resolve_runtime(
        trainer.precision, cfg.model.attention_backend, fp8_recipe=trainer.get("fp8_recipe")
    )
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    for warning in check_recipe(cfg, world_size=world_size, device=runtime.device, memory=False):
        log.warning(warning)
    family = get_family(cfg.model.family)
    init_distributed(
        runtime,
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        seed=int(trainer.seed),
    )
    logging_rank = (
        ps.is_pipeline_last_stage(ignore_virtual=True)
        and ps.get_tensor_model_parallel_rank() == 0
        and ps.get_data_parallel_rank(with_context_parallel=True) == 0
    )
    if not logging_rank:
        log.setLevel(logging.WARNING)

    # Data: every data-parallel rank reads the same stream and keeps its share of each global batch.
    try:  # the data's checks name the file, the line and the rule
        tokenizer, dataset, held_out, data_kwargs, data = _build_data(cfg, ps)
        report = startup_report(data)  # raises for dataset.overlong=error with overlong samples known now
    except (ValueError, ImportError) as error:  # ImportError: a package the data needs, named with its extra
        raise ConfigError(str(error)) from None
    # sized by the micro-batches this data fills, not only by what the recipe allows
    check_memory(
        cfg,
        world_size=world_size,
        device=runtime.device,
        backend=runtime.backend,
        data_tokens=data.largest_micro_batch_tokens(packed),
    )
    budget = data_cfg.micro_batch_tokens
    log.info("data: %s, %d samples for training, %d held out", data_cfg.name, len(dataset), len(held_out))
    for line in report:
        log.info("data: %s", line)

    config = transformer_config(cfg.model, parallel, runtime)
    tp = ps.get_tensor_model_parallel_world_size()
    vocab_size = padded_vocab_size(cfg.model, tokenizer.vocab_size, tp)
    # a checkpoint's padded vocabulary wins over this layout's padding (resuming TP1 -> TP2)
    vocab_size = resume_vocab_size(
        cfg.checkpoint.dir, vocab_size, tp, cfg.model.get("vocab_size") is not None
    )
    module = family.build(cfg.model, config, vocab_size, int(data_cfg.seq_length), runtime)
    if lora_enabled(cfg.get("peft")):  # adapters on the loaded weights, the base frozen, before DDP sees them
        module = apply_peft(module, cfg.peft, cfg.model, config, seed=int(trainer.seed))
    model = wrap_model(
        module,
        config,
        runtime,
        ddp_grad_reduce_in_fp32(trainer),
        te_wgrad_fusion(cfg.model, runtime),
        overlap_grad_reduce=trainer.overlap_grad_reduce is True,
        overlap_param_gather=trainer.overlap_param_gather is True,
        bucket_size=trainer.get("ddp_bucket_size"),
    )
    optimizer, scheduler = build_optimizer(trainer, model, config)
    optimizer_step = OptimizerStep(optimizer, runtime.device)
    if runtime.device == "cuda" and optimizer_step.host_read_reason:
        log.warning("the optimizer step reads the host once a step: %s", optimizer_step.host_read_reason)
    alignment = model_alignment(config, data_cfg.get("mode", "auto"), data_cfg.get("pad_total_to"))
    step = StepConfig(
        batch=BatchConfig(
            pack_sequences_in_batch=packed,
            alignment=alignment,
            pad_token_id=tokenizer.pad_id,
            transform=family.transform,
            carry_keys=family.carry_keys,
        ),
        forward=family.forward,
        loss=LM_LOSS,
    )
    batching = "padded BSHD"
    if packed:
        batching = f"packed ({alignment.mode}, " + (
            f"{budget}-token micro-batches)" if budget else "micro_batch_size samples)"
        )
    log.info(
        "model: %s (%s), %s attention, %s, %s%s | %s | world %d = dp %d x tp %d x pp %d x cp %d (ep %d)",
        cfg.model.get("name", family.name),
        family.name,
        runtime.backend,
        runtime.precision,
        runtime.device,
        ", fused RoPE" if config.apply_rope_fusion else "",
        batching,
        dist.get_world_size(),
        ps.get_data_parallel_world_size(),
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_context_parallel_world_size(),
        ps.get_expert_model_parallel_world_size(),
    )
    return Run(
        cfg=cfg,
        runtime=runtime,
        data=data,
        held_out=held_out,
        data_kwargs=data_kwargs,
        config=config,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        step=step,
        optimizer_step=optimizer_step,
        forward_step=make_forward_step(step.batch, forward=step.forward, loss=step.loss),
        forward_backward=get_forward_backward_func(),
        flops=FlopsModel.of(config, vocab_size),
        logging_rank=logging_rank,
    )


def _build_data(cfg: DictConfig, ps):
    """The tokenizer, the training and held-out samples, the loader's keyword arguments and this data-parallel
    rank's training stream."""
    from thdpack.data import build_dataset, build_train_data
    from thdpack.data.samples import split_holdout
    from thdpack.hf.processor import dataset_processor
    from thdpack.hf.tokenizer import resolve_tokenizer

    data_cfg, trainer = cfg.dataset, cfg.trainer
    # an image chat dataset's tokenizer is the vision-language checkpoint's processor
    tokenizer = dataset_processor(data_cfg.name, data_cfg.get("tokenizer"), cfg.model) or resolve_tokenizer(
        data_cfg.get("tokenizer", "auto"), cfg.model.get("pretrained"), data_cfg.get("chat_template_kwargs")
    )
    dataset = build_dataset(
        data_cfg.name,
        data_cfg.get("path"),
        tokenizer,
        max_files=data_cfg.get("max_files"),
        synthetic=data_cfg.get("synthetic"),
        validate=data_cfg.get("validate", "auto"),
        vlm=data_cfg.get("vlm"),
        bad_lines=data_cfg.get("bad_lines", "error"),
    )
    dataset, held_out = split_holdout(
        dataset, int(trainer.eval_samples) if trainer.get("eval_interval") else 0
    )
    data_kwargs = dict(
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        seed=int(trainer.seed),
        tokenizer=tokenizer,
    )
    return (
        tokenizer,
        dataset,
        held_out,
        data_kwargs,
        build_train_data(data_cfg, dataset=dataset, **data_kwargs),
    )


def forward_backward(run: Run, batches: list[dict], forward_only: bool = False) -> list[dict]:
    """Megatron's schedule over ``batches`` (this rank's micro-batches): thdpack's forward step packs each one;
    gradients are reduced after the last. Returns the loss reports (last pipeline stage; empty elsewhere)."""
    if not forward_only:
        run.model.zero_grad_buffer()
        run.optimizer.zero_grad()
    return (
        run.forward_backward(
            forward_step_func=run.forward_step,
            data_iterator=iter(batches),
            model=[run.model],
            num_microbatches=len(batches),
            seq_length=int(run.cfg.dataset.seq_length),
            micro_batch_size=int(run.cfg.dataset.micro_batch_size),
            forward_only=forward_only,
        )
        or []
    )


def train_step(run: Run, batches: list[dict]):
    """One optimizer step over one global batch: ``(loss reports, StepOutcome)``, nothing read back to the host
    on CUDA (:class:`thdpack.megatron.device_step.OptimizerStep`). The update is held back on the device when
    the gradient norm is not finite. The learning-rate schedule advances here; :func:`_settle` takes a held-back
    step off it once the host learns of it."""
    losses = forward_backward(run, batches)
    outcome = run.optimizer_step.step()
    run.scheduler.step(increment=1)
    return losses, outcome


# What DeferredScalars carries for each step, in this order.
STEP_SCALARS = ("grad_norm", "skipped", "loss", "nonfinite_microbatch")


def step_scalars(losses: list[dict], outcome, with_loss: bool, loss_fn: TokenLoss) -> torch.Tensor:
    """A step's :data:`STEP_SCALARS` as one device tensor: the mean per-token loss over the DP x CP group when
    ``with_loss`` (NaN else; last pipeline stage), and the 1-based index of the first micro-batch whose summed
    loss is not finite (0: none), both from ``loss_fn``'s reports."""
    device = outcome.grad_norm.device
    loss = torch.full((), float("nan"), device=device)
    first_bad = torch.zeros((), device=device)
    if losses:
        if with_loss:
            loss = loss_fn.reduce(losses).float()
        first_bad = loss_fn.first_nonfinite(losses).float()
    return torch.stack([outcome.grad_norm.float(), outcome.skipped.float(), loss, first_bad])


def train(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """Run the recipe ``cfg``; write metrics to ``run_dir`` (rank 0 of the last stage); return the summary."""
    from megatron.core import parallel_state as ps

    from thdpack.megatron.checkpoint import check_optimizer_format

    optimizer_format = check_optimizer_format(cfg.checkpoint.get("optimizer_format", "fully_reshardable"))
    stop = EarlyStop(cfg.trainer.get("exit_duration_mins"))  # from the start: a signal during set-up counts
    _setup_logging()
    if os.environ.get("RANK", "0") == "0":
        log.info("run directory: %s", run_dir.resolve())
    check_checkpoint_dir(cfg.checkpoint.dir)  # before set-up: found now, not at the first save
    run = setup_run(cfg)
    cfg = run.cfg
    trainer, data = cfg.trainer, run.data
    ckpt_dir = cfg.checkpoint.dir
    checkpoints = RunCheckpoints(run, run_dir, optimizer_format)  # one run per checkpoint.dir
    if ckpt_dir is not None and cfg.model.get("pretrained") and dist.get_rank() == 0:
        from thdpack.hf.directory import keep_with_checkpoint  # what python -m thdpack.export needs

        keep_with_checkpoint(ckpt_dir, cfg.model, run.runtime.precision)
    if run.logging_rank:
        (run_dir / MARKER).unlink(missing_ok=True)  # an earlier attempt's, in the same run directory
    schedule = run.scheduler.state_dict()  # the recipe's, before a checkpoint's replaces it
    iteration = checkpoints.resume()
    if iteration:
        changed = schedule_changes(schedule, run.scheduler.state_dict(), iteration, int(trainer.train_iters))
        if changed:
            log.warning(changed)
    started_at = iteration
    if run.logging_rank:
        earlier = continue_metrics(ckpt_dir, run_dir, iteration)
        if earlier is not None:
            log.info("steps 1-%d were logged in %s: metrics.jsonl continues them", iteration, earlier)
    done = nothing_to_train(ckpt_dir, iteration, int(trainer.train_iters))
    if done:
        log.warning(done)
    nonfinite = NonfiniteGuard(trainer.on_nonfinite, trainer.get("max_consecutive_skips", 10), ckpt_dir)

    def save(at: int) -> bool:
        return checkpoints.save(at, nonfinite.unsaveable)

    train_iters = int(trainer.train_iters)
    exit_interval, save_interval = trainer.get("exit_interval"), cfg.checkpoint.get("save_interval")
    eval_interval, profile_step = trainer.get("eval_interval"), trainer.get("profile_step")
    writer = MetricsWriter(
        run_dir,
        enabled=run.logging_rank,
        total_iters=train_iters,
        start_iter=iteration,
        progress_bar=trainer.get("progress_bar", "auto"),
    )
    skipped, stopped_early = 0, None
    scalars = DeferredScalars(run.runtime.device)

    def settle(entries) -> None:
        nonlocal skipped
        for entry in entries:
            message = _settle(run, writer, *entry)
            skipped += message is not None
            nonfinite.settled(entry[0], message)

    started = time.perf_counter()
    while iteration < train_iters:
        step_start = time.perf_counter()
        batches = data.next_step()
        # the rate this step's update applies (the schedule moves after the update)
        lr = run.optimizer.param_groups[0]["lr"]
        profiled = profile_step is not None and iteration + 1 == int(profile_step)
        with profile(enabled=profiled, device=run.runtime.device) as prof:
            losses, outcome = train_step(run, batches)
        iteration += 1
        log_now = iteration % int(trainer.log_interval) == 0 or iteration == train_iters
        last_stage = ps.is_pipeline_last_stage(ignore_virtual=True)
        values = step_scalars(losses, outcome, log_now and last_stage, run.step.loss)
        info = {"batches": len(batches), "has_loss": log_now and last_stage}
        if log_now or profiled:
            # what the host knows now (the step's data, its time, the schedule); the device values join later
            record = _step_record(iteration, time.perf_counter() - step_start, run)
            record["lr"] = lr
            if profiled:
                record |= prof.summary(run_dir if run.logging_rank else None)
            if eval_interval and iteration % int(eval_interval) == 0:
                record["eval_loss"] = _evaluate(run, int(trainer.eval_iters))
            info["record"] = record
        scalars.push(iteration, values, info)
        settle(scalars.ready())
        saving = save_interval and iteration % int(save_interval) == 0
        exiting = exit_interval and iteration % int(exit_interval) == 0 and iteration < train_iters
        # every rank stops at the same step: the scheduler's warning signal or trainer.exit_duration_mins
        stopped_early = stop.agreed() if iteration < train_iters else None
        if saving or exiting or stopped_early:
            settle(scalars.drain())
        saved = save(iteration) if saving or stopped_early else False
        if stopped_early:
            stop.record(run_dir, iteration, stopped_early, ckpt_dir, write=run.logging_rank, saved=saved)
            break
        if exiting:
            if not saving:
                save(iteration)
            log.info("exit_interval: stopping after iteration %d", iteration)
            break
    else:
        settle(scalars.drain())
        trained = iteration > started_at  # a complete run resumed again saves nothing new
        if ckpt_dir is not None and trained and not (save_interval and iteration % int(save_interval) == 0):
            save(iteration)
    summary = {
        "iterations": iteration,
        "wall_time_s": time.perf_counter() - started,
        "skipped_updates": skipped,
        "stopped_early": stopped_early,
        "packed": bool(cfg.dataset.pack_sequences_in_batch),
        "device": run.runtime.device,
        "precision": run.runtime.precision,
        "attention_backend": run.runtime.backend,
        "world_size": dist.get_world_size(),
        "data": {k: v for k, v in data.state_dict().items() if k != "seed"},
        **summarize(writer.records),
    }
    if run.runtime.device == "cuda":
        summary.update(memory_summary())
    writer.close(summary)
    if run.logging_rank:
        log.info("summary: %s", {k: v for k, v in summary.items() if k != "data"})
        if summary.get("alloc_retries"):
            log.warning(
                "the CUDA caching allocator ran out of cached blocks %d times and freed them to retry (each a "
                "device synchronization): lower dataset.micro_batch_tokens, or set "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
                summary["alloc_retries"],
            )
        log.info(
            "data: %d samples trained on, %d truncated, %d dropped (dataset.overlong=%s)",
            data.samples_seen,
            data.truncated,
            data.dropped,
            cfg.dataset.get("overlong", "truncate"),
        )
        log.info("run directory: %s", run_dir.resolve())
    stop.close()
    checkpoints.close()
    _shutdown()
    return summary


def _step_record(iteration, step_time, run: Run) -> dict:
    """One step's metrics over the whole global batch (every rank's micro-batches, from the loader's plan):
    real tokens, and the tokens the model computes on (packed rows as thdpack aligns them, or padded rows)."""
    data, data_cfg, alignment, flops = run.data, run.cfg.dataset, run.step.batch.alignment, run.flops
    lengths = [mb for rank in data.step_lengths for mb in rank if mb.size]
    real = int(sum(int(mb.sum()) for mb in lengths))
    if data_cfg.pack_sequences_in_batch:
        processed = sum(alignment.total_tokens(mb) for mb in lengths)
    elif data_cfg.get("pad_to", "seq_length") == "seq_length":
        processed = sum(mb.size for mb in lengths) * int(data_cfg.seq_length)
    else:
        processed = sum(mb.size * int(mb.max()) for mb in lengths)
    all_lengths = np.concatenate(lengths) if lengths else np.zeros(0)
    model_flops = flops.training_flops(all_lengths)  # on real tokens, all ranks together
    return {
        "step": iteration,
        "real_tokens": real,
        "all_tokens": int(processed),
        "pad_fraction": 1.0 - real / processed if processed else 0.0,
        "step_time_s": step_time,
        "real_tokens_per_s": real / step_time,
        "all_tokens_per_s": processed / step_time,
        "model_flops": model_flops,
        "tflops": model_flops / step_time / dist.get_world_size() / 1e12,
        "num_microbatches": data.num_microbatches_last,
        "samples": int(all_lengths.size),
        "samples_truncated": data.truncated,  # over the whole stream: a resumed run continues the counts
        "samples_dropped": data.dropped,
    }


def _settle(run: Run, writer: MetricsWriter, step: int, values: list[float], info: dict) -> str | None:
    """Act on step ``step`` once its :data:`STEP_SCALARS` are on the host: take a held-back update off the
    learning-rate schedule (``trainer.on_nonfinite=skip``); write the step's record if it has one. Returns what
    made a held-back update's step non-finite (:class:`NonfiniteGuard` decides what follows), else None."""
    scalars = dict(zip(STEP_SCALARS, values, strict=True))
    held_back = scalars["skipped"] > 0
    if held_back:
        where = int(scalars["nonfinite_microbatch"])
        message = f"step {step}: the gradient norm is {scalars['grad_norm']}" + (
            f"; the first non-finite loss is in micro-batch {where} of {info['batches']}" if where else ""
        )
        if run.cfg.trainer.on_nonfinite == "skip":
            run.scheduler.step(increment=-1)
    record = info.get("record")
    if record is not None:
        record |= {"grad_norm": scalars["grad_norm"], "skipped": held_back}
        if info["has_loss"]:
            record["loss"] = scalars["loss"]
        writer.log(record)
    return message if held_back else None


def _evaluate(run: Run, iters: int) -> float | None:
    """Mean per-token loss on the first ``iters`` global batches of the held-out samples (the same every time)."""
    from megatron.core import parallel_state as ps

    from thdpack.data import build_train_data

    data = build_train_data(run.cfg.dataset, dataset=run.held_out, shuffle=False, **run.data_kwargs)
    run.model.eval()
    reports = [
        report for _ in range(iters) for report in forward_backward(run, data.next_step(), forward_only=True)
    ]
    run.model.train()
    return float(run.step.loss.reduce(reports)) if ps.is_pipeline_last_stage(ignore_virtual=True) else None


def _setup_logging() -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO,
            format="[%(asctime)s thdpack] %(message)s",
            datefmt="%H:%M:%S",
            stream=sys.stdout,
        )
    log.setLevel(logging.INFO)
    for noisy in ("megatron", "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _shutdown() -> None:
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
