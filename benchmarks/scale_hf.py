"""The transformers side of ``benchmarks/scale.py``: a worker of ``torchrun ... scale_hf.py JOB.json``.

What a user of the Hugging Face stack runs, tuned as its users tune it: the job's directory in transformers, Liger
kernels (RoPE, RMSNorm, SwiGLU, the fused linear cross-entropy that never builds the logits; CUDA only, their kernels
are Triton), a mixture of experts with transformers' grouped-GEMM experts where the installed version has them, and
each of the job's configurations (``scale_job.parse_peer``) in turn, in this one process:

* ``fsdp2``: torch's FSDP2 (``fully_shard`` per decoder layer, then the root; bf16 compute, fp32 sharded master
  weights, fp32 or bf16 gradient reduction), ``reshard_after_forward`` on or off, explicit prefetch of the next
  layers, activation checkpointing per layer;
* ``ddp``: torch's ``DistributedDataParallel`` over the whole model (where it fits one GPU), bf16 parameters or
  fp32 ones under autocast;

gradients reduced once per step, after the last micro-batch (``no_sync`` / ``set_requires_gradient_sync``), as
accelerate does, or after each with ``hf_sync_each_microbatch``; AdamW with the thdpack side's settings. The
micro-batches come from thdpack's own loader (every rank its data-parallel share of the same global batches) as
packed rows: samples concatenated, position ids restarting per sample, no attention mask, ``use_cache=False``.
Attention over the packed row:

* ``varlen``: one call of ``torch.nn.attention.varlen.varlen_attn`` (flash-attention class) over the samples'
  boundaries, registered through transformers' ``AttentionInterface`` and given the boundaries as the
  ``cu_seq_lens_q/k``, ``max_length_q/k`` keyword arguments (computed on the host: no sync). On a CPU the same
  function runs one SDPA per sample (exact; the plumbing is the GPU's);
* ``sdpa``: transformers' own packed path, which finds the samples from the position ids and builds a
  block-diagonal causal mask.

A configuration that runs out of memory ends the process (exit 3) after saying so: the other ranks may wait in a
collective that rank will never join, and ``scale.py`` starts the remaining configurations in a new launch.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from scale_job import (  # noqa: E402
    device_label,
    gather_worker_result,
    parse_peer,
    step_record,
)

VARLEN = "thdpack_varlen"
PEER_MARKER = "== transformers configuration "  # scale.py finds which configuration a failed launch was in
LIGER_CPU = "not applied: Liger's kernels are Triton, CUDA only"


def varlen_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention-function convention (``query`` ``[1, Hq, T, D]``, ``key``/``value``
    ``[1, Hkv, T, D]`` -> ``([1, T, Hq, D], None)``), causal within each sample of ``cu_seq_lens_q``."""
    if attention_mask is not None:
        raise ValueError(
            f"{VARLEN} takes packed rows without an attention mask (got {list(attention_mask.shape)})"
        )
    if dropout:
        raise ValueError(
            f"{VARLEN}: torch's varlen attention has no dropout (attention_dropout is {dropout})"
        )
    cu, max_len = kwargs["cu_seq_lens_q"], kwargs["max_length_q"]
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))  # [T, H, D]
    groups = q.shape[1] // k.shape[1]
    if q.is_cuda:
        out = _varlen(q, k, v, cu, max_len, scaling, groups)
    else:
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        bounds = cu.tolist()
        out = torch.cat(
            [
                F.scaled_dot_product_attention(
                    *(x[a:b].transpose(0, 1) for x in (q, k, v)), is_causal=True, scale=scaling
                ).transpose(0, 1)
                for a, b in zip(bounds[:-1], bounds[1:], strict=True)
            ]
        )
    return out.unsqueeze(0), None


