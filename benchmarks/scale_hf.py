"""The transformers side of ``benchmarks/scale.py``: a worker of ``torchrun ... scale_hf.py JOB.json``.

What a user of the Hugging Face stack runs: the job's directory in transformers, Liger kernels (RoPE, RMSNorm,
SwiGLU, the fused linear cross-entropy that never builds the logits; CUDA only, their kernels are Triton),
torch's FSDP2 (``fully_shard`` per decoder layer, then the root; bf16 parameters and fp32 gradient reduction
on a GPU, fp32 on CPU; gradients reduced once per step, after the last micro-batch, as accelerate does, or
after each with ``hf_sync_each_microbatch``), AdamW with the thdpack side's settings. The micro-batches come
from thdpack's own loader (every rank its data-parallel share of the same global batches) as packed rows:
samples concatenated, position ids restarting per sample, no attention mask, ``use_cache=False``. Attention
over the packed row:

* ``varlen``: one call of ``torch.nn.attention.varlen.varlen_attn`` (flash-attention class) over the samples'
  boundaries, registered through transformers' ``AttentionInterface`` and given the boundaries as the
  ``cu_seq_lens_q/k``, ``max_length_q/k`` keyword arguments (computed on the host: no sync). On a CPU the same
  function runs one SDPA per sample (exact; the plumbing is the GPU's);
* ``sdpa``: transformers' own packed path, which finds the samples from the position ids and builds a
  block-diagonal causal mask.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from scale_job import device_label, step_record, write_worker_result  # noqa: E402

VARLEN = "thdpack_varlen"
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


def build_model(hf_dir: Path, attention: str, device: torch.device, mesh, bf16: bool):
    """The directory's model sharded with FSDP2: built on the meta device, sharded, materialised on
    ``device``,
    then filled from global rank 0's copy of the checkpoint (broadcast, each rank keeping its shards)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(hf_dir)
    config.use_cache = False
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attention, dtype=torch.float32)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    kwargs = {"mesh": mesh, **({"mp_policy": policy} if policy else {})}
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    model.to_empty(device=device)
    full = {}
    if dist.get_rank() == 0:
        full = AutoModelForCausalLM.from_pretrained(hf_dir, dtype="auto").state_dict()
    set_model_state_dict(
        model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
    del full
    # RoPE's inverse frequencies are a buffer outside the state dict: to_empty left them uninitialised
    rotary = model.model.rotary_emb
    model.model.rotary_emb = type(rotary)(config=model.config).to(device)
    model.train()
    return model


def build_optimizer(model, job: dict, device: torch.device):
    """AdamW as Megatron's optimizer does it: no weight decay on 1-D parameters (norms)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": job["weight_decay"]}, {"params": rest, "weight_decay": 0.0}]
    fused = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(groups, lr=job["lr"], betas=tuple(job["betas"]), eps=1e-8, **fused)


def main(job_path: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AttentionInterface, AutoConfig

    from thdpack.data import build_train_data

    job = json.loads(job_path.read_text())
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh(device.type, (world,))
    hf_dir = Path(job["hf_dir"])
    model_type = AutoConfig.from_pretrained(hf_dir).model_type

    attention = job["hf_attention"]
    if attention == "auto":
        attention = "varlen" if cuda else "sdpa"
    AttentionInterface.register(VARLEN, varlen_attention)
    liger = apply_liger(model_type) if cuda and job["liger"] else (LIGER_CPU if job["liger"] else "off")
    torch.manual_seed(job["seed"])
    model = build_model(hf_dir, VARLEN if attention == "varlen" else attention, device, mesh, bf16=cuda)
    optimizer = build_optimizer(model, job, device)
    dataset = {**job["dataset"], "micro_batch_tokens": job["hf_micro_batch_tokens"]}
    data = build_train_data(dataset, dp_rank=rank, dp_size=world, seed=job["seed"])

    steps = []
    for step in range(1, job["steps"] + 1):
        start = time.perf_counter()
        rows = [pack_row(batch) for batch in data.next_step()]
        count = torch.tensor(float(sum(r["targets"] for r in rows)), device=device)
        dist.all_reduce(count)
        # FSDP2 averages gradients over ranks: each rank's loss is its sum over the global count, times world
        scale = count / world
        loss_sum = torch.zeros((), device=device)
        for i, row in enumerate(rows):
            model.set_requires_gradient_sync(job["hf_sync_each_microbatch"] or i == len(rows) - 1)
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
    side = {
        "side": "hf",
        "device_name": device_label(),
        "layout": "fsdp2",
        "attention": "varlen_attn" if attention == "varlen" and cuda else attention,
        "attention_detail": (
            "torch.nn.attention.varlen.varlen_attn"
            if attention == "varlen" and cuda
            else "one SDPA per sample (the varlen function's CPU path)"
            if attention == "varlen"
            else "transformers sdpa, block-diagonal mask from position ids"
        ),
        "liger": liger,
        "precision": "bf16 params, fp32 reduce and master weights (FSDP2 MixedPrecisionPolicy)"
        if cuda
        else "fp32",
        "gradient_sync": "every micro-batch"
        if job["hf_sync_each_microbatch"]
        else "once per step (after the last micro-batch)",
        "micro_batch_tokens": dataset["micro_batch_tokens"],
        "experts_implementation": getattr(model.config, "_experts_implementation", None),
    }
    write_worker_result(Path(job["out"]), side, steps)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main(Path(sys.argv[1]))
