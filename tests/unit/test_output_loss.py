"""thdpack.megatron.output_loss: the output layer and the cross entropy chunk by chunk, against the full logits
(torch's cross entropy on small fp32 tensors) and against megatron-core's own output layer and loss on a GPT model
(CPU, one process; tensor parallelism: tests/functional/test_output_loss_parallel.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from thdpack.megatron.output_loss import check_output_loss, linear_cross_entropy, resolve_output_loss

N, H, V = 10, 8, 24


def _inputs(seed: int = 0):
    torch.manual_seed(seed)
    hidden = torch.randn(N, H, requires_grad=True)
    weight = torch.randn(V, H, requires_grad=True)
    labels = torch.randint(0, V, (N,))
    labels[3] = -100  # no target
    mask = torch.tensor([1, 1, 0, 1, 1, 0.5, 1, 1, 0, 1])
    return hidden, weight, labels, mask


def _reference(hidden, weight, labels, mask):
    """The full logits' cross entropy weighted by the mask (0 where there is no target)."""
    losses = F.cross_entropy(hidden @ weight.t(), labels.clamp(min=0), reduction="none")
    counted = (labels >= 0) & (mask != 0)
    return torch.where(counted, losses, 0.0), torch.where(counted, mask, 0.0)


@pytest.mark.parametrize("chunk_tokens", [N, 3, 1])
def test_losses_and_gradients_equal_the_full_logits(chunk_tokens):
    hidden, weight, labels, mask = _inputs()
    losses = linear_cross_entropy(hidden, weight, labels, mask, chunk_tokens=chunk_tokens)
    (losses * mask).sum().backward()
    got = (losses.detach(), hidden.grad, weight.grad)

    hidden.grad = weight.grad = None
    reference, weights = _reference(hidden, weight, labels, mask)
    (reference * weights).sum().backward()
    torch.testing.assert_close(got[0], reference.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[1], hidden.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[2], weight.grad, rtol=1e-5, atol=1e-6)


def test_tokens_that_do_not_count_get_zero_loss_and_no_gradient():
    hidden, weight, labels, mask = _inputs()
    losses = linear_cross_entropy(hidden, weight, labels, mask)
    assert losses[[2, 3, 8]].tolist() == [0.0, 0.0, 0.0]  # mask 0, no target, mask 0
    (losses * mask).sum().backward()
    assert hidden.grad[[2, 3, 8]].abs().sum() == 0


def test_a_rank_with_no_counted_token_gets_zero_loss_and_zero_gradients():
    hidden, weight, labels, _ = _inputs()
    with torch.no_grad():
        hidden[0] = float("inf")  # what pad may hold: still no NaN
    mask = torch.zeros(N)
    losses = linear_cross_entropy(hidden, weight, labels, mask)
    (losses * mask).sum().backward()
    assert losses.abs().sum() == 0
    assert hidden.grad.abs().sum() == 0 and weight.grad.abs().sum() == 0


