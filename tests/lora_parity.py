"""LoRA parity with PEFT, shared by the L0 test (one rank, every family) and the L1 script (TP, SP, PP, CP, EP, DP
under torchrun): the same tiny Hugging Face model and the same PEFT adapter on both sides.

* :func:`write_source`: a tiny model directory of a family (text: :mod:`tests.hf_models`; VL:
  :mod:`tests.vlm_models`);
* :func:`write_peft_adapter`: a PEFT adapter of that model, saved by PEFT itself, with random A **and** B (so the
  adapters change the logits and both get gradients);
* :func:`peft_reference`: PEFT on transformers' model: the loss of a padded batch and every adapter's gradient;
* :func:`thdpack_step`: thdpack's product path on this rank's layout: the family builds the model, ``apply_peft``
  loads the adapter (``peft.from_adapter``), ``wrap_model`` (DDP, distributed optimizer), Megatron's schedule with
  thdpack's packed forward step, one optimizer step, ``save_checkpoint``; it returns the loss, this rank's adapter
  gradients by PEFT key (TP slices gathered), the logits after the step;
* :func:`exported_checks`: ``export_adapter`` loaded by ``PeftModel.from_pretrained`` gives thdpack's logits;
  ``export_merged`` equals PEFT's ``merge_and_unload`` of the same adapter.

Measures are relative: ``max |a - b| / max |b|`` per tensor.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from tests.hf_models import parallel_sizes, run_schedule, whole_logits

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXT = ["llama3", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "gemma3", "gpt_oss"]
VL = ["qwen2_5_vl", "qwen3_vl"]
FAMILIES = TEXT + VL
RANK, ALPHA = 4, 8.0
SEQ = 64
LENGTHS = (7, 13, 5, 10)


ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL = [*ATTENTION, "gate_proj", "up_proj", "down_proj"]
# The modules the one-rank checks adapt (tests/unit/test_lora_parity.py; the others: ALL): llama3 q and v only
# (PEFT's default for Llama: the fused QKV layer's k rows get no adapter); Qwen3.5 its DeltaNet layers' out_proj,
# its full-attention layers' o_proj (their gated QKV and DeltaNet input projections are not adapted), the MLP.
ONE_RANK_TARGETS = {
    "llama3": ["q_proj", "v_proj", "down_proj"],
    "qwen3_moe": ATTENTION,
    "qwen3_vl": ATTENTION,
    "qwen3_5": ["o_proj", "out_proj", "gate_proj", "up_proj", "down_proj"],
    "qwen3_5_moe": ["o_proj", "out_proj", "down_proj"],  # down_proj: its shared expert's
    "gpt_oss": ATTENTION,  # its MLP is all experts
}
# The modules the parallel checks adapt: some families a part of each fused layer only (the other parts' rows get
# no adapter); Qwen3.5 its DeltaNet layers' out_proj and its full-attention layers' o_proj (their gated QKV and
# DeltaNet input projections are not adapted); the others all-linear.
PARALLEL_TARGETS = {
    "llama3": ["q_proj", "v_proj", "up_proj", "down_proj"],
    "qwen3_moe": ATTENTION,
    "qwen3_vl": ["k_proj", "o_proj", "gate_proj"],
    "qwen3_5": ["o_proj", "out_proj", "gate_proj", "up_proj", "down_proj"],
    "qwen3_5_moe": ["o_proj", "out_proj", "gate_proj", "up_proj", "down_proj"],  # its shared expert's MLP
    "gpt_oss": ["q_proj", "v_proj", "o_proj"],
}


def prepare(root: Path, families) -> Path:
    """``root/<family>/source`` and ``root/<family>/peft`` (the adapter of :data:`PARALLEL_TARGETS`) per family: what
    tests/functional/scripts/lora_parity.py reads."""
    for family in families:
        source = write_source(family, root / family / "source")
        write_peft_adapter(source, root / family / "peft", PARALLEL_TARGETS.get(family, ALL))
    return root


def write_source(family: str, directory: Path) -> Path:
    """A tiny Hugging Face directory of ``family`` (random weights, saved by transformers)."""
    if family in VL:
        from tests.vlm_models import build_tiny_vl

        return build_tiny_vl(directory, family=family)
    from tests.hf_models import save_model

    return save_model(family, directory)


def hf_base(directory: Path):
    """transformers' model of the directory, fp32, eager attention, eval mode."""
    import transformers

    config = json.loads((Path(directory) / "config.json").read_text())
    cls = getattr(transformers, config["architectures"][0])
    return cls.from_pretrained(
        str(directory), dtype=torch.float32, attn_implementation="eager", local_files_only=True
    ).eval()


