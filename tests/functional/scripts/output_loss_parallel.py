"""The chunked output loss under tensor parallelism equals megatron-core's output layer and loss.

Run by tests/functional/test_output_loss_parallel.py as `torchrun --nproc_per_node=2 output_loss_parallel.py`:
TP=2 with and without sequence parallelism, tied and untied embeddings (four cases in one launch).

For each case every rank builds the same seeded GPT twice under the layout (``use_cpu_initialization`` draws each full weight
and slices it, so the shards are identical), once as megatron-core builds it and once with
``thdpack.megatron.output_loss.use_output_loss(model, "chunked")``, runs one micro-batch with labels and a loss mask
(a prompt, pad without a target, and a row whose every token is masked on purpose) through thdpack's loss (``thdpack.megatron.loss.LM_LOSS``)
and backward, and checks on every rank that the per-token losses of the counted tokens, the summed loss, the
count and every parameter's gradient (this rank's shard) agree.
"""

import warnings
from types import SimpleNamespace

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig

from thdpack.megatron.cpu import destroy_model_parallel_cpu, initialize_model_parallel_cpu
from thdpack.megatron.loss import LM_LOSS
from thdpack.megatron.models import build_gpt_model
from thdpack.megatron.output_loss import use_output_loss

warnings.filterwarnings("ignore", module=r"megatron\.")

SEED = 1234
VOCAB = 64
CASES = [(sp, tied) for sp in (False, True) for tied in (False, True)]


def build(sequence_parallel: bool, tied: bool, fused: bool) -> GPTModel:
    config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        tensor_model_parallel_size=2,
        sequence_parallel=sequence_parallel,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        calculate_per_token_loss=True,
    )
    torch.manual_seed(SEED)
    model = build_gpt_model(config, VOCAB, 32, backend="torch", share_embeddings_and_output_weights=tied)
    if fused:
        use_output_loss(model, "chunked", chunk_tokens=7)
    return model


def main() -> None:
    initialize_model_parallel_cpu(tensor_model_parallel_size=2, seed=SEED)
    for sequence_parallel, tied in CASES:
        check(sequence_parallel, tied)
    destroy_model_parallel_cpu()


def check(sequence_parallel: bool, tied: bool) -> None:
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (2, 17), generator=gen)
    inputs, labels = tokens[:, :-1], tokens[:, 1:].clone()
    labels[1, 10:] = -100  # pad
    mask = (labels >= 0).float()
    mask[0, :4] = 0.0  # a prompt
    positions = torch.arange(16).expand(2, 16)
    results = []
    for fused in (False, True):
        model = build(sequence_parallel, tied, fused)
        output = model(inputs, positions, None, labels=labels, loss_mask=mask)
        loss_sum, count, _ = LM_LOSS(SimpleNamespace(loss_mask=mask), output)
        loss_sum.backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        results.append((output.detach(), loss_sum.detach(), int(count), grads))
    (want, want_sum, want_count, want_grads), (got, got_sum, got_count, got_grads) = results
    counted = mask > 0
    torch.testing.assert_close(got[counted], want[counted], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_sum, want_sum, rtol=1e-6, atol=1e-6)
    assert got_count == want_count, (got_count, want_count)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(
            got_grads[name], grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"rank {rank} {n}: {m}"
        )
    case = f"tp2{'sp' if sequence_parallel else ''} {'tied' if tied else 'untied'}"
    print(
        f"[{case}] rank {rank} tp_rank {ps.get_tensor_model_parallel_rank()}: "
        f"loss sum {got_sum.item():.6f} = {want_sum.item():.6f}, {len(want_grads)} gradients equal",
        flush=True,
    )


if __name__ == "__main__":
    main()
