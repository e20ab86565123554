"""Imported Hugging Face checkpoints under model parallelism compute what transformers computes.

Run by tests/functional/test_hf_parallel.py as
`torchrun --nproc_per_node=2 hf_parity.py --models DIR --layouts tp2,tp2sp,pp2,cp2,ep2 [--families a,b]`, DIR
holding one saved model per family of tests/hf_models.py. For each layout (Megatron's parallel state rebuilt in the same processes)
and each family (every family under TP/SP/PP/CP, the MoE families under EP too), every rank builds its chunk of
thdpack's model, loads its slices of the checkpoint (thdpack.hf.load) and runs one packed micro-batch of four
samples through Megatron's schedule (forward only):
  - the logits (gathered over tensor and context parallelism; last pipeline stage) equal transformers' logits of
    each sample alone, max abs difference <= 1e-4; padded vocabulary rows (llama2: 301 ids, 302 rows under TP2)
    are -inf;
  - the per-token loss of thdpack's own forward step equals transformers' loss on the padded batch (rel 1e-6);
  - Qwen3.5 (NO_CP families: refused under CP, checked under the other layouts): logits within 1e-5, and under
    TP2, TP2+SP and PP2 the gradients of its gated DeltaNet layer (each rank's slices put together) equal
    transformers' (rel 1e-5 of the largest), its output norm's summed over the TP ranks.
Prints one line per layout and family with the measured differences.
"""

import argparse
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository: tests.hf_models
warnings.filterwarnings("ignore")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402

from tests.hf_models import (  # noqa: E402
    DENSE,
    MOE,
    NO_CP,
    build,
    hf_logits_per_sample,
    hf_loss,
    megatron_model,
    padded_batch,
    run_schedule,
    whole_logits,
)
from thdpack.megatron.batch import BatchConfig, get_batch  # noqa: E402
from thdpack.megatron.cpu import initialize_model_parallel_cpu  # noqa: E402
from thdpack.megatron.loss import LM_LOSS  # noqa: E402
from thdpack.megatron.step import make_forward_step  # noqa: E402

# Not under tensor parallelism: Gemma 3 1B's single key/value head (Megatron splits whole query groups), gpt-oss's
# expert biases (megatron-core takes them with expert tensor parallelism 1 only; thdpack's is TP's). Both refused at
# start-up (tests/unit/test_gemma3.py, test_gpt_oss.py).
TP_FAMILIES = [f for f in DENSE + MOE if f not in ("gemma3_1b", "gpt_oss")]
LAYOUTS = {
    # name: (parallel sizes, sequence parallel, families)
    "tp2": ({"tensor_model_parallel_size": 2}, False, TP_FAMILIES),
    "tp2sp": ({"tensor_model_parallel_size": 2}, True, TP_FAMILIES),
    "pp2": ({"pipeline_model_parallel_size": 2}, False, DENSE + MOE),
    "cp2": ({"context_parallel_size": 2}, False, [f for f in DENSE + MOE if f not in NO_CP]),
    "ep2": ({"expert_model_parallel_size": 2}, False, MOE),
}
SEQ = 64


def schedule(model, batch, forward_step):
    return run_schedule(model, batch, forward_step, SEQ, forward_only=True)


def packed_logits(model, batch):
    """The last stage's logits [1, T, V_model] (gathered over TP) and the samples' starts; None elsewhere."""
    captured = {}

    def forward_step(data_iterator, model):
        inputs = get_batch(data_iterator, model.config, BatchConfig())
        output = model(
            inputs.tokens,
            inputs.position_ids,
            None,
            packed_seq_params=inputs.packed_seq_params,
            padding_mask=inputs.padding_mask,
        )
        captured["starts"] = inputs.packed_seq_params.cu_seqlens_q_padded.tolist()

        def keep(output):
            captured["logits"] = output.detach()
            zero = output.sum() * 0
            return zero, torch.ones((), dtype=torch.int), {}

        return output, keep

    with torch.no_grad():
        schedule(model, batch, forward_step)
    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        return None, None
    return whole_logits(captured["logits"], captured["starts"]), captured["starts"]