def is_vl(directory: Path) -> bool:
    return "vision_config" in json.loads((Path(directory) / "config.json").read_text())


def peft_targets(directory: Path, names) -> list[str] | str:
    """PEFT's ``target_modules`` for ``names``: the names, or for a VL model a pattern over its language model."""
    if is_vl(directory):
        return r"model\.language_model\.layers\.\d+\..*\.(" + "|".join(names) + ")"
    return list(names)


def write_peft_adapter(directory: Path, out: Path, names, seed: int = 3, rslora: bool = False) -> Path:
    """PEFT's own adapter of the model in ``directory`` (rank :data:`RANK`, alpha :data:`ALPHA`) on ``names``: A and
    B drawn at random (``init_lora_weights=False``; B scaled to keep the logits moderate), saved with
    ``save_pretrained`` (safetensors)."""
    from peft import LoraConfig, get_peft_model

    base = hf_base(directory)
    torch.manual_seed(seed)
    config = LoraConfig(
        r=RANK,
        lora_alpha=ALPHA,
        target_modules=peft_targets(directory, names),
        init_lora_weights=False,
        use_rslora=rslora,
    )
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.2)
    model.save_pretrained(str(out))
    return out


def token_limit(directory: Path) -> int:
    """Ids below the first special token: random text never holds an image placeholder."""
    config = json.loads((Path(directory) / "config.json").read_text())
    text = config.get("text_config", config)
    ids = [config.get(k) for k in ("image_token_id", "video_token_id", "vision_start_token_id")]
    ids = [i for i in ids if isinstance(i, int)]
    return min([*ids, int(text["vocab_size"])])


def padded_batch(directory: Path, seed: int = 1) -> dict[str, torch.Tensor]:
    """Right-padded random tokens and their 0/1 mask (VL: text-only, with MRoPE ids: one position on every axis,
    as transformers' get_rope_index gives text)."""
    g = torch.Generator().manual_seed(seed)
    width = max(LENGTHS)
    mask = (torch.arange(width)[None] < torch.tensor(LENGTHS)[:, None]).long()
    batch = {
        "tokens": torch.randint(1, token_limit(directory), (len(LENGTHS), width), generator=g) * mask,
        "attention_mask": mask,
    }
    if is_vl(directory):
        batch["mrope_position_ids"] = torch.arange(width).expand(3, len(LENGTHS), width).clone()
    return batch


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|, on the host (a GPU run's gradient against PEFT's CPU reference)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


@dataclass
class Reference:
    loss: float
    grads: dict[str, torch.Tensor]  # PEFT key (base_model.model.<module>.lora_A.weight) -> gradient


def peft_model(directory: Path, adapter: Path, trainable: bool = False):
    from peft import PeftModel

    return PeftModel.from_pretrained(hf_base(directory), str(adapter), is_trainable=trainable)


def peft_reference(directory: Path, adapter: Path, batch) -> Reference:
    """PEFT on transformers: mean per-token loss of the padded batch, and each adapter weight's gradient."""
    model = peft_model(directory, adapter, trainable=True)
    labels = batch["tokens"].masked_fill(batch["attention_mask"] == 0, -100)
    out = model(input_ids=batch["tokens"], attention_mask=batch["attention_mask"], labels=labels)
    out.loss.backward()
    grads = {
        name.replace(".default.", "."): p.grad.detach().clone()
        for name, p in model.named_parameters()
        if p.requires_grad
    }
    return Reference(float(out.loss.detach()), grads)


@torch.no_grad()
def peft_logits(model, batch) -> list[torch.Tensor]:
    """Logits ``[L_i, V]`` of each sample alone (no pad)."""
    lengths = batch["attention_mask"].sum(1).tolist()
    return [model(input_ids=batch["tokens"][i : i + 1, :n]).logits[0] for i, n in enumerate(lengths)]


# ---------------------------------------------------------------------------------------------------------
# thdpack's side


@dataclass
class Step:
    loss: float | None  # last pipeline stage; None elsewhere
    grads: dict[str, torch.Tensor]  # PEFT key -> whole gradient, for this rank's layers
    logits: list[torch.Tensor] | None = None  # after the step, per sample (last stage, TP rank 0)
    group: dict = field(default_factory=dict)
    dtypes: dict = field(
        default_factory=dict
    )  # {"adapters": {dtypes}, "base": {dtypes}} of the trained model


def model_group(directory: Path, tp: int, backend: str = "torch") -> dict:
    """The recipe's model group of the directory; a MoE's router auxiliary loss off (transformers adds it only
    with ``output_router_logits``, which PEFT's reference leaves off)."""
    from thdpack.models import pretrained_model_group

    recipe = {
        "pretrained": str(directory),
        "attention_backend": backend,
        "config": {"moe_aux_loss_coeff": 0.0},
    }
    return pretrained_model_group(recipe, seq_length=SEQ, tp=tp)


