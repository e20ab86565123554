"""Megatron-core on CPU over gloo: a parallel run gives the single-rank loss (and gradients).

Run by tests/functional/test_cpu_parallel.py as
`torchrun --nproc_per_node=2 cpu_parallel_smoke.py --layout tp2 tp2sp pp2 ep2 ep2_alltoall`: the layouts one after
another in one launch (one start-up for all); a failing layout stops the launch.

Every rank first builds the reference: the same seeded GPT model without model parallelism, run on
the micro-batches that rank will see. Then it rebuilds the model under the layout, copies the
reference weights in (pipeline stages and expert-parallel ranks hold a slice of the layers and
experts; tensor-parallel shards are identical by construction, because `use_cpu_initialization`
draws each full weight and slices it), runs one step through `get_forward_backward_func()` and checks
  - the loss of every micro-batch equals the reference (rtol 1e-5) and agrees across TP ranks;
  - every gradient is finite;
  - where the run saw exactly the reference data (no data parallelism), every gradient that is not a
    tensor-parallel shard (norms, row-parallel biases, whole layers under PP, the tied embedding
    after `finalize_model_grads`) equals the reference gradient.
Every rank prints "[<layout>] rank <r>: checks passed" once all of them passed.
"""

import argparse
import re
import warnings

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

from thdpack.megatron.cpu import destroy_model_parallel_cpu, initialize_model_parallel_cpu

warnings.filterwarnings("ignore", module=r"megatron\.")  # "Apex is not installed", ... on every rank

SEED = 1234
VOCAB = 64
MOE = {"num_moe_experts": 4, "moe_router_topk": 2, "moe_aux_loss_coeff": 1e-2}

LAYOUTS = {
    # name: (parallel sizes, TransformerConfig overrides, sequence length of each micro-batch)
    "tp2": ({"tensor_model_parallel_size": 2}, {}, [16]),
    "tp2sp": ({"tensor_model_parallel_size": 2}, {"sequence_parallel": True}, [16]),
    # Two micro-batches of different lengths. megatron-core 0.16 refuses variable_seq_lengths with
    # the default (allgather) dispatcher even for a dense model; alltoall is inert without experts.
    "pp2": (
        {"pipeline_model_parallel_size": 2},
        {"variable_seq_lengths": True, "moe_token_dispatcher_type": "alltoall"},
        [8, 12],
    ),
    "ep2": ({"expert_model_parallel_size": 2}, {**MOE, "moe_token_dispatcher_type": "allgather"}, [16]),
    "ep2_alltoall": (
        {"expert_model_parallel_size": 2},
        {**MOE, "moe_token_dispatcher_type": "alltoall"},
        [16],
    ),
}


def build_model(overrides: dict) -> GPTModel:
    config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # Local SequentialMLP experts with biases fail in megatron-core itself (mlp.py
        # `output += output_bias ...` modifies a custom Function's output in place), GPU included.
        add_bias_linear="num_moe_experts" not in overrides,
        **overrides,
    )
    torch.manual_seed(SEED)
    return GPTModel(
        config,
        get_gpt_layer_local_spec(num_experts=config.num_moe_experts),
        vocab_size=VOCAB,
        max_sequence_length=32,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        position_embedding_type="rope",
    )


def micro_batches(seq_lens: list[int], data_rank: int) -> list[dict]:
    """Two samples per micro-batch, labels shifted by one; the data depends on the data rank."""
    gen = torch.Generator().manual_seed(100 + data_rank)
    batches = []
    for s in seq_lens:
        tokens = torch.randint(0, VOCAB, (2, s + 1), generator=gen)
        batches.append(
            {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "position_ids": torch.arange(s).expand(2, s)}
        )
    return batches


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

    def loss_func(per_token_loss):
        loss = per_token_loss.float().mean()
        # clone: the schedule divides the returned loss by num_microbatches in place
        return loss, {"loss": loss.detach().clone()}

    return output, loss_func


