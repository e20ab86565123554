"""Sliding windows and attention sinks in thdpack's torch attention (thdpack.megatron.attention.window_sink):
packed rows compute what transformers' Gemma 3 / gpt-oss attention computes on each sample alone (its own
sliding-window mask, its own eager attention with sinks), under context parallelism too, and the padded
baseline does the same. The oracle is transformers' code: ``masking_utils.sliding_window_causal_mask_function``
and gpt-oss's ``eager_attention_forward``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from thdpack.megatron.attention.torch_attention import TorchTHDAttention, attend_bshd, attend_thd
from thdpack.megatron.attention.window_sink import causal_window_mask
from thdpack.packing.context_parallel import cp_partition_indices

D, HQ, HKV = 8, 4, 2
WINDOW = 3  # transformers' sliding_window: a query sees itself and the 2 keys before it
CU, CU_PADDED = [0, 5, 13, 14], [0, 8, 16, 20]  # real lengths 5, 8, 1, padded to multiples of 4 (cp=2)
SCALE = 0.3


def qkv(t, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(t, h, D, generator=g, dtype=dtype) for h in (HQ, HKV, HKV))


def sinks(seed=1):
    return torch.randn(HQ, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def transformers_mask(length: int, window: int | None) -> torch.Tensor:
    """transformers' additive mask [1, 1, L, L] of one sample: its causal or sliding-window mask function."""
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

    rule = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    q_idx, kv_idx = torch.arange(length)[:, None], torch.arange(length)[None, :]
    allowed = rule(torch.tensor(0), torch.tensor(0), q_idx, kv_idx)
    return torch.zeros(length, length, dtype=torch.float64).masked_fill(~allowed, float("-inf"))[None, None]


