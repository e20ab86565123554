"""L1 parity: packed training under a parallel layout computes what a single-rank reference computes.

Run under torchrun (gloo on CPU). Every rank:
  1. builds the reference model (no model parallelism; identical weights on every rank) and computes the
     reference per-token loss and gradients over the whole global batch, each sample alone and unpadded
     (dense), or the padded BSHD batch with the MoE padding mask (MoE);
  2. re-initialises Megatron with the layout, builds the parallel model, loads the same weights (sliced for
     TP / PP / EP), and runs thdpack's forward_step through Megatron's get_forward_backward_func on its own
     DP rank's micro-batches;
  3. reduces gradients as finalize_model_grads does (SP norms over TP, DP x CP, divide by the global token
     count), gathers shards into full tensors, and rank 0 compares loss and every gradient.
Prints "PARITY OK <layout> <scenario> mode=<mode> max|dloss|=... max|dgrad|=..." on success; raises otherwise.
Several cases, separated by ``+``, run one after another in one launch (``--layout tp2 + --layout cp2 --mode
distinct``): each re-initialises Megatron as a case alone does, and the start-up (seconds of imports per rank)
is paid once.

``--device cuda --backend te`` runs the same case on GPUs with NCCL, Transformer Engine attention and bf16
(the GPU check; not CI): then the comparison is reported, and only asserted loosely (bf16 rounding).
"""

from __future__ import annotations

import argparse
import re
import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.moe import router as moe_router
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.transformer_config import TransformerConfig

from thdpack.megatron.batch import BatchConfig, model_alignment
from thdpack.megatron.cpu import initialize_model_parallel_cpu
from thdpack.megatron.loss import LM_LOSS
from thdpack.megatron.models import build_gpt_model
from thdpack.megatron.step import make_forward_step

ARGS = None  # the parsed command line: device, backend, mode

LAYOUTS = {
    "tp2": dict(tp=2),
    "tp2_sp": dict(tp=2, sp=True),
    "pp2": dict(pp=2),
    "cp2": dict(cp=2),
    "cp2_tp2": dict(cp=2, tp=2),
    "tp2_pp2": dict(tp=2, pp=2),
    "dp2": dict(),
    "ep2": dict(ep=2, moe=True),  # alltoall dispatcher
    "ep2_allgather": dict(ep=2, moe=True, dispatcher="allgather", bucket=64),
    "mrope_cp2": dict(cp=2, mrope=True),
    "single": dict(),
}
VOCAB, SEED = 64, 1234
RTOL, ATOL = 1e-5, 1e-6


def model_config(
    tp=1, pp=1, cp=1, ep=1, sp=False, moe=False, mrope=False, dispatcher="alltoall", bucket=None
) -> TransformerConfig:
    del bucket  # a layout key for get_batch's token bucket, not a model setting
    dtype = torch.bfloat16 if ARGS.device == "cuda" else torch.float32
    extra = dict(bf16=True) if dtype == torch.bfloat16 else {}
    if moe:
        extra |= dict(
            num_moe_experts=4,
            moe_router_topk=2,
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=1e-2,
        )
    if mrope:
        extra["mrope_section"] = [2, 1, 1]
    return TransformerConfig(
        num_layers=2,
        hidden_size=32,
        ffn_hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=8,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.2,
        add_bias_linear=False,  # MoE experts with bias add in place into a TP-reduce output (megatron-core 0.16.1)
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        sequence_parallel=sp,
        calculate_per_token_loss=True,
        variable_seq_lengths=pp > 1,  # PP: the token count differs between micro-batches
        # alltoall for dense models too: megatron-core 0.16.1 refuses variable_seq_lengths with "allgather"
        moe_token_dispatcher_type=dispatcher,
        # On a GPU, megatron keeps the rotary tables on the device it built them on: build there.
        use_cpu_initialization=ARGS.device == "cpu",
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        **extra,
    )


# ------------------------------------------------------------------------------------------ data