def reference_name(name: str, layer_offset: int, expert_offset: int, reference: dict) -> str:
    """Name of a parallel model's parameter (or state) in the single-rank model."""
    name = name.removeprefix("module.")
    name = re.sub(r"decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m[1]) + layer_offset}.", name)
    name = re.sub(r"local_experts\.(\d+)\.", lambda m: f"local_experts.{int(m[1]) + expert_offset}.", name)
    if name == "output_layer.weight" and name not in reference:  # last stage's copy of the tied embedding
        name = "embedding.word_embeddings.weight"
    return name


def check(layout: str) -> None:
    sizes, overrides, seq_lens = LAYOUTS[layout]

    # 1. reference: no model parallelism, every rank a data-parallel rank
    initialize_model_parallel_cpu(seed=SEED)
    rank = dist.get_rank()
    data_rank = rank if "expert_model_parallel_size" in sizes else 0  # EP ranks are DP ranks
    batches = micro_batches(seq_lens, data_rank)
    reference = build_model({k: v for k, v in overrides.items() if k != "sequence_parallel"})
    ref_losses = [forward_step(iter([b]), reference)[0].float().mean() for b in batches]
    (sum(ref_losses) / len(ref_losses)).backward()
    ref_losses = [loss.item() for loss in ref_losses]
    ref_weights = {
        k: v.detach().clone() if torch.is_tensor(v) else v for k, v in reference.state_dict().items()
    }
    ref_grads = {k: p.grad for k, p in reference.named_parameters()}
    ps.destroy_model_parallel()
    # a backward outside the schedules leaves a 0-d aux-loss scale that the schedules' [1]-shaped
    # copy_ then rejects (megatron-core class state, on GPU too)
    MoEAuxLossAutoScaler.main_loss_backward_scale = None

    # 2. the same model under the layout
    initialize_model_parallel_cpu(**sizes, seed=SEED)
    model = build_model(overrides)
    layer_offset = model.decoder.layers[0].layer_number - 1
    expert_offset = (
        getattr(model.decoder.layers[0].mlp, "num_local_experts", 0) * ps.get_expert_model_parallel_rank()
    )

    def to_ref(name: str) -> str:
        return reference_name(name, layer_offset, expert_offset, ref_weights)

    if ps.get_tensor_model_parallel_world_size() == 1:  # (TP shards already match, see the docstring)
        model.load_state_dict({k: ref_weights[to_ref(k)] for k in model.state_dict()})
    same_data = ps.get_data_parallel_world_size() == 1
    if same_data:  # exercise DDP grad buffers and finalize_model_grads (SP norms, tied embedding)
        model.config.finalize_model_grads_func = finalize_model_grads
        model = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)

    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(batches),
        model=[model],
        num_microbatches=len(batches),
        seq_length=max(seq_lens),
        micro_batch_size=2,
        forward_only=False,
    )

    compared = 0
    for name, p in model.named_parameters():
        grad = p.main_grad if hasattr(p, "main_grad") else p.grad
        assert grad is not None and torch.isfinite(grad).all(), f"rank {rank}: bad gradient for {name}"
        ref = ref_grads.get(to_ref(name))
        if same_data and ref is not None and ref.shape == grad.shape:
            torch.testing.assert_close(
                grad, ref, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"rank {rank} {n}: {m}"
            )
            compared += 1
    if ps.is_pipeline_last_stage():
        got = [d["loss"].item() for d in losses]
        print(
            f"[{layout}] rank {rank}: loss {got} reference {ref_losses}; {compared} gradients compared",
            flush=True,
        )
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        tp_losses = [None] * ps.get_tensor_model_parallel_world_size()
        dist.all_gather_object(tp_losses, got, group=ps.get_tensor_model_parallel_group())
        assert all(t == got for t in tp_losses), f"tensor-parallel ranks disagree: {tp_losses}"
    print(f"[{layout}] rank {rank}: checks passed", flush=True)
    ps.destroy_model_parallel()


def main(layouts: list[str]) -> None:
    for layout in layouts:
        check(layout)
    destroy_model_parallel_cpu()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", choices=sorted(LAYOUTS), nargs="+", required=True)
    main(parser.parse_args().layout)