def thdpack_step(
    directory: Path, adapter: Path, ckpt: Path | None, sequence_parallel: bool = False, runtime=None
) -> Step:
    """One training step of thdpack on the current Megatron layout (module docstring); saves a checkpoint of
    iteration 1 to ``ckpt`` when given. ``runtime``: :class:`thdpack.megatron.runtime.Runtime` (default: CPU, fp32,
    thdpack's torch attention)."""
    from megatron.core import parallel_state as ps

    from thdpack.hf.directory import keep_with_checkpoint
    from thdpack.megatron.checkpoint import save_checkpoint
    from thdpack.megatron.config import transformer_config
    from thdpack.megatron.distributed import te_wgrad_fusion, wrap_model
    from thdpack.megatron.optimizer import build_optimizer
    from thdpack.megatron.runtime import Runtime
    from thdpack.megatron.unwrap import unwrap_model
    from thdpack.models import get_family
    from thdpack.models.lora import apply_peft, peft_record, resolve_peft

    runtime = runtime or Runtime("cpu", "fp32", "torch")
    tp = ps.get_tensor_model_parallel_world_size()
    group = model_group(directory, tp, runtime.backend)
    parallel = parallel_sizes(sequence_parallel)
    config = transformer_config(group, parallel, runtime)
    family = get_family(group["family"])
    peft = resolve_peft({"name": "lora", "from_adapter": str(adapter)}, group)
    module = family.build(group, config, group["vocab_size"], SEQ, runtime)
    module = apply_peft(module, peft, group, config)
    model = wrap_model(module, config, runtime, fuse_wgrad=te_wgrad_fusion(group, runtime))
    trainer = dict(
        lr=1e-2, min_lr=1e-2, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95, clip_grad=0.0,
        train_iters=1, lr_warmup_iters=0, lr_decay_style="constant",
    )  # fmt: skip
    optimizer, scheduler = build_optimizer(trainer, model, config)
    batch = padded_batch(directory)
    reports = schedule(model, batch, family_step(family))
    loss = None
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        from thdpack.megatron.loss import LM_LOSS

        loss = float(LM_LOSS.reduce(reports))
    grads = adapter_grads(model, is_vl(directory))
    optimizer.step()
    scheduler.step(increment=1)
    if ckpt is not None:
        import torch.distributed as dist

        if dist.get_rank() == 0:
            keep_with_checkpoint(ckpt, group, "fp32")
        record = peft_record(peft, group)
        save_checkpoint(ckpt, 1, model, optimizer, scheduler, {"data": {}, "peft": record})
    logits = step_logits(model, family, batch)
    named = list(unwrap_model(model).named_parameters())
    dtypes = {
        "adapters": {p.dtype for n, p in named if ".lora_" in n},
        "base": {p.dtype for n, p in named if ".lora_" not in n},
    }
    return Step(loss, grads, logits, group, dtypes)


def schedule(model, batch, forward_step, forward_only: bool = False):
    """Megatron's schedule over the one micro-batch ``batch`` of :data:`SEQ` tokens (:func:`run_schedule`)."""
    return run_schedule(model, batch, forward_step, SEQ, forward_only)


def family_step(family):
    """thdpack's forward step for the family (its forward, batch hook and carried keys)."""
    from thdpack.megatron.batch import BatchConfig
    from thdpack.megatron.step import make_forward_step

    return make_forward_step(
        BatchConfig(transform=family.transform, carry_keys=family.carry_keys), forward=family.forward
    )


