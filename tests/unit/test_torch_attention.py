"""TorchTHDAttention / attend_thd: packed causal attention equals per-sample attention."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from thdpack.megatron.attention import get_core_attention
from thdpack.megatron.attention.torch_attention import (
    TorchTHDAttention,
    attend_bshd,
    attend_thd,
)
from thdpack.packing.context_parallel import cp_partition_indices

DTYPE = torch.float64
D = 8

# docs/design.md's TE example ("logical vs physical boundaries"): [a a a 1 b b 2 2 c c c c 3]
CU = [0, 3, 5, 9]
CU_PADDED = [0, 4, 8, 13]
PAD_ROWS = [3, 6, 7, 12]


def qkv(t, hq=4, hkv=2, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(t, h, D, generator=g, dtype=DTYPE) for h in (hq, hkv, hkv))
    return tuple(x.requires_grad_(grad) for x in (q, k, v))


def naive_causal(q, k, v):
    """Textbook causal attention of one sample, [L, Hq, D] x [L, Hkv, D] -> [L, Hq, D]."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    future = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).triu(1)
    probs = scores.masked_fill(future, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def reference(q, k, v, cu, cu_padded):
    """Each sample alone, unpadded, causal; zeros on pad rows."""
    out = torch.zeros_like(q)
    for i in range(len(cu) - 1):
        s, n = cu_padded[i], cu[i + 1] - cu[i]
        out[s : s + n] = naive_causal(q[s : s + n], k[s : s + n], v[s : s + n])
    return out


def real_rows(cu, cu_padded):
    return [cu_padded[i] + j for i in range(len(cu) - 1) for j in range(cu[i + 1] - cu[i])]


# ----------------------------------------------------------------------------- THD, cp=1


def test_thd_distinct_pad_real_rows_match_per_sample_causal():
    q, k, v = qkv(13)
    out = attend_thd(q, k, v, torch.tensor(CU), torch.tensor(CU_PADDED))
    rows = real_rows(CU, CU_PADDED)
    torch.testing.assert_close(out[rows], reference(q, k, v, CU, CU_PADDED)[rows])


def test_thd_pad_rows_are_exactly_zero():
    q, k, v = qkv(13)
    out = attend_thd(q, k, v, torch.tensor(CU), torch.tensor(CU_PADDED))
    assert torch.equal(out[PAD_ROWS], torch.zeros_like(out[PAD_ROWS]))


def test_thd_fold_mode_treats_every_segment_row_as_a_token():
    q, k, v = qkv(13)
    cu = torch.tensor(CU_PADDED)  # the same object twice = pad folded into its sample
    out = attend_thd(q, k, v, cu, cu)
    torch.testing.assert_close(out, reference(q, k, v, CU_PADDED, CU_PADDED))
    assert out[PAD_ROWS].abs().sum() > 0


def test_thd_without_padded_array_uses_logical_boundaries():
    q, k, v = qkv(9)
    out = attend_thd(q, k, v, torch.tensor(CU), None)
    torch.testing.assert_close(out, reference(q, k, v, CU, CU))


def test_thd_rows_past_the_last_boundary_are_zero():
    q, k, v = qkv(11)
    out = attend_thd(q, k, v, torch.tensor(CU), None)
    torch.testing.assert_close(out[:9], reference(q, k, v, CU, CU)[:9])
    assert torch.equal(out[9:], torch.zeros_like(out[9:]))


def test_thd_accepts_host_boundaries():
    q, k, v = qkv(13)
    out = attend_thd(q, k, v, CU, CU_PADDED)
    torch.testing.assert_close(out, attend_thd(q, k, v, torch.tensor(CU), torch.tensor(CU_PADDED)))


def test_thd_gqa_matches_explicit_head_expansion():
    q, k, v = qkv(13, hq=4, hkv=2)
    cu, cup = torch.tensor(CU), torch.tensor(CU_PADDED)
    expanded = attend_thd(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), cu, cup)
    torch.testing.assert_close(attend_thd(q, k, v, cu, cup), expanded)


def test_thd_softmax_scale_is_used():
    q, k, v = qkv(9)
    cu = torch.tensor(CU)
    torch.testing.assert_close(
        attend_thd(q, k, v, cu, softmax_scale=0.5 / math.sqrt(D)), attend_thd(q * 0.5, k, v, cu)
    )


def test_thd_grads_match_per_sample_reference():
    q, k, v = qkv(13, grad=True)
    g = torch.randn(13, 4, D, dtype=DTYPE, generator=torch.Generator().manual_seed(1))
    (attend_thd(q, k, v, torch.tensor(CU), torch.tensor(CU_PADDED)) * g).sum().backward()
    got = [x.grad for x in (q, k, v)]
    q2, k2, v2 = (x.detach().clone().requires_grad_() for x in (q, k, v))
    (reference(q2, k2, v2, CU, CU_PADDED) * g).sum().backward()
    for a, b in zip(got, (q2.grad, k2.grad, v2.grad), strict=False):
        torch.testing.assert_close(a, b)
    assert torch.equal(q.grad[PAD_ROWS], torch.zeros_like(q.grad[PAD_ROWS]))


