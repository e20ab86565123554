"""L1 vision-language parity (Qwen2.5-VL, Qwen3-VL or Qwen3-VL-MoE, as the directory's config.json says) under a parallel layout (torchrun, gloo on CPU): every rank computes transformers'
reference on each sample alone, then thdpack's packed forward of the whole batch under the layout (CP: the
vision tower on every rank, image embeddings scattered into each rank's zigzag shard; TP with sequence
parallelism: scattered before the sequence split; PP: the vision tower and the DeepStack layers on the first
stage, the hidden states sent on, the MRoPE ids given to every stage). Each rank compares the logits of its own
tokens (on the last pipeline stage) and checks the MRoPE ids of its shard against transformers' get_rope_index; the
loss sums are reduced over CP.

    torchrun --nproc-per-node 2 tests/functional/scripts/vlm_parity.py --layout cp2 --directory DIR

Prints ``VLM PARITY OK <layout> <directory> max|dlogit|=... |dloss|=... layers per stage [[...], ...]``; raises
otherwise. ``--layout cp2 pp2 --directory DIR + --layout ep2 --directory DIR2`` runs every layout of every
directory one after another in one launch (the start-up, seconds of imports a rank, paid once).
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root: tests.* and thdpack

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.vlm_parity import (  # noqa: E402
    build,
    hf_class,
    hf_reference,
    max_logit_difference,
    mixed_chats,
    model_group,
    samples,
    thdpack_forward,  # noqa: E402
)

# ep2 (MoE families): each rank holds half the experts; both ranks run the whole batch as two data-parallel ranks,
# the alltoall dispatcher sending each token to its experts' rank. ep2_cp2: experts split over the two CP ranks.
LAYOUTS = {
    "cp2": dict(cp=2),
    "tp2_sp": dict(tp=2, sp=True),
    "tp2": dict(tp=2),
    "ep2": dict(ep=2),
    "ep2_cp2": dict(ep=2, cp=2),
    "pp2": dict(pp=2),
}
SEQ = 256


def first_stage_holds_deepstack(group: dict, directory: str, pp: int) -> dict:
    """``group`` with ``config.num_layers_in_first_pipeline_stage`` set where the layers do not split evenly over
    ``pp`` stages or an even split leaves DeepStack layers (Qwen3-VL) off the first stage: the first stage then
    holds the DeepStack layers and the others share the rest."""
    from thdpack.hf.checkpoint import HFCheckpoint
    from thdpack.hf.vl_checkpoint import text_config
    from thdpack.models import family_of, qwen3_vl

    hf = HFCheckpoint.open(directory)
    layers = int(text_config(hf.config)["num_hidden_layers"])
    deepstack = 0 if family_of(hf).name == "qwen2_5_vl" else qwen3_vl.deepstack_layers(hf)
    if layers % pp == 0 and layers // pp >= deepstack:
        return group
    first = max(deepstack, layers - (pp - 1) * (layers // pp))
    return {**group, "config": {**group["config"], "num_layers_in_first_pipeline_stage": first}}


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", choices=sorted(LAYOUTS), nargs="+", required=True)
    parser.add_argument("--directory", required=True)
    return parser


def rope_index_ids(directory: str, batch) -> list[torch.Tensor]:
    """transformers' get_rope_index ids of every sample of ``batch`` (``[3, length]`` each)."""
    hf = hf_class(directory).from_pretrained(directory).model
    takes_types = "mm_token_type_ids" in inspect.signature(hf.get_rope_index).parameters
    expected_ids = []
    for s in batch:
        ids = torch.from_numpy(s.tokens)[None]
        grids = torch.from_numpy(s.media["image_grid_thw"]) if len(s.media["image_grid_thw"]) else None
        kwargs = {"mm_token_type_ids": (ids == hf.config.image_token_id).int()} if takes_types else {}
        expected_ids.append(hf.get_rope_index(ids, image_grid_thw=grids, **kwargs)[0][:, 0])
    return expected_ids


def main(argv: list[str]) -> None:
    """``--layout L [L ...] --directory DIR [+ --layout ... --directory DIR2 ...]``: every layout of every directory,
    one after another in this launch (one start-up for all); the reference is computed once a directory."""
    from parity import split_cases  # this directory's parity.py: the same "+" separators

    groups = split_cases(argv)
    os.environ["HF_HUB_OFFLINE"] = "1"
    from thdpack.hf.processor import VLProcessor

    for group in groups:
        args = parser().parse_args(group)
        torch.manual_seed(0)
        batch = samples(VLProcessor(args.directory), mixed_chats())
        reference = hf_reference(args.directory, batch)
        expected_ids = rope_index_ids(args.directory, batch)
        for layout in args.layout:
            check(layout, args.directory, batch, reference, expected_ids)
    dist.destroy_process_group()