def adapter_grads(model, vision_language: bool) -> dict[str, torch.Tensor]:
    """Each adapter weight's gradient (Megatron's reduced ``main_grad``) by PEFT key, whole: TP slices gathered."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from thdpack.hf.adapter import module_path, peft_key
    from thdpack.megatron.lora import adapter_modules
    from thdpack.megatron.unwrap import unwrap_model

    gather_gradient_shards(model)
    tp = ps.get_tensor_model_parallel_world_size()
    out = {}
    for _, adapter in adapter_modules(unwrap_model(model)):
        for part, key in zip(adapter.parts, adapter.keys, strict=True):
            if part is None:
                continue
            for which, param in (("A", adapter.lora_A[part]), ("B", adapter.lora_B[part])):
                grad = param.main_grad.detach().clone()
                if getattr(param, "tensor_model_parallel", False) and tp > 1:
                    pieces = [torch.empty_like(grad) for _ in range(tp)]
                    dist.all_gather(pieces, grad.contiguous(), group=ps.get_tensor_model_parallel_group())
                    grad = torch.cat(pieces, dim=param.partition_dim)
                out[peft_key(module_path(key, vision_language), which)] = grad
    return out


def gather_gradient_shards(model) -> None:
    """The distributed optimizer's reduce-scatter leaves each data-parallel rank the reduced gradients of its own
    shard of every bucket only: all-gather the shards, so that every rank holds every reduced gradient."""
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    for buffer in model.buffers + model.expert_parallel_buffers:
        group = buffer.data_parallel_group
        for bucket in buffer.buckets:
            shards = shard_buffer(bucket.grad_data, group.size())
            dist.all_gather_into_tensor(bucket.grad_data, shards[group.rank()].clone(), group=group)


def step_logits(model, family, batch) -> list[torch.Tensor] | None:
    """The model's logits of each sample (real tokens only) after the step: on the last pipeline stage (gathered
    over TP and CP), None elsewhere."""
    from megatron.core import parallel_state as ps

    from thdpack.megatron.batch import BatchConfig, get_batch
    from thdpack.megatron.unwrap import unwrap_model

    captured = {}
    config = BatchConfig(transform=family.transform, carry_keys=family.carry_keys)

    def forward_step(data_iterator, model):
        inputs = get_batch(data_iterator, unwrap_model(model).config, config)
        inputs.labels = None
        output = family.forward(model, inputs)
        captured["starts"] = inputs.packed_seq_params.cu_seqlens_q_padded.tolist()

        def keep(output):
            captured["logits"] = output.detach()
            return output.sum() * 0, torch.ones((), dtype=torch.int), {}

        return output, keep

    with torch.no_grad():
        schedule(model, batch, forward_step, forward_only=True)
    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        return None
    logits = whole_logits(captured["logits"], captured["starts"])
    starts = captured["starts"]
    return [logits[0, starts[i] : starts[i] + n] for i, n in enumerate(LENGTHS)]


def grad_difference(step: Step, reference: Reference) -> float:
    """The largest relative difference of this rank's adapter gradients from PEFT's (every key on this rank's layers
    must be one of PEFT's)."""
    missing = sorted(set(step.grads) - set(reference.grads))
    assert not missing, f"thdpack adapts modules PEFT does not: {missing[:4]}"
    return max(relative(g, reference.grads[k]) for k, g in step.grads.items())


# ---------------------------------------------------------------------------------------------------------
# Export


@dataclass
class Exported:
    logits: float  # PEFT with the exported adapter vs thdpack's logits after the step
    merged: float  # export_merged vs PEFT's merge_and_unload of the same adapter
    same_tensors: bool  # the merged export holds exactly the base's tensor names


def exported_checks(directory: Path, ckpt: Path, out: Path, logits: list[torch.Tensor]) -> Exported:
    """Export the checkpoint of iteration 1 both ways (into ``out/adapter``, ``out/merged``) and compare with PEFT."""
    from safetensors.torch import load_file

    from thdpack.hf.checkpoint import safetensors_files
    from thdpack.models.lora import export_adapter, export_merged

    iteration, hf_dir = ckpt / "iter_0000001", ckpt / "hf"
    export_adapter(iteration, hf_dir, out / "adapter")
    export_merged(iteration, hf_dir, out / "merged")
    model = peft_model(directory, out / "adapter")
    batch = padded_batch(directory)
    theirs = peft_logits(model, batch)
    vocab = theirs[0].shape[-1]
    logit_diff = max(relative(mine[:, :vocab], ref) for mine, ref in zip(logits, theirs, strict=True))
    merged_ref = model.merge_and_unload().state_dict()
    merged = {}
    for file in safetensors_files(out / "merged"):
        merged.update(load_file(str(file)))
    base = {}
    for file in safetensors_files(directory):
        base.update(load_file(str(file)))
    # transformers' in-memory names of a VL model differ from a checkpoint stored as model.layers.*
    from thdpack.hf.vl_checkpoint import language_model_name

    def in_memory(name: str) -> str:
        if is_vl(directory) and language_model_name(name) is not None and name.startswith("model."):
            return "model.language_model." + name.removeprefix("model.").removeprefix("language_model.")
        if is_vl(directory) and name.startswith("visual."):
            return "model." + name
        return name

    # a tensor transformers holds under another layout (a MoE's fused experts) is no adapted one: it must be the
    # base's, bit for bit
    diffs = [
        relative(t, merged_ref[in_memory(n)])
        if in_memory(n) in merged_ref
        else float(not torch.equal(t, base[n]))
        for n, t in merged.items()
    ]
    return Exported(logit_diff, max(diffs), sorted(merged) == sorted(base))