def _varlen(q, k, v, cu, max_len, scale, groups):
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    # torch releases differ: a causal flag, or a (left, right) window where (-1, 0) is causal
    kwargs = {
        "scale": scale,
        **({"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}),
    }
    if groups > 1:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kwargs)


def pack_row(batch: dict) -> dict:
    """A right-padded micro-batch of thdpack's loader (``tokens``, ``labels`` already shifted within each row,
    ``attention_mask``) as one packed row: real tokens only, position ids restarting per sample, and the
    samples' boundaries (host values)."""
    lengths = batch["attention_mask"].sum(1).tolist()
    tokens = torch.cat([row[:n] for row, n in zip(batch["tokens"], lengths, strict=True)])
    labels = torch.cat([row[:n] for row, n in zip(batch["labels"], lengths, strict=True)])
    positions = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return {
        "input_ids": tokens[None],
        "shift_labels": labels[None],
        "position_ids": positions[None],
        "cu_seq_lens": cu,
        "max_length": max(lengths),
        "targets": int((labels != -100).sum()),
    }


def microbatch_loss(
    model, row: dict, scale: torch.Tensor, device: torch.device, varlen: bool
) -> torch.Tensor:
    """The micro-batch's summed token loss over ``scale`` (fp32, on the device: the step's count of targets over
    the world size). The model returns the sum (``num_items_in_batch=1``) and the division happens here, outside
    the model call: FSDP2's ``MixedPrecisionPolicy`` casts every floating tensor argument of the call to the
    parameters' bf16, and a count given as ``num_items_in_batch`` would lose its low bits (31,873 becomes
    31,872)."""
    kwargs = {}
    if varlen:
        cu = row["cu_seq_lens"].to(device, non_blocking=True)
        kwargs = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=row["max_length"])
        kwargs["max_length_k"] = row["max_length"]
    labels = row["shift_labels"].to(device, non_blocking=True)
    out = model(
        input_ids=row["input_ids"].to(device, non_blocking=True),
        position_ids=row["position_ids"].to(device, non_blocking=True),
        labels=labels,
        shift_labels=labels,
        num_items_in_batch=1,
        use_cache=False,
        **kwargs,
    )
    return out.loss.float() / scale


def apply_liger(model_type: str) -> str:
    """Liger's kernels for ``model_type``, patched into transformers' classes before the model is built."""
    from liger_kernel.transformers import apply_liger_kernel_to_llama, apply_liger_kernel_to_qwen3_moe

    apply = {"llama": apply_liger_kernel_to_llama, "qwen3_moe": apply_liger_kernel_to_qwen3_moe}[model_type]
    apply(rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=True)
    return "rope, rms_norm, swiglu, fused_linear_cross_entropy"