def check(layout: str, family: str, directory: Path, sequence_parallel: bool) -> None:
    hf = build(family)
    vocab = hf.config.vocab_size
    batch = padded_batch(vocab, seed=dist.get_rank() if ps.get_data_parallel_world_size() > 1 else 0)
    model = megatron_model(directory / family, seq_length=SEQ, sequence_parallel=sequence_parallel)
    logits, starts = packed_logits(model, batch)
    with torch.no_grad():
        reports = schedule(model, batch, make_forward_step(BatchConfig()))
    if family in NO_CP and layout in ("tp2", "tp2sp", "pp2"):  # every stage takes part
        check_delta_net_gradients(layout, family, model, hf, batch)
    if logits is None:
        return
    worst = max(
        float((logits[0, starts[i] : starts[i] + len(ref), :vocab] - ref).abs().max())
        for i, ref in enumerate(hf_logits_per_sample(hf, batch))
    )
    assert torch.isneginf(logits[..., vocab:]).all(), f"{layout} {family}: a padded vocabulary row was finite"
    loss = float(LM_LOSS.reduce(reports)) if ps.get_data_parallel_world_size() == 1 else None
    want = hf_loss(hf, batch)
    if loss is None:  # data-parallel ranks (EP) saw different batches: this rank's own loss
        total = torch.stack([r[LM_LOSS.key] for r in reports]).sum(0)
        loss = float(total[0] / total[1])
    print(
        f"[{layout}] rank {dist.get_rank()} {family}: max|logit diff| {worst:.3g}, loss {loss:.6f} "
        f"transformers {want:.6f} (diff {loss - want:.3g}), model vocab {logits.shape[-1]}",
        flush=True,
    )
    limit = 1e-5 if family in NO_CP else 1e-4
    assert worst <= limit, f"{layout} {family}: logits differ by {worst}"
    assert abs(loss - want) <= 1e-6 * abs(want), f"{layout} {family}: loss {loss} vs transformers {want}"


def check_delta_net_gradients(layout, family, model, hf, batch):
    """The gradients of the gated DeltaNet layer's tensors on this rank's stage, each put together from the TP
    ranks' slices, against transformers' on the padded batch (its mean loss times the target count: thdpack's
    step gives the gradient of the loss sum)."""
    from thdpack.hf.mapping import Dims, Shard, match_name, to_megatron
    from thdpack.models.qwen3_5 import LINEAR_ATTENTION

    get_forward_backward_func()(  # a plain GPTModel, fresh: its gradients land in .grad
        forward_step_func=make_forward_step(BatchConfig()),
        data_iterator=iter([batch]),
        model=[model],
        num_microbatches=1,
        seq_length=SEQ,
        micro_batch_size=1,
        forward_only=False,
    )
    hf.zero_grad()
    labels = batch["tokens"].masked_fill(batch["attention_mask"] == 0, -100)
    hf(batch["tokens"], attention_mask=batch["attention_mask"], labels=labels).loss.backward()
    count = int((batch["attention_mask"].sum(1) - 1).sum())
    hf_grads = {n: p.grad * count for n, p in hf.named_parameters()}
    dims = Dims.of(model.config, hf.config.vocab_size)
    offset = model.decoder.layers[0].layer_number - 1 if len(model.decoder.layers) else 0
    tp = ps.get_tensor_model_parallel_world_size()
    worst, checked = 0.0, 0
    for name, param in model.named_parameters():
        m = match_name(name, LINEAR_ATTENTION, layer_offset=offset)
        if m is None:
            continue
        grad = param.grad
        if getattr(param, "tensor_model_parallel", False) and tp > 1:
            parts = [torch.empty_like(grad) for _ in range(tp)]
            dist.all_gather(parts, grad.contiguous(), group=ps.get_tensor_model_parallel_group())
            grad = torch.cat(parts, dim=param.partition_dim)
        sources = [hf_grads[n] for n in m.hf_names]

        def read(i, rows, cols, sources=sources):
            return sources[i][rows] if sources[i].dim() == 1 else sources[i][rows, cols]

        want = to_megatron(m.rule.kind, read, grad.shape, Shard(), dims)
        difference = float((grad - want).abs().max() / want.abs().max())
        assert difference <= 1e-5, f"{layout} {family}: gradient of {name} differs by {difference} (relative)"
        worst, checked = max(worst, difference), checked + 1
    assert checked == (6 if ps.is_pipeline_first_stage() else 0), (
        f"{layout} {family}: {checked} tensors checked"
    )
    print(
        f"[{layout}] rank {dist.get_rank()} {family}: gated DeltaNet gradients of {checked} tensors, max relative "
        f"diff {worst:.3g}",
        flush=True,
    )


def main(models: Path, layouts: list[str], only: list[str] | None = None) -> None:
    for layout in layouts:
        sizes, sequence_parallel, families = LAYOUTS[layout]
        initialize_model_parallel_cpu(**sizes, seed=1234)
        for family in [f for f in families if only is None or f in only]:
            check(layout, family, models, sequence_parallel)
        print(f"[{layout}] rank {dist.get_rank()}: all families match", flush=True)
        ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", type=Path, required=True)
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--families", default=None, help="comma-separated subset (default: every family)")
    args = parser.parse_args()
    main(args.models, args.layouts.split(","), args.families.split(",") if args.families else None)