def transformers_sample(q, k, v, window, sink):
    """gpt-oss's eager attention on one sample alone ([L, H, D] in, [L, HQ, D] out); without ``sink`` its sink
    column is -inf (no sink: plain softmax)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    length = q.shape[0]
    sink = torch.full((HQ,), float("-inf"), dtype=q.dtype) if sink is None else sink
    module = SimpleNamespace(sinks=sink, num_key_value_groups=HQ // HKV, training=False)
    heads_first = (x.transpose(0, 1)[None] for x in (q, k, v))
    out, _ = eager_attention_forward(module, *heads_first, transformers_mask(length, window), scaling=SCALE)
    return out[0]


def transformers_packed(q, k, v, window, sink):
    """Each sample of the packed row through transformers alone; zeros on pad rows."""
    out = torch.zeros_like(q)
    for i in range(len(CU) - 1):
        s, n = CU_PADDED[i], CU[i + 1] - CU[i]
        out[s : s + n] = transformers_sample(q[s : s + n], k[s : s + n], v[s : s + n], window, sink)
    return out


def test_the_window_mask_is_transformers_sliding_window_as_megatrons_left_size():
    positions = torch.arange(6)
    assert torch.equal(
        causal_window_mask(positions, positions, WINDOW - 1),
        torch.isfinite(transformers_mask(6, WINDOW))[0, 0],
    )
    assert torch.equal(
        causal_window_mask(positions, positions, None), torch.ones(6, 6, dtype=torch.bool).tril()
    )


@pytest.mark.parametrize("backend", ["sdpa", "dense"])
@pytest.mark.parametrize(("window", "with_sinks"), [(WINDOW, False), (None, True), (WINDOW, True)])
def test_packed_rows_equal_transformers_on_each_sample_alone(backend, window, with_sinks):
    q, k, v = qkv(20)
    sink = sinks() if with_sinks else None
    out = attend_thd(
        q,
        k,
        v,
        torch.tensor(CU),
        torch.tensor(CU_PADDED),
        softmax_scale=SCALE,
        backend=backend,
        window=None if window is None else window - 1,
        sinks=sink,
    )
    torch.testing.assert_close(out, transformers_packed(q, k, v, window, sink))


def test_the_window_bites_in_these_samples():
    q, k, v = qkv(20)
    windowed = transformers_packed(q, k, v, WINDOW, None)
    assert not torch.allclose(windowed, transformers_packed(q, k, v, None, None))


@pytest.mark.parametrize("backend", ["sdpa", "dense"])
def test_context_parallel_ranks_hold_their_slices_of_the_windowed_attention_with_sinks(backend):
    q, k, v = (x.requires_grad_() for x in qkv(20))
    sink = sinks().requires_grad_()
    cu, cup = torch.tensor(CU), torch.tensor(CU_PADDED)
    full = attend_thd(q, k, v, cu, cup, softmax_scale=SCALE, window=WINDOW - 1, sinks=sink)
    grad_out = torch.randn_like(full)
    (full * grad_out).sum().backward()
    idx = [cp_partition_indices(cup, 2, r) for r in range(2)]
    local = [[x[i].detach().clone().requires_grad_() for x in (q, k, v)] for i in idx]
    rank_sinks = [sink.detach().clone().requires_grad_() for _ in range(2)]

    def gather_for(rank):
        return lambda kv: torch.cat([kv if r == rank else torch.stack(local[r][1:], 1) for r in range(2)])

    for r in range(2):
        out = attend_thd(
            *local[r],
            cu,
            cup,
            softmax_scale=SCALE,
            cp_size=2,
            cp_rank=r,
            kv_gather=gather_for(r),
            backend=backend,
            window=WINDOW - 1,
            sinks=rank_sinks[r],
        )
        torch.testing.assert_close(out, full[idx[r]])
        (out * grad_out[idx[r]]).sum().backward()
    torch.testing.assert_close(
        rank_sinks[0].grad + rank_sinks[1].grad, sink.grad
    )  # summed by the DP x CP grads
    for r in range(2):
        torch.testing.assert_close(local[r][0].grad, q.grad[idx[r]])


def test_the_varlen_kernels_refuse_sinks_they_cannot_compute():
    q, k, v = qkv(20)
    with pytest.raises(ValueError, match="backend='varlen' has no attention sinks"):
        attend_thd(q, k, v, CU, CU_PADDED, backend="varlen", sinks=sinks())


def test_the_padded_baseline_equals_transformers_on_each_row():
    lengths = (5, 8)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(8, 2, HQ, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(8, 2, HKV, D, generator=g, dtype=torch.float64) for _ in range(2))
    pad = torch.arange(8)[None, :] >= torch.tensor(lengths)[:, None]  # right padding, True = pad
    sink = sinks()
    out = attend_bshd(
        q, k, v, pad[:, None, None, :], softmax_scale=SCALE, window=WINDOW - 1, sinks=sink
    ).reshape(8, 2, HQ, D)
    for b, n in enumerate(lengths):
        alone = transformers_sample(q[:n, b], k[:n, b], v[:n, b], WINDOW, sink)
        torch.testing.assert_close(out[:n, b], alone)


# ----------------------------------------------------------------------------- Megatron module


def attention(layer_number, **kwargs):
    config = TransformerConfig(
        num_layers=2,
        hidden_size=HQ * D,
        num_attention_heads=HQ,
        num_query_groups=HKV,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        params_dtype=torch.float64,
        **kwargs,
    )
    return TorchTHDAttention(config, layer_number, AttnMaskType.causal, "self", softmax_scale=SCALE).double()


def test_the_module_windows_the_layers_window_attn_skip_freq_marks():
    window = {"window_size": (WINDOW - 1, 0), "window_attn_skip_freq": [1, 0]}
    assert attention(1, **window).window == WINDOW - 1
    assert attention(2, **window).window is None


def test_the_modules_learnable_sinks_are_one_per_head_named_as_megatrons_and_tes():
    module = attention(1, softmax_type="learnable")
    assert list(dict(module.named_parameters())) == ["softmax_offset"]
    assert module.softmax_offset.shape == (HQ,) and module.softmax_offset.tensor_model_parallel
    with torch.no_grad():
        module.softmax_offset.copy_(sinks())
    q, k, v = qkv(20)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=torch.tensor(CU, dtype=torch.int32),
        cu_seqlens_kv=torch.tensor(CU, dtype=torch.int32),
        cu_seqlens_q_padded=torch.tensor(CU_PADDED, dtype=torch.int32),
        cu_seqlens_kv_padded=torch.tensor(CU_PADDED, dtype=torch.int32),
        max_seqlen_q=8,
        max_seqlen_kv=8,
    )
    out = module(q, k, v, None, packed_seq_params=params)
    torch.testing.assert_close(out, transformers_packed(q, k, v, None, sinks()).reshape(20, -1))


def test_off_by_one_is_a_sink_of_zero():
    q, k, v = qkv(20)
    out = attention(1, softmax_type="off-by-one").eval()(
        q[None].transpose(0, 1), k[None].transpose(0, 1), v[None].transpose(0, 1), None
    )
    expected = attend_bshd(q[:, None], k[:, None], v[:, None], softmax_scale=SCALE, sinks=torch.zeros(HQ))
    torch.testing.assert_close(out, expected)