def load_full_state(hf_dir: Path) -> dict:
    """The checkpoint's tensors as stored (bf16 for the GPU shapes), on the host."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype="auto").state_dict()


def _from_config(config, attention: str, dtype, experts: str | None):
    from transformers import AutoModelForCausalLM

    kwargs = {"attn_implementation": attention, "dtype": dtype}
    if experts:
        try:
            return AutoModelForCausalLM.from_config(config, **kwargs, experts_implementation=experts)
        except (TypeError, ValueError) as error:  # a transformers without it: its default experts, reported
            print(
                f"experts_implementation={experts} refused ({error}); transformers' default experts",
                flush=True,
            )
    return AutoModelForCausalLM.from_config(config, **kwargs)


def build_model(hf_dir: Path, peer: dict, attention: str, device, mesh, full: dict, experts: str | None):
    """The directory's model for ``peer``: FSDP2 (built on the meta device, sharded, materialised on ``device``,
    filled from global rank 0's copy of the checkpoint ``full``, each rank keeping its shards) or DDP (the whole
    model on every rank, from rank 0's copy)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(hf_dir)
    config.use_cache = False
    cuda = device.type == "cuda"
    if peer["parallel"] == "ddp":
        dtype = torch.bfloat16 if cuda and peer["precision"] == "bf16" else torch.float32
        with torch.device("meta"):
            model = _from_config(config, attention, dtype, experts)
        if peer["activation_checkpointing"]:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.to_empty(device=device)
        set_model_state_dict(
            model, dict(full), options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        )
        _fresh_rotary(model, device)
        model.train()
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if cuda else None)

    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    with torch.device("meta"):
        model = _from_config(config, attention, torch.float32, experts)
    if peer["activation_checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    kwargs = {"mesh": mesh, "reshard_after_forward": peer["reshard_after_forward"]}
    if cuda:
        reduce = torch.float32 if peer["reduce_dtype"] == "fp32" else torch.bfloat16
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce)
    layers = list(model.model.layers)
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    if peer["prefetch"]:  # torchtitan's explicit prefetch: the next n layers' all-gathers issued ahead
        n = peer["prefetch"]
        for i, layer in enumerate(layers):
            layer.set_modules_to_forward_prefetch(layers[i + 1 : i + 1 + n])
            layer.set_modules_to_backward_prefetch(layers[max(0, i - n) : i][::-1])
    model.to_empty(device=device)
    # a copy: the broadcast writes its results into the dict it is given, and the next configuration reads it
    set_model_state_dict(
        model, dict(full), options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
    _fresh_rotary(model, device)
    model.train()
    return model


def _fresh_rotary(model, device) -> None:
    # RoPE's inverse frequencies are a buffer outside the state dict: to_empty left them uninitialised
    rotary = model.model.rotary_emb
    model.model.rotary_emb = type(rotary)(config=model.config).to(device)


def build_optimizer(model, job: dict, device: torch.device):
    """AdamW as Megatron's optimizer does it: no weight decay on 1-D parameters (norms)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": job["weight_decay"]}, {"params": rest, "weight_decay": 0.0}]
    fused = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(groups, lr=job["lr"], betas=tuple(job["betas"]), eps=1e-8, **fused)


def experts_implementation(model_type: str, cuda: bool) -> str | None:
    """transformers' fastest experts for a mixture of experts: grouped GEMMs (``torch._grouped_mm``) on a GPU
    where this transformers has them, else its default."""
    if model_type != "qwen3_moe" or not cuda:
        return None
    try:
        from transformers.integrations import moe
    except ImportError:
        return None
    return "grouped_mm" if hasattr(moe, "grouped_mm_experts_forward") else None


def run_peer(job: dict, peer: dict, hf_dir: Path, full: dict, ctx: dict) -> tuple[dict, list[dict]]:
    """Train ``job["steps"]`` steps with the configuration ``peer``; its description and step records."""
    from thdpack.data import build_train_data

    device, world, rank, attention = ctx["device"], ctx["world"], ctx["rank"], ctx["attention"]
    cuda = device.type == "cuda"
    torch.manual_seed(job["seed"])
    model = build_model(hf_dir, peer, ctx["attn_name"], device, ctx["mesh"], full, ctx["experts"])
    optimizer = build_optimizer(model, job, device)
    budget = peer["micro_batch_tokens"] or job["hf_micro_batch_tokens"]
    data = build_train_data(
        {**job["dataset"], "micro_batch_tokens": budget}, dp_rank=rank, dp_size=world, seed=job["seed"]
    )
    ddp = peer["parallel"] == "ddp"
    autocast = torch.autocast(
        device.type, dtype=torch.bfloat16, enabled=cuda and peer["precision"] == "autocast"
    )
    steps = []
    for step in range(1, job["steps"] + 1):
        start = time.perf_counter()
        rows = [pack_row(batch) for batch in data.next_step()]
        count = torch.tensor(float(sum(r["targets"] for r in rows)), device=device)
        dist.all_reduce(count)
        # DDP and FSDP2 average gradients over ranks: each rank's loss is its sum over the global count, times world
        scale = count / world
        loss_sum = torch.zeros((), device=device)
        for i, row in enumerate(rows):
            sync = job["hf_sync_each_microbatch"] or i == len(rows) - 1
            if not ddp:
                model.set_requires_gradient_sync(sync)
            with contextlib.nullcontext() if (sync or not ddp) else model.no_sync(), autocast:
                loss = microbatch_loss(model, row, scale, device, varlen=attention == "varlen")
                loss.backward()
            loss_sum += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), job["clip_grad"])
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(loss_sum)
        loss = float(loss_sum) / world
        real = sum(int(mb.sum()) for r in data.step_lengths for mb in r)
        steps.append(step_record(step, time.perf_counter() - start, real, len(rows), loss, float(grad_norm)))
    inner = model.module if ddp else model
    side = {
        "side": "hf",
        "device_name": device_label(),
        "layout": peer["name"],
        "peer": peer,
        "attention": "varlen_attn" if attention == "varlen" and cuda else attention,
        "attention_detail": (
            "torch.nn.attention.varlen.varlen_attn"
            if attention == "varlen" and cuda
            else "one SDPA per sample (the varlen function's CPU path)"
            if attention == "varlen"
            else "transformers sdpa, block-diagonal mask from position ids"
        ),
        "liger": ctx["liger"],
        "precision": _precision(peer, cuda),
        "gradient_sync": "every micro-batch"
        if job["hf_sync_each_microbatch"]
        else "once per step (after the last micro-batch)",
        "micro_batch_tokens": budget,
        "experts_implementation": getattr(inner.config, "_experts_implementation", None),
    }
    del model, optimizer
    return side, steps


def _precision(peer: dict, cuda: bool) -> str:
    if not cuda:
        return "fp32"
    if peer["parallel"] == "ddp":
        return (
            "fp32 params under torch.autocast(bf16), fp32 gradient all-reduce"
            if peer["precision"] == "autocast"
            else "bf16 params and AdamW state, bf16 gradient all-reduce"
        )
    return f"bf16 compute, fp32 sharded master weights, {peer['reduce_dtype']} gradient reduction (FSDP2)"


def main(job_path: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AttentionInterface, AutoConfig

    job = json.loads(job_path.read_text())
    cuda = torch.cuda.is_available()
    hf_dir = Path(job["hf_dir"])
    rank = int(os.environ.get("RANK", 0))
    # before the process group: the other ranks wait in its rendezvous while rank 0 reads the checkpoint
    full = load_full_state(hf_dir) if rank == 0 else {}
    timeout = timedelta(seconds=job.get("collective_timeout_s", 300))
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)
        device = torch.device("cpu")
    world, rank = dist.get_world_size(), dist.get_rank()
    model_type = AutoConfig.from_pretrained(hf_dir).model_type
    attention = job["hf_attention"]
    if attention == "auto":
        attention = "varlen" if cuda else "sdpa"
    AttentionInterface.register(VARLEN, varlen_attention)
    liger = apply_liger(model_type) if cuda and job["liger"] else (LIGER_CPU if job["liger"] else "off")
    ctx = {
        "device": device,
        "world": world,
        "rank": rank,
        "mesh": init_device_mesh(device.type, (world,)),
        "attention": attention,
        "attn_name": VARLEN if attention == "varlen" else attention,
        "liger": liger,
        "experts": experts_implementation(model_type, cuda),
    }
    out = Path(job["out"])
    done = json.loads(out.read_text()) if out.is_file() else {}
    for text in job["hf_configs"]:
        if text in done:
            continue
        peer = parse_peer(text)
        if rank == 0:
            print(f"{PEER_MARKER}{text}", flush=True)
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        try:
            side, steps = run_peer(job, peer, hf_dir, full, ctx)
        except torch.OutOfMemoryError as error:
            print(f"rank {rank}: {text}: out of memory: {error}", flush=True)
            sys.stdout.flush()
            os._exit(3)  # the others may wait in a collective this rank left: scale.py relaunches the rest
        result = gather_worker_result(side, steps)
        if rank == 0:
            done[text] = result
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(done, indent=1) + "\n")
        gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main(Path(sys.argv[1]))