def test_the_gradient_follows_the_loss_scale():
    hidden, weight, labels, mask = _inputs()
    linear_cross_entropy(hidden, weight, labels, mask).mul(mask).sum().backward()
    once = (hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None
    (linear_cross_entropy(hidden, weight, labels, mask).mul(mask).sum() * 2.5).backward()
    torch.testing.assert_close(hidden.grad, 2.5 * once[0])
    torch.testing.assert_close(weight.grad, 2.5 * once[1])


def test_a_per_token_gradient_not_proportional_to_the_mask_is_refused():
    hidden, weight, labels, mask = _inputs()
    losses = linear_cross_entropy(hidden, weight, labels, mask)
    with pytest.raises(RuntimeError, match="not proportional to the loss-mask weights"):
        (losses * torch.arange(N)).sum().backward()


def test_without_weights_every_token_with_a_target_counts_once():
    hidden, weight, labels, _ = _inputs()
    losses = linear_cross_entropy(hidden, weight, labels)
    reference, _ = _reference(hidden, weight, labels, torch.ones(N))
    torch.testing.assert_close(losses, reference, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("dtype", "rtol", "scale"),
    # fp32: 1e-6 relative, and 1e-6 of the largest gradient where a gradient is a sum that nearly cancels (its
    # error follows its terms, not itself). bf16: the logits are the same bf16 values in both and the losses fp32
    # statistics of them (1e-6 still); both round the logits' gradient to bf16 before the matrix products, whose
    # results are bf16 (on CPU also each chunk's weight-gradient product): a bf16 rounding apart, 2^-8 of the
    # largest gradient, with torch's bf16 rtol.
    [(torch.float32, 1e-6, 1e-6), (torch.bfloat16, 1.6e-2, 2**-8)],
    ids=["fp32", "bf16"],
)
def test_the_one_pass_softmax_statistics_equal_torchs_cross_entropy(dtype, rtol, scale):
    torch.manual_seed(2)
    n, h, v = 37, 16, 1000
    hidden = (torch.randn(n, h) * 2).to(dtype).requires_grad_()
    weight = torch.randn(v, h).to(dtype).requires_grad_()  # logits spread over tens: the row max matters
    labels = torch.randint(0, v, (n,))
    losses = linear_cross_entropy(hidden, weight, labels, chunk_tokens=8)
    losses.sum().backward()
    got = (losses.detach(), hidden.grad.float(), weight.grad.float())

    hidden.grad = weight.grad = None
    reference = F.cross_entropy((hidden @ weight.t()).float(), labels, reduction="none")
    reference.sum().backward()
    torch.testing.assert_close(got[0], reference.detach(), rtol=1e-6, atol=0)
    for ours, want in zip(got[1:], (hidden.grad.float(), weight.grad.float()), strict=True):
        torch.testing.assert_close(ours, want, rtol=rtol, atol=scale * want.abs().max().item())


# --- tensor parallelism: two ranks (gloo) against one --------------------------------------------------------

TP, TP_VOCAB = 2, 24  # 12 rows of the output layer a rank
# no padding; the last rank's rows half padding; all padding (its logits all -inf)
TP_LIMITS = [None, 18, 12]


def _tp_inputs(limit):
    torch.manual_seed(3)
    hidden = torch.randn(N, H) * 2
    weight = torch.randn(TP_VOCAB, H)
    labels = torch.randint(0, limit or TP_VOCAB, (N,))
    labels[3] = -100
    mask = torch.tensor([1, 1, 0, 1, 1, 0.5, 1, 1, 0, 1])
    return hidden, weight, labels, mask


def _run(hidden, weight, labels, mask, limit, tp_group=None):
    hidden = hidden.clone().requires_grad_()
    weight = weight.clone().requires_grad_()
    losses = linear_cross_entropy(
        hidden, weight, labels, mask, tp_group=tp_group, chunk_tokens=3, vocab_limit=limit
    )
    (losses * mask).sum().backward()
    return losses.detach(), hidden.grad, weight.grad


def _tp_rank(rank, store, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=TP)
    try:
        rows = slice(rank * TP_VOCAB // TP, (rank + 1) * TP_VOCAB // TP)
        results = {}
        for limit in TP_LIMITS:
            hidden, weight, labels, mask = _tp_inputs(limit)
            losses, grad_hidden, grad_weight = _run(
                hidden, weight[rows], labels, mask, limit, dist.group.WORLD
            )
            # the hidden states' gradient is a sum over the whole vocabulary: Megatron all-reduces it
            dist.all_reduce(grad_hidden)
            results[limit] = (losses, grad_hidden, grad_weight)
        torch.save(results, out / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp2_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp2")
    mp.spawn(_tp_rank, args=(out / "store", out), nprocs=TP)
    return [torch.load(out / f"rank{rank}.pt") for rank in range(TP)]


@pytest.mark.parametrize("limit", TP_LIMITS, ids=["unpadded", "half_padded_rank", "all_padded_rank"])
def test_tp2_equals_tp1_with_and_without_padded_vocabulary(tp2_results, limit):
    hidden, weight, labels, mask = _tp_inputs(limit)
    want = _run(hidden, weight, labels, mask, limit)
    reference, _ = _reference(hidden, weight[: limit or TP_VOCAB], labels, mask)
    torch.testing.assert_close(want[0], reference, rtol=1e-6, atol=1e-6)
    for rank, results in enumerate(tp2_results):
        losses, grad_hidden, grad_weight = results[limit]
        assert losses.isfinite().all() and grad_hidden.isfinite().all() and grad_weight.isfinite().all()
        torch.testing.assert_close(losses, want[0], rtol=1e-6, atol=1e-6, msg=f"rank {rank}")
        torch.testing.assert_close(grad_hidden, want[1], rtol=1e-5, atol=1e-6, msg=f"rank {rank}")
    torch.testing.assert_close(torch.cat([r[limit][2] for r in tp2_results]), want[2], rtol=1e-5, atol=1e-6)
    if limit is not None:
        assert want[2][limit:].abs().sum() == 0  # padded rows: never predicted, no gradient


def test_auto_is_chunked_on_cuda_and_megatron_on_cpu():
    assert resolve_output_loss({}, "cuda") == "chunked"
    assert resolve_output_loss({"output_loss": "auto"}, "cpu") == "megatron"
    assert resolve_output_loss({"output_loss": "liger"}, "cuda") == "liger"


@pytest.mark.parametrize(
    ("model", "tp", "device", "message"),
    [
        ({"output_loss": "fused"}, 1, "cuda", "model.output_loss is 'fused': it must be auto or one of"),
        ({"output_loss": "liger"}, 2, "cuda", "liger runs without tensor parallelism only"),
        ({"output_loss": "liger"}, 1, "cpu", "liger needs a CUDA GPU"),
    ],
)
def test_start_up_check_names_the_key(model, tp, device, message):
    with pytest.raises(ValueError, match=message):
        check_output_loss(model, {"tensor_model_parallel_size": tp}, device)


# --- on a megatron-core GPTModel -----------------------------------------------------------------------------


def _gpt(tied: bool, fused: bool):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from thdpack.megatron.output_loss import use_output_loss

    config = TransformerConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        calculate_per_token_loss=True,
    )
    torch.manual_seed(0)
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(),
        vocab_size=64,
        max_sequence_length=16,
        share_embeddings_and_output_weights=tied,
    )
    if fused:
        use_output_loss(model, "chunked", chunk_tokens=5)
    return model


@pytest.mark.usefixtures("one_rank_megatron")
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_gpt_loss_and_gradients_equal_megatrons_output_layer_and_loss(tied):
    from thdpack.megatron.loss import LM_LOSS

    torch.manual_seed(1)
    tokens = torch.randint(0, 64, (2, 16))
    labels = torch.roll(tokens, -1, dims=1)
    labels[1, 12:] = -100
    mask = (labels >= 0).float()
    mask[0, :3] = 0.0  # a prompt
    positions = torch.arange(16).expand(2, 16)
    results = []
    for fused in (False, True):
        model = _gpt(tied, fused)
        output = model(tokens, positions, None, labels=labels, loss_mask=mask)
        loss_sum, count, _ = LM_LOSS(SimpleNamespace(loss_mask=mask), output)
        loss_sum.backward()
        results.append(
            (output.detach(), loss_sum.detach(), count, {n: p.grad for n, p in model.named_parameters()})
        )
    (megatron, megatron_sum, megatron_count, megatron_grads), (ours, our_sum, our_count, our_grads) = results
    assert ours.shape == megatron.shape == (2, 16)
    torch.testing.assert_close(ours[mask > 0], megatron[mask > 0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(our_sum, megatron_sum, rtol=1e-6, atol=1e-6)
    assert our_count == megatron_count
    assert our_grads.keys() == megatron_grads.keys()
    for name, grad in megatron_grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.usefixtures("one_rank_megatron")
def test_gpt_without_labels_returns_megatrons_logits():
    model = _gpt(tied=False, fused=True)
    tokens = torch.randint(0, 64, (1, 8))
    logits = model(tokens, torch.arange(8)[None], None)
    assert logits.shape == (1, 8, 64)