def make_batches(num_dp: int, num_microbatches: int, scenario: str, mrope: bool) -> list[list[dict]]:
    """``batches[dp_rank][microbatch]``: padded BSHD host batches with varied lengths (a 1-token sample,
    odd lengths that need CP alignment pad, a full row) and a sequence length that differs between
    micro-batches."""
    g = torch.Generator().manual_seed(SEED)
    out = []
    for dp in range(num_dp):
        rank_batches = []
        for mb in range(num_microbatches):
            S = 11 + 2 * mb + dp
            # all_masked_cp_rank, cp=2: rank 1 holds token 1 (no target) and pad only
            lengths = [2] if scenario == "all_masked_cp_rank" else [1, S, 5 + mb, 3 + dp]
            B = len(lengths)
            tokens = torch.randint(1, VOCAB, (B, S), generator=g)
            mask = torch.zeros(B, S, dtype=torch.long)
            for b, n in enumerate(lengths):
                mask[b, :n] = 1
            batch = {"tokens": tokens * mask, "attention_mask": mask}
            if scenario == "segment_ids":
                # Row 1 holds two samples back to back; labels are shifted within the row (Megatron's
                # convention), so the first sample's last label is the second sample's first token.
                mask[1, : S // 2] = 1
                mask[1, S // 2 :] = 2
                batch["attention_mask"] = mask
                labels = torch.roll(tokens * (mask > 0), -1, dims=1)
                labels[mask == 0] = -100
                labels[:, -1] = -100
                for b, n in enumerate(lengths):
                    if b != 1:
                        labels[b, n - 1] = -100
                batch["labels"] = labels
            if mrope:
                batch["mrope_position_ids"] = _mrope_ids(mask, g)
            rank_batches.append(batch)
        out.append(rank_batches)
    return out


def _mrope_ids(mask: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Qwen-VL style ids per sample: text counts up on all axes; a 2x2 'image' block in longer samples
    shares its temporal id and spreads over height and width."""
    B, S = mask.shape
    ids = torch.zeros(3, B, S, dtype=torch.long)
    for b in range(B):
        n = int(mask[b].sum())
        pos = torch.arange(n).repeat(3, 1)
        if n >= 8:
            start = int(torch.randint(1, n - 4, (1,), generator=g))
            block = torch.tensor([[0, 0, 0, 0], [0, 0, 1, 1], [0, 1, 0, 1]]) + start
            pos[:, start : start + 4] = block
            pos[:, start + 4 :] = torch.arange(start + 2, start + 2 + n - start - 4).repeat(3, 1)
        ids[:, b, :n] = pos
    return ids


def samples_of(batch: dict) -> list[dict]:
    """Each real sample alone: tokens, labels, loss mask (and MRoPE ids), unpadded."""
    mask = batch["attention_mask"]
    out = []
    for b in range(mask.shape[0]):
        for seg_id in mask[b].unique().tolist():
            if seg_id == 0:
                continue
            cols = (mask[b] == seg_id).nonzero().flatten()
            lo, hi = int(cols[0]), int(cols[-1]) + 1
            tokens = batch["tokens"][b, lo:hi]
            labels = torch.full_like(tokens, -100)
            labels[:-1] = tokens[1:]
            if "labels" in batch:  # only within the sample: the last token never predicts the next sample
                labels[:-1] = batch["labels"][b, lo : hi - 1]
            sample = {"tokens": tokens[None], "labels": labels[None]}
            if "mrope_position_ids" in batch:
                sample["mrope"] = batch["mrope_position_ids"][:, b : b + 1, lo:hi]
            out.append(sample)
    return out


# ------------------------------------------------------------------------------------------ weights


def global_name(model, name: str) -> str:
    """Parameter name in the reference model: global layer index (PP) and global expert index (EP)."""
    match = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
    if match:
        layer = model.decoder.layers[int(match.group(1))]
        name = f"decoder.layers.{layer.layer_number - 1}.{match.group(2)}"
    match = re.match(r"(.*\.local_experts\.)(\d+)(\..*)", name)
    if match:
        local = model.config.num_moe_experts // ps.get_expert_model_parallel_world_size()
        expert = ps.get_expert_model_parallel_rank() * local + int(match.group(2))
        name = f"{match.group(1)}{expert}{match.group(3)}"
    return name


def load_full_weights(model, full: dict[str, torch.Tensor]) -> None:
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, p in model.named_parameters():
            w = full[global_name(model, name)]
            if getattr(p, "tensor_model_parallel", False):
                w = w.chunk(tp, dim=p.partition_dim)[tp_rank]
            p.copy_(w)


def reduced_full_grads(model, sp: bool, num_tokens: int) -> dict[str, torch.Tensor]:
    """Every gradient as ``finalize_model_grads`` leaves it (summed over its replicas, divided by the token
    count), TP shards gathered into the full tensor, keyed by reference name."""
    tp_group = ps.get_tensor_model_parallel_group()
    out = {}
    for name, p in model.named_parameters():
        g = p.grad.float().clone() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32)
        if sp and getattr(p, "sequence_parallel", False):
            dist.all_reduce(g, group=tp_group)
        if getattr(p, "allreduce", True):
            dist.all_reduce(g, group=ps.get_data_parallel_group(with_context_parallel=True))
        else:  # expert weights: replicated over the expert-data-parallel group only
            dist.all_reduce(g, group=ps.get_expert_data_parallel_group())
        if getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(g) for _ in range(ps.get_tensor_model_parallel_world_size())]
            dist.all_gather(parts, g.contiguous(), group=tp_group)
            g = torch.cat(parts, dim=p.partition_dim)
        out[global_name(model, name)] = (g / num_tokens).cpu()
    return out


# ------------------------------------------------------------------------------------------ runs


def build(config, mrope):
    model = build_gpt_model(
        config, VOCAB, 64, backend=ARGS.backend, position_embedding_type="mrope" if mrope else "rope"
    )
    if ARGS.device != "cuda":
        return model
    model = model.cuda()
    if ARGS.backend == "torch" and config.bf16:
        # What Megatron's Float16Module does in training: cast every parameter. TE layers are created in
        # params_dtype already; the local spec's torch LayerNorm is not.
        model = model.bfloat16()
    return model


def init_parallel(**sizes):
    if ARGS.device == "cpu":
        initialize_model_parallel_cpu(seed=SEED, **sizes)
        return
    import os

    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
    ps.initialize_model_parallel(**sizes)
    model_parallel_cuda_manual_seed(SEED)


def reference(config, batches, moe, mrope):
    """Loss and grads of the reference model on the whole global batch, plus its full weights."""
    torch.manual_seed(SEED)
    model = build(config, mrope)
    full = {k: v.detach().clone() for k, v in model.named_parameters()}
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1, device=next(model.parameters()).device))
    loss_sum, count = torch.zeros((), device=next(model.parameters()).device), 0
    if moe:  # the padded BSHD batch, causal, with the MoE padding mask: thdpack's own baseline path
        forward = make_forward_step(BatchConfig(pack_sequences_in_batch=False))
        for batch in (b for rank in batches for b in rank):
            output, loss_fn = forward(iter([batch]), model)
            s, n, _ = loss_fn(output)
            loss_sum, count = loss_sum + s, count + int(n)
    else:  # each sample alone, unpadded, causal
        for batch in (b for rank in batches for b in rank):
            for sample in samples_of(batch):
                labels = sample["labels"]
                L = labels.shape[1]
                position_ids = sample["mrope"] if mrope else torch.arange(L)[None]
                dev = lambda t: t.to(next(model.parameters()).device)  # noqa: E731
                losses = model(
                    dev(sample["tokens"]), dev(position_ids), None, labels=dev(labels.clamp(min=0))
                )
                mask = dev(labels != -100)
                loss_sum, count = loss_sum + losses[mask].sum(), count + int(mask.sum())
    # Megatron's per-token convention: backward on the sum, then every gradient (the MoE aux loss's too) is
    # divided by the token count in finalize_model_grads.
    loss_sum.backward()
    grads = {k: p.grad.detach().float().cpu() / count for k, p in model.named_parameters()}
    return full, float(loss_sum / count), grads


def packed_run(config, full, batches, moe, mrope, bucket):
    torch.manual_seed(SEED)
    model = build(config, mrope)
    load_full_weights(model, full)
    seen = record_attention_calls(model)
    router_counts = record_router_counts() if moe else None
    dp_rank = ps.get_data_parallel_rank()
    local = batches[dp_rank]
    reports = get_forward_backward_func()(
        forward_step_func=make_forward_step(
            BatchConfig(alignment=model_alignment(config, ARGS.mode, bucket))
        ),
        data_iterator=iter(local),
        model=[model],
        num_microbatches=len(local),
        seq_length=max(b["tokens"].shape[1] for b in local) * len(local[0]["tokens"]),
        micro_batch_size=1,
        forward_only=False,
    )
    # The global token count, as finalize_model_grads computes it (one TP rank per loss; all DP x CP ranks).
    last = ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0
    local_sum = torch.stack([r["lm loss"] for r in reports]).sum(0) if last and reports else torch.zeros(2)
    local_sum = local_sum.to(next(model.parameters()).device)
    assert torch.isfinite(local_sum).all(), f"rank {dist.get_rank()}: non-finite loss report {local_sum}"
    counts = [None] * dist.get_world_size()
    dist.all_gather_object(counts, int(local_sum[1]) if last else None)
    dist.all_reduce(local_sum)
    loss, num_tokens = float(local_sum[0] / local_sum[1]), int(local_sum[1])
    if ps.is_pipeline_last_stage(ignore_virtual=True):  # the reported loss: thdpack's DP x CP reduction
        reported = float(LM_LOSS.reduce(reports))
        assert abs(reported - loss) <= 1e-6 * abs(loss), f"LM_LOSS.reduce gave {reported}, expected {loss}"
    grads = reduced_full_grads(model, config.sequence_parallel, num_tokens)
    return loss, grads, seen, router_counts, counts


def record_attention_calls(model) -> list:
    """Which packed_seq_params each core attention of this stage received."""
    seen = []

    def hook(module, args, kwargs):
        p = kwargs.get("packed_seq_params")
        seen.append(None if p is None else (p.qkv_format, p.cu_seqlens_q_padded.tolist()))

    for module in model.modules():
        if type(module).__name__ in ("TorchTHDAttention", "TEDotProductAttention"):
            module.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def record_router_counts() -> list:
    """The tokens each load-balancing loss counts (sum over experts / topk), per router call."""
    counts = []
    original = moe_router.switch_load_balancing_loss_func

    def spy(*args, **kwargs):
        counts.append(
            (int(kwargs["tokens_per_expert"].sum()) // kwargs["topk"], int(kwargs["total_num_tokens"]))
        )
        return original(*args, **kwargs)

    moe_router.switch_load_balancing_loss_func = spy
    return counts


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", choices=sorted(LAYOUTS), required=True)
    parser.add_argument("--scenario", default="mixed", choices=["mixed", "segment_ids", "all_masked_cp_rank"])
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--backend", default="torch", choices=["torch", "te"])
    parser.add_argument("--mode", default="auto", choices=["auto", "distinct", "fold"])
    parser.add_argument(
        "--own-gloo-tp-groups",
        action="store_true",
        help="send batches over separate gloo TP groups, as with NCCL (on CPU the TP group already is gloo)",
    )
    return parser


def run_case(args) -> None:
    """One case: the reference, then the packed step under ``args.layout``; rank 0 compares and prints PARITY OK."""
    global ARGS
    ARGS = args
    layout = LAYOUTS[args.layout]
    moe, mrope = layout.get("moe", False), layout.get("mrope", False)

    from thdpack.megatron import batch as batch_module

    is_gloo, switch_load_balancing_loss_func = (
        batch_module._is_gloo,
        moe_router.switch_load_balancing_loss_func,
    )
    if args.own_gloo_tp_groups:
        batch_module._is_gloo = lambda group: False
    try:
        compare(args, layout, moe, mrope)
    finally:  # the next case of this launch starts from megatron-core and thdpack as they were
        batch_module._is_gloo = is_gloo
        moe_router.switch_load_balancing_loss_func = switch_load_balancing_loss_func


def compare(args, layout: dict, moe: bool, mrope: bool) -> None:
    init_parallel()
    world = dist.get_world_size()
    tp, pp, cp = layout.get("tp", 1), layout.get("pp", 1), layout.get("cp", 1)
    num_dp = world // (tp * pp * cp)
    batches = make_batches(num_dp, args.microbatches, args.scenario, mrope)
    full, ref_loss, ref_grads = reference(model_config(moe=moe, mrope=mrope), batches, moe, mrope)
    ps.destroy_model_parallel()

    init_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=layout.get("ep", 1),
    )
    config = model_config(**layout)
    loss, grads, seen, router_counts, counts = packed_run(
        config, full, batches, moe, mrope, layout.get("bucket")
    )

    if args.scenario == "all_masked_cp_rank":
        assert 0 in counts, f"the scenario must leave a CP rank without counted tokens, got counts {counts}"
    # Every stage's attention ran on THD boundaries (a PP stage without them would silently run BSHD).
    assert seen and all(s is not None and s[0] == "thd" for s in seen), (
        f"attention calls without THD boundaries: {seen}"
    )
    if router_counts is not None:
        real = sum(int(b["attention_mask"].sum()) for b in batches[ps.get_data_parallel_rank()])
        counted = sum(c for c, _ in router_counts) // config.num_layers
        assert counted == real, f"MoE router counted {counted} tokens, the batch has {real} real tokens"
    gathered = [None] * world
    dist.all_gather_object(gathered, grads)
    if dist.get_rank() == 0:
        merged = {}
        for part in gathered:
            merged.update(part)
        assert merged.keys() == ref_grads.keys(), sorted(set(merged) ^ set(ref_grads))
        dloss = abs(loss - ref_loss)
        worst = max(float((merged[n] - ref).abs().max()) for n, ref in ref_grads.items())
        if ARGS.device == "cuda":  # bf16: report, assert only what rounding cannot explain
            errors = {
                n: float((merged[n] - r).norm() / r.norm().clamp(min=1e-12)) for n, r in ref_grads.items()
            }
            rel = max(errors.values())
            print("worst:", sorted(errors.items(), key=lambda kv: -kv[1])[:3])
            print(
                f"GPU PARITY {args.layout} mode={ARGS.mode} backend={ARGS.backend} loss={loss:.5f} ref={ref_loss:.5f} "
                f"max|dloss|={dloss:.2e} max|dgrad|={worst:.2e} max_rel_grad_err={rel:.2e}"
            )
            assert dloss <= 5e-2 * abs(ref_loss) and rel < 0.1, "bf16 run too far from the reference"
        else:
            assert dloss <= ATOL + RTOL * abs(ref_loss), f"loss {loss} vs reference {ref_loss}"
            for name, ref in ref_grads.items():
                torch.testing.assert_close(
                    merged[name], ref, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}"
                )
        print(
            f"PARITY OK {args.layout} {args.scenario} mode={args.mode} loss={loss:.6f} max|dloss|={dloss:.2e} max|dgrad|={worst:.2e}"
        )
    dist.barrier()
    ps.destroy_model_parallel()


def split_cases(argv: list[str]) -> list[list[str]]:
    """The command line's cases: the arguments between ``+`` separators (this script's and ``vlm_parity.py``'s)."""
    cases = [[]]
    for arg in argv:
        if arg == "+":
            cases.append([])
        else:
            cases[-1].append(arg)
    return cases


def main(argv: list[str]) -> None:
    """``parity.py --layout L [...] [+ --layout L2 [...]]``: the cases separated by ``+`` run one after another in
    this launch (one start-up for all; a failing case stops the launch)."""
    for case in split_cases(argv):
        run_case(parser().parse_args(case))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