def test_dense_backend_matches_per_sample_backend():
    q, k, v = qkv(13)
    cu, cup = torch.tensor(CU), torch.tensor(CU_PADDED)
    torch.testing.assert_close(
        attend_thd(q, k, v, cu, cup, backend="dense"), attend_thd(q, k, v, cu, cup, backend="sdpa")
    )


def test_sample_longer_than_its_padded_segment_is_rejected():
    q, k, v = qkv(8)
    with pytest.raises(ValueError, match="sample 0 has 5 real tokens in a physical segment of 4"):
        attend_thd(q, k, v, torch.tensor([0, 5, 8]), torch.tensor([0, 4, 8]))


@settings(max_examples=15, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 3)), min_size=1, max_size=5))
def test_thd_equals_per_sample_attention_for_any_layout(samples):
    """samples: (real length, pad after it) per sample."""
    cu, cup = [0], [0]
    for n, pad in samples:
        cu.append(cu[-1] + n)
        cup.append(cup[-1] + n + pad)
    q, k, v = qkv(max(cup[-1], 1), seed=len(samples))
    out = attend_thd(q, k, v, torch.tensor(cu), torch.tensor(cup))
    torch.testing.assert_close(out, reference(q, k, v, cu, cup))


# ----------------------------------------------------------------------------- BSHD


def test_bshd_matches_causal_attention_per_row():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(6, 2, 4, D, dtype=DTYPE, generator=g)
    k, v = (torch.randn(6, 2, 2, D, dtype=DTYPE, generator=g) for _ in range(2))
    out = attend_bshd(q, k, v)
    assert out.shape == (6, 2, 4 * D)
    for b in range(2):
        torch.testing.assert_close(out[:, b], naive_causal(q[:, b], k[:, b], v[:, b]).reshape(6, -1))


def test_bshd_attention_mask_true_means_masked_out():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(5, 1, 2, D, dtype=DTYPE, generator=g) for _ in range(3))
    keep = 3  # right padding: keys 3, 4 are pad
    mask = torch.zeros(1, 1, 5, 5, dtype=torch.bool)
    mask[..., keep:] = True
    out = attend_bshd(q, k, v, mask)
    torch.testing.assert_close(
        out[:keep, 0], naive_causal(q[:keep, 0], k[:keep, 0], v[:keep, 0]).reshape(keep, -1)
    )
    assert torch.isfinite(out).all()


# ----------------------------------------------------------------------------- context parallel

# real lengths 5, 8, 1 -> padded to multiples of 2*cp=4
CP_CU = [0, 5, 13, 14]
CP_CU_PADDED = [0, 8, 16, 20]


def _simulate_cp2(q, k, v, backend):
    """Run both ranks of cp=2 in one process; the gather hands each rank every rank's K/V leaves."""
    cu, cup = torch.tensor(CP_CU), torch.tensor(CP_CU_PADDED)
    idx = [cp_partition_indices(cup, 2, r) for r in range(2)]
    local = [[x[i].detach().clone().requires_grad_() for x in (q, k, v)] for i in idx]

    def gather_for(rank):
        def gather(kv_local):
            parts = [kv_local if r == rank else torch.stack(local[r][1:], dim=1) for r in range(2)]
            return torch.cat(parts)

        return gather

    outs = [
        attend_thd(*local[r], cu, cup, cp_size=2, cp_rank=r, kv_gather=gather_for(r), backend=backend)
        for r in range(2)
    ]
    return idx, local, outs


def test_cp_gather_order_is_built_once_per_boundaries():
    # Every layer of a micro-batch passes the same boundaries: the order of the gathered K/V rows is built once.
    from thdpack.megatron.attention.torch_attention import _cp_gather_order

    _cp_gather_order.cache_clear()
    q, k, v = qkv(20)
    for _layer in range(3):
        _simulate_cp2(q, k, v, "dense")
    info = _cp_gather_order.cache_info()
    assert (info.misses, info.hits) == (1, 5)  # 3 layers x 2 ranks, one build
    order = _cp_gather_order(tuple(CP_CU_PADDED), 2, torch.device("cpu"))
    expected = torch.cat([cp_partition_indices(torch.tensor(CP_CU_PADDED), 2, r) for r in range(2)])
    assert torch.equal(order, expected)


@pytest.mark.parametrize("backend", ["sdpa", "dense"])
@pytest.mark.parametrize("rank", [0, 1])
def test_cp2_rank_output_equals_its_slice_of_the_full_output(backend, rank):
    q, k, v = qkv(20)
    full = attend_thd(q, k, v, torch.tensor(CP_CU), torch.tensor(CP_CU_PADDED))
    idx, _, outs = _simulate_cp2(q, k, v, backend)
    torch.testing.assert_close(outs[rank], full[idx[rank]])