def check(name: str, directory: str, batch, reference, expected_ids: list[torch.Tensor]) -> None:
    """thdpack's packed forward of ``batch`` under layout ``name`` against transformers' ``reference``; prints
    VLM PARITY OK on the last rank, raises SystemExit on a failed check."""
    layout = LAYOUTS[name]
    cp, tp, sp, ep = layout.get("cp", 1), layout.get("tp", 1), layout.get("sp", False), layout.get("ep", 1)
    pp = layout.get("pp", 1)
    from megatron.core import parallel_state as ps

    from thdpack.megatron.cpu import initialize_model_parallel_cpu

    initialize_model_parallel_cpu(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        seed=1234,
    )
    parallel = dict(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        sequence_parallel=sp,
    )
    group = model_group(directory, SEQ, tp)
    if pp > 1:
        group = first_stage_holds_deepstack(group, directory, pp)
    model, config = build(directory, group, parallel, SEQ)
    assert config.sequence_parallel == sp
    if ep > 1:
        experts = config.num_moe_experts
        assert experts, f"--layout {name} needs a mixture-of-experts checkpoint"
        local = model.language_model.decoder.layers[0].mlp.experts.num_local_experts
        assert local == experts // ep, (local, experts, ep)
    cp_rank = ps.get_context_parallel_rank()
    last_stage = ps.is_pipeline_last_stage()
    out = thdpack_forward(model, batch, SEQ, cp, cp_rank, tp, sp)
    # a stage before the last has no logits: it checks the MRoPE ids of its layers only
    logits, where, loss_sum, count = out if last_stage else (None, [], 0.0, 0)
    difference = max_logit_difference(reference, logits, where) if last_stage else 0.0

    # The MRoPE ids this rank's tokens carry are transformers' get_rope_index ids at their sample positions.
    from thdpack import Alignment, pack_bshd
    from thdpack.data.collate import collate

    collated = collate(batch, SEQ, pad_id=0, pad_to="longest")
    for key in ("pixel_values", "image_grid_thw"):
        collated.pop(key)
    mode = "fold" if cp > 1 else "distinct"
    shard = pack_bshd(collated, alignment=Alignment(cp_size=cp, tp_size=tp, sequence_parallel=sp, mode=mode))
    shard = shard.shard_for_cp(cp, cp_rank)
    from tests.vlm_parity import _owners  # noqa: E402 - the same position map thdpack_forward used
    from thdpack.packing.context_parallel import cp_partition_indices

    full = pack_bshd(collated, alignment=Alignment(cp_size=cp, tp_size=tp, sequence_parallel=sp, mode=mode))
    positions = (
        cp_partition_indices(full.layout.cu_seqlens_padded, cp, cp_rank)
        if cp > 1
        else range(full.total_tokens)
    )
    owner = _owners(full)
    mrope_mismatch = 0
    for local, p in enumerate(positions):
        if int(p) in owner:
            row, col = owner[int(p)]
            mrope_mismatch += int(
                not torch.equal(shard.mrope_position_ids[:, 0, local], expected_ids[row][:, col])
            )

    totals = torch.tensor(
        [loss_sum, float(count), float(mrope_mismatch), float(len(where))], dtype=torch.float64
    )
    dist.all_reduce(totals, group=ps.get_context_parallel_group())
    worst = torch.tensor([difference])
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    loss = float(totals[0] / totals[1]) if last_stage else float("nan")
    expected = reference.loss_sum / reference.loss_count
    real_tokens = sum(len(s.tokens) for s in batch)
    checks = {
        "every real token compared once over CP": int(totals[3]) == real_tokens,
        "loss token count": int(totals[1]) == reference.loss_count,
        "MRoPE ids equal get_rope_index": int(totals[2]) == 0,
        "logits within 1e-4": float(worst) <= 1e-4,
        "loss within 1e-5 relative": abs(loss - expected) <= 1e-5 * abs(expected),
    }
    if not last_stage:
        checks = {"MRoPE ids equal get_rope_index": checks["MRoPE ids equal get_rope_index"]}
    failed = [name for name, ok in checks.items() if not ok]
    if failed:
        raise SystemExit(
            f"rank {dist.get_rank()}: {name} failed {failed}: max|dlogit|={float(worst):.3g} loss {loss} vs "
            f"{expected}, mrope mismatches {int(totals[2])}, tokens {int(totals[3])}/{real_tokens}"
        )
    # the decoder layers (1-based) each pipeline stage holds, for the report
    stages = [None] * pp
    held = [layer.layer_number for layer in model.language_model.decoder.layers]
    dist.all_gather_object(stages, held, group=ps.get_pipeline_model_parallel_group())
    if dist.get_rank() == dist.get_world_size() - 1:  # on the last pipeline stage
        print(
            f"VLM PARITY OK {name} {directory} max|dlogit|={float(worst):.3g} |dloss|={abs(loss - expected):.3g} "
            f"layers per stage {stages}"
        )
    ps.destroy_model_parallel()


if __name__ == "__main__":
    main(sys.argv[1:])