@pytest.mark.parametrize("backend", ["sdpa", "dense"])
def test_cp2_grads_equal_the_slices_of_the_full_grads(backend):
    q, k, v = qkv(20, grad=True)
    g = torch.randn(20, 4, D, dtype=DTYPE, generator=torch.Generator().manual_seed(2))
    (attend_thd(q, k, v, torch.tensor(CP_CU), torch.tensor(CP_CU_PADDED)) * g).sum().backward()
    idx, local, outs = _simulate_cp2(q, k, v, backend)
    sum((outs[r] * g[idx[r]]).sum() for r in range(2)).backward()
    for r in range(2):
        for mine, full in zip(local[r], (q, k, v), strict=False):
            torch.testing.assert_close(mine.grad, full.grad[idx[r]])


def test_cp_rejects_samples_not_aligned_to_2cp():
    q, k, v = qkv(5)
    with pytest.raises(ValueError, match="not divisible by 2\\*cp=4"):
        attend_thd(
            q, k, v, [0, 6, 10], [0, 6, 10], cp_size=2, cp_rank=0, kv_gather=lambda x: torch.cat([x, x])
        )


# ----------------------------------------------------------------------------- Megatron module


def make_attention(**kwargs):
    config = TransformerConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        **kwargs,
    )
    return TorchTHDAttention(
        config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self"
    )


def test_module_thd_returns_tokens_by_hidden_like_te():
    q, k, v = qkv(13)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=torch.tensor(CU, dtype=torch.int32),
        cu_seqlens_kv=torch.tensor(CU, dtype=torch.int32),
        cu_seqlens_q_padded=torch.tensor(CU_PADDED, dtype=torch.int32),
        cu_seqlens_kv_padded=torch.tensor(CU_PADDED, dtype=torch.int32),
        max_seqlen_q=5,
        max_seqlen_kv=5,
    )
    out = make_attention()(q, k, v, None, packed_seq_params=params)
    assert out.shape == (13, 4 * D)
    torch.testing.assert_close(out, reference(q, k, v, CU, CU_PADDED).reshape(13, -1))


def test_module_without_packed_seq_params_is_causal_bshd():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(6, 2, 4, D, dtype=DTYPE, generator=g)
    k, v = (torch.randn(6, 2, 2, D, dtype=DTYPE, generator=g) for _ in range(2))
    torch.testing.assert_close(make_attention()(q, k, v, None), attend_bshd(q, k, v))


def test_get_core_attention_names_the_choices():
    assert get_core_attention("torch") is TorchTHDAttention
    with pytest.raises(ValueError, match="choose one of \\('torch', 'te'\\)"):
        get_core_attention("flash")


def test_te_backend_is_megatrons_te_attention_or_says_what_to_install():
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="thdpack\\[gpu\\]"):
            get_core_attention("te")
    else:
        from megatron.core.extensions.transformer_engine import TEDotProductAttention

        assert get_core_attention("te") is TEDotProductAttention


# ---------------------------------------------------------------- CUDA backends (marked gpu, skipped on CPU)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "varlen", "sdpa", "dense"])
@pytest.mark.parametrize("fold", [False, True])
def test_cuda_backends_match_the_fp64_reference(backend, fold):
    if backend == "varlen" and not hasattr(torch.nn.attention, "varlen"):
        pytest.skip(f"torch {torch.__version__} has no torch.nn.attention.varlen")
    cu, cu_padded = (CU_PADDED, CU_PADDED) if fold else (CU, CU_PADDED)
    q, k, v = qkv(CU_PADDED[-1], grad=True)
    expected = reference(q, k, v, cu, cu_padded)
    expected.sum().backward()
    ref_grads = [t.grad for t in (q, k, v)]

    qc, kc, vc = (t.detach().cuda().bfloat16().requires_grad_() for t in (q, k, v))
    cu_t = torch.tensor(cu, dtype=torch.int32, device="cuda")
    cup_t = cu_t if fold else torch.tensor(cu_padded, dtype=torch.int32, device="cuda")
    max_seqlen = int(torch.tensor(cu_padded).diff().max())
    out = attend_thd(
        qc,
        kc,
        vc,
        cu_t,
        cup_t,
        max_seqlen=max_seqlen,
        host_cu_seqlens=cu,
        host_cu_seqlens_padded=cu_padded,
        backend=backend,
    )
    out.float().sum().backward()
    torch.testing.assert_close(out.double().cpu(), expected.detach(), atol=2e-2, rtol=2e-2)
    assert (out[PAD_ROWS if not fold else []] == 0).all()  # pad rows are exactly zero in distinct mode
    for got, ref in zip((qc.grad, kc.grad, vc.grad), ref_grads, strict=True):
        torch.testing.assert_close(got.double().cpu(), ref, atol=5e-2, rtol=5e-2)
