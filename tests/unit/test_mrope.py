"""Packed MRoPE: per-token frequencies for a packed THD row equal Megatron-core's MRoPE on each sample alone,
also on every rank of a (simulated) context-parallel group; Megatron's own module does not."""

from __future__ import annotations

import types

import pytest
import torch
from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding

from thdpack.megatron.mrope import (
    PackedMultimodalRotaryEmbedding,
    apply_rotary_per_token,
    mrope_frequencies,
)
from thdpack.packing.context_parallel import cp_partition_indices

KV_CHANNELS = 16
SECTION = [2, 3, 3]  # sums to KV_CHANNELS // 2

# Three Qwen2-VL style samples: text, a 2x2x2 video grid, text; one token; text, a 1x3x2 image, text.
SAMPLES = [
    [("text", 3), ("vision", 2, 2, 2), ("text", 2)],
    [("text", 1)],
    [("text", 2), ("vision", 1, 3, 2), ("text", 1)],
]


class FakeGroup:
    """The two calls Megatron's rotary code makes on a CP process group."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def qwen2vl_ids(layout) -> torch.Tensor:
    """int64 ``[3, L]`` (t, h, w) ids of one sample, Qwen2-VL's rule: text advances all three ids together;
    a vision grid ``(gt, gh, gw)`` starts at the next text position and spans it in each axis; the text after
    it continues from the largest id + 1."""
    cols, start = [], 0
    for part in layout:
        if part[0] == "text":
            pos = torch.arange(start, start + part[1])
            cols.append(pos.expand(3, -1))
            start += part[1]
        else:
            gt, gh, gw = part[1:]
            t, h, w = torch.meshgrid(torch.arange(gt), torch.arange(gh), torch.arange(gw), indexing="ij")
            grid = torch.stack([t.flatten(), h.flatten(), w.flatten()]) + start
            cols.append(grid)
            start = int(grid.max()) + 1
    return torch.cat(cols, dim=1)


def packed_row(samples, multiple: int):
    """Pack samples into one row, each padded to a multiple of ``multiple`` (pad ids keep counting).
    Returns ids ``[3, 1, T]``, real-token mask ``[T]``, ``cu_seqlens_padded`` and the per-sample ids."""
    per_sample = [qwen2vl_ids(s) for s in samples]
    cols, real, cu = [], [], [0]
    for ids in per_sample:
        n = ids.shape[1]
        pad = -n % multiple
        nxt = int(ids.max()) + 1
        cols += [ids, torch.arange(nxt, nxt + pad).expand(3, -1)]
        real += [True] * n + [False] * pad
        cu.append(cu[-1] + n + pad)
    return (
        torch.cat(cols, dim=1)[:, None, :],
        torch.tensor(real),
        torch.tensor(cu, dtype=torch.int32),
        per_sample,
    )


@pytest.fixture
def megatron_on_cpu(monkeypatch):
    """Let Megatron's CUDA-pinned rotary code run on the CPU for the duration of one test."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)
    shim = types.ModuleType("torch")
    shim.__getattr__ = lambda name: getattr(torch, name)
    shim.tensor = lambda *a, pin_memory=False, **k: torch.tensor(*a, **k)
    monkeypatch.setattr(rope_utils, "torch", shim)


def megatron_mrope(cp_size: int = 1, cp_rank: int = 0, **kwargs):
    return rotary_pos_embedding.MultimodalRotaryEmbedding(
        KV_CHANNELS, kwargs.pop("rotary_percent", 1.0), cp_group=FakeGroup(cp_size, cp_rank), **kwargs
    )


def config(**overrides):
    base = dict(
        rotary_interleaved=False, apply_rope_fusion=False, multi_latent_attention=False, mrope_section=SECTION
    )
    return types.SimpleNamespace(**{**base, **overrides})


def per_sample_reference(per_sample, cu_padded, fn):
    """``fn(ids [3,1,L], start)`` per sample, written at that sample's real tokens of a full row."""
    out = {}
    for i, ids in enumerate(per_sample):
        start = int(cu_padded[i])
        for j, row in enumerate(fn(ids[:, None, :], start)):
            out[start + j] = row
    return out


@pytest.mark.usefixtures("megatron_on_cpu")
@pytest.mark.parametrize("seq_len_interpolation_factor", [None, 2.0])
def test_packed_row_freqs_equal_megatron_per_sample(seq_len_interpolation_factor):
    ids, real, cu, per_sample = packed_row(SAMPLES, multiple=4)
    ours = PackedMultimodalRotaryEmbedding(
        KV_CHANNELS, seq_len_interpolation_factor=seq_len_interpolation_factor
    )
    freqs = ours(ids, SECTION)
    assert freqs.shape == (ids.shape[-1], 1, 1, KV_CHANNELS)

    ref = megatron_mrope(seq_len_interpolation_factor=seq_len_interpolation_factor)
    expected = per_sample_reference(per_sample, cu, lambda s, _: ref(s.clone(), SECTION))
    assert sorted(expected) == real.nonzero().flatten().tolist()
    for t, row in expected.items():
        torch.testing.assert_close(freqs[t], row, rtol=0, atol=0)


@pytest.mark.usefixtures("megatron_on_cpu")
def test_from_megatron_keeps_frequencies_and_partial_rotary():
    ids, _, _, _ = packed_row(SAMPLES, multiple=2)
    ref = megatron_mrope(rotary_percent=0.5, rotary_base=500)
    ours = PackedMultimodalRotaryEmbedding.from_megatron(ref)
    torch.testing.assert_close(ours(ids, [1, 1, 2]), ref(ids, [1, 1, 2]), rtol=0, atol=0)


@pytest.mark.usefixtures("megatron_on_cpu")
@pytest.mark.parametrize("interleaved", [False, True])
def test_text_only_mrope_is_1d_rope(interleaved):
    # t = h = w: every section sees the same id, so MRoPE must be plain RoPE in either rotary layout
    # (Megatron's own interleaved MRoPE cannot run: it views a transposed tensor).
    L = 6
    ids = torch.arange(L).expand(3, 1, L)
    ours = mrope_frequencies(ids, PackedMultimodalRotaryEmbedding(KV_CHANNELS).inv_freq, SECTION, interleaved)
    rope = rotary_pos_embedding.RotaryEmbedding(
        KV_CHANNELS,
        1.0,
        rotary_interleaved=interleaved,
        use_cpu_initialization=True,
        cp_group=FakeGroup(1, 0),
    )
    torch.testing.assert_close(ours, rope.get_emb(L), rtol=0, atol=0)


@pytest.mark.parametrize("section", [[6, 5, 5], [24, 20, 20], [2, 3, 3]])
def test_interleaved_mrope_equals_qwen3_vl_text_rotary(section):
    """Qwen3-VL's frequency layout (mrope_interleaved): the cos and sin transformers' text rotary gives each
    token of an image sample equal those of thdpack's per-token angles (halves layout, as rotate_half)."""
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    head_dim = 2 * sum(section)
    config = Qwen3VLTextConfig(
        hidden_size=64, num_attention_heads=2, head_dim=head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "mrope_section": section,
                         "mrope_interleaved": True},
    )  # fmt: skip
    hf = Qwen3VLTextRotaryEmbedding(config)
    ids = qwen2vl_ids([("text", 3), ("vision", 1, 4, 6), ("text", 2), ("vision", 1, 6, 2), ("text", 1)])[
        :, None
    ]
    cos, sin = hf(torch.zeros(1, dtype=torch.float32), ids)  # [1, L, head_dim]
    ours = PackedMultimodalRotaryEmbedding(head_dim, rotary_base=5000, device="cpu", mrope_interleaved=True)
    torch.testing.assert_close(ours.inv_freq, hf.inv_freq, rtol=0, atol=0)
    angles = ours(ids, section)[:, 0, 0]  # [L, head_dim]
    torch.testing.assert_close(angles.cos(), cos[0], rtol=0, atol=0)
    torch.testing.assert_close(angles.sin(), sin[0], rtol=0, atol=0)
    # The contiguous (Qwen2.5-VL) layout differs on the same image ids: the check can fail.
    contiguous = mrope_frequencies(ids, ours.inv_freq, section)[:, 0, 0]
    assert not torch.allclose(contiguous.cos(), cos[0])


@pytest.mark.parametrize("section", [[2, 3], [2, 3, 4]])
def test_mrope_section_must_cover_the_rotary_half(section):
    ids = torch.zeros(3, 1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="mrope_section"):
        PackedMultimodalRotaryEmbedding(KV_CHANNELS)(ids, section)


def test_cp_rank_freqs_are_rows_of_the_full_row_freqs():
    cp = 2
    ids, _, cu, _ = packed_row(SAMPLES, multiple=2 * cp)
    rope = PackedMultimodalRotaryEmbedding(KV_CHANNELS)
    full = rope(ids, SECTION)
    for rank in range(cp):
        idx = cp_partition_indices(cu, cp, rank)
        local = rope(ids[..., idx], SECTION, cp_group=FakeGroup(cp, rank))  # ignored on purpose
        torch.testing.assert_close(local, full[idx], rtol=0, atol=0)


@pytest.mark.usefixtures("megatron_on_cpu")
def test_megatron_mrope_module_reslices_a_packed_row_under_cp():
    # Why this module exists: Megatron's MultimodalRotaryEmbedding zigzags the *whole row* under CP.
    cp = 2
    ids, real, cu, _ = packed_row(SAMPLES, multiple=2 * cp)
    full = PackedMultimodalRotaryEmbedding(KV_CHANNELS)(ids, SECTION)
    for rank in range(cp):
        idx = cp_partition_indices(cu, cp, rank)
        theirs = megatron_mrope(cp, rank)
        # Ids already sliced like the tokens: the row is sliced a second time, to T / cp**2.
        assert theirs(ids[..., idx], SECTION).shape[0] == ids.shape[-1] // cp**2
        # Ids of the full row: the right length, but rows of tokens this rank does not hold.
        wrong = theirs(ids, SECTION)
        keep = real[idx]
        assert wrong.shape == full[idx].shape
        assert not torch.equal(wrong[keep], full[idx][keep])


def rotate_per_sample_reference(x, per_sample, cu):
    """Megatron's BSHD rotary on each sample alone (unpacked), written back at the real tokens of the row."""
    ref = megatron_mrope()
    cfg = config()

    def one(ids, start):
        seg = x[start : start + ids.shape[-1]].unsqueeze(1)  # [L, 1, H, D]
        out = rope_utils.apply_rotary_pos_emb(seg, ref(ids.clone(), SECTION), cfg, cp_group=FakeGroup(1, 0))
        return out.squeeze(1)

    return per_sample_reference(per_sample, cu, one)


@pytest.mark.usefixtures("megatron_on_cpu")
@pytest.mark.parametrize("cp", [1, 2])
@pytest.mark.parametrize("rotary_percent", [1.0, 0.5])
def test_per_token_rotary_on_thd_equals_megatron_bshd_per_sample(cp, rotary_percent):
    torch.manual_seed(0)
    ids, _, cu, per_sample = packed_row(SAMPLES, multiple=2 * cp)
    section = SECTION if rotary_percent == 1.0 else [1, 1, 2]
    heads, head_dim = 3, KV_CHANNELS
    x = torch.randn(ids.shape[-1], heads, head_dim)
    ours = PackedMultimodalRotaryEmbedding(head_dim, rotary_percent=rotary_percent)

    ref_mod = megatron_mrope(rotary_percent=rotary_percent)
    expected = per_sample_reference(
        per_sample,
        cu,
        lambda s, start: rope_utils.apply_rotary_pos_emb(
            x[start : start + s.shape[-1]].unsqueeze(1),
            ref_mod(s.clone(), section),
            config(),
            cp_group=FakeGroup(1, 0),
        ).squeeze(1),
    )
    for rank in range(cp):
        idx = cp_partition_indices(cu, cp, rank)
        got = apply_rotary_per_token(x[idx], ours(ids[..., idx], section), config())
        for local, t in enumerate(idx.tolist()):
            if t in expected:
                torch.testing.assert_close(got[local], expected[t], rtol=0, atol=0)


@pytest.mark.usefixtures("megatron_on_cpu")
def test_megatron_thd_rotary_misapplies_per_token_freqs_under_cp():
    # Why attention needs the per-token path: with cu_seqlens, Megatron's rotary reads freqs as
    # position-within-sample and zigzags them again; rank-local per-token freqs come out wrong.
    torch.manual_seed(0)
    cp = 2
    ids, real, cu, per_sample = packed_row(SAMPLES, multiple=2 * cp)
    x = torch.randn(ids.shape[-1], 2, KV_CHANNELS)
    expected = rotate_per_sample_reference(x, per_sample, cu)
    rope = PackedMultimodalRotaryEmbedding(KV_CHANNELS)
    for rank in range(cp):
        idx = cp_partition_indices(cu, cp, rank)
        freqs = rope(ids[..., idx], SECTION)
        theirs = rope_utils.apply_rotary_pos_emb(
            x[idx], freqs, config(), cu_seqlens=cu, cp_group=FakeGroup(cp, rank)
        )
        ours = apply_rotary_per_token(x[idx], freqs, config())
        keep = real[idx]
        want = torch.stack([expected[t] for t in idx[keep].tolist()])
        torch.testing.assert_close(ours[keep], want, rtol=0, atol=0)
        assert not torch.allclose(theirs[keep], want)


def test_per_token_rotary_rejects_freqs_of_other_tokens():
    x = torch.randn(8, 2, KV_CHANNELS)
    freqs = torch.zeros(4, 1, 1, KV_CHANNELS)
    with pytest.raises(ValueError, match="sliced for context"):
        apply_rotary_per_token(x, freqs, config())


# ------------------------------------------------------------------------------------------------
# Inside a Megatron model (one process, gloo): GPTModel(position_embedding_type="mrope") + enable_packed_mrope
# ------------------------------------------------------------------------------------------------

MODEL_SECTION = [1, 1, 2]  # kv_channels 8


def tiny_mrope_gpt(vocab: int = 64):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from thdpack.megatron.models import build_gpt_model

    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=64,
        mrope_section=MODEL_SECTION,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
    )
    torch.manual_seed(0)
    # packed_mrope=False: these tests switch the fix on themselves, or show what goes wrong without it.
    return build_gpt_model(
        cfg,
        vocab_size=vocab,
        max_sequence_length=64,
        backend="torch",
        position_embedding_type="mrope",
        packed_mrope=False,
    ).eval()


def thd_params(samples, cu_padded):
    """Distinct logical (real tokens) and physical (with alignment pad) boundaries of a packed row."""
    from megatron.core.packed_seq_params import PackedSeqParams

    lengths = torch.tensor([qwen2vl_ids(s).shape[1] for s in samples])
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32)
    max_len = int(cu_padded.diff().max())
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded,
        max_seqlen_q=max_len,
        max_seqlen_kv=max_len,
    )


@pytest.mark.cpu_only
@pytest.mark.usefixtures("one_rank_megatron")
def test_gpt_model_packed_row_logits_equal_each_sample_alone(monkeypatch):
    from megatron.core.transformer import attention

    from thdpack.megatron.mrope import enable_packed_mrope

    model = tiny_mrope_gpt()
    assert enable_packed_mrope(model) == 2
    assert enable_packed_mrope(model) == 0  # idempotent
    assert isinstance(model.rotary_pos_emb, PackedMultimodalRotaryEmbedding)

    # Megatron's THD rotary must never see the per-token frequencies.
    thd_rotary_calls = []
    original = attention.apply_rotary_pos_emb

    def spy(t, freqs, config, cu_seqlens=None, **kwargs):
        thd_rotary_calls.append(cu_seqlens is not None)
        return original(t, freqs, config, cu_seqlens=cu_seqlens, **kwargs)

    monkeypatch.setattr(attention, "apply_rotary_pos_emb", spy)

    ids, real, cu_padded, per_sample = packed_row(SAMPLES, multiple=4)
    torch.manual_seed(1)
    tokens = torch.randint(0, 64, (1, ids.shape[-1]))
    with torch.no_grad():
        packed = model(tokens, ids, None, packed_seq_params=thd_params(SAMPLES, cu_padded))
        for i, sample_ids in enumerate(per_sample):
            start, n = int(cu_padded[i]), sample_ids.shape[1]
            alone = model(tokens[:, start : start + n], sample_ids[:, None, :], None)
            torch.testing.assert_close(packed[:, start : start + n], alone, rtol=1e-5, atol=1e-5)
    assert thd_rotary_calls and not any(thd_rotary_calls)


@pytest.mark.cpu_only
@pytest.mark.usefixtures("one_rank_megatron")
def test_gpt_model_packed_row_grads_equal_each_sample_alone():
    from thdpack.megatron.mrope import enable_packed_mrope

    ids, real, cu_padded, per_sample = packed_row(SAMPLES, multiple=4)
    torch.manual_seed(3)
    tokens = torch.randint(0, 64, (1, ids.shape[-1]))
    labels = torch.randint(0, 64, (1, ids.shape[-1]))

    def grads(loss_fn):
        model = tiny_mrope_gpt()
        enable_packed_mrope(model)
        loss_fn(model).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    def packed(model):
        loss = model(tokens, ids, None, labels=labels, packed_seq_params=thd_params(SAMPLES, cu_padded))
        return loss[real[None]].sum()

    def alone(model):
        total = 0
        for i, sample_ids in enumerate(per_sample):
            sl = slice(int(cu_padded[i]), int(cu_padded[i]) + sample_ids.shape[1])
            total = total + model(tokens[:, sl], sample_ids[:, None, :], None, labels=labels[:, sl]).sum()
        return total

    want = grads(alone)
    got = grads(packed)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


class RecordQK(torch.nn.Module):
    """A core attention that records the (rotated) query and key and returns zeros."""

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        self.query, self.key, self.packed_seq_params = query, key, packed_seq_params
        return query.new_zeros(query.shape[0], query.shape[1] * query.shape[2])


@pytest.mark.usefixtures("one_rank_megatron", "megatron_on_cpu")
@pytest.mark.parametrize("packed_mrope", [True, False])
def test_attention_rotates_each_cp_rank_tokens_like_each_sample_alone(packed_mrope):
    # Simulated cp=2 on one process: only the rotary depends on the CP rank (attention is stubbed),
    # and Megatron's THD rotary reads the rank from pg_collection.cp.
    import copy

    from thdpack.megatron.mrope import enable_packed_mrope

    cp = 2
    model = tiny_mrope_gpt()
    attn = model.decoder.layers[0].self_attention
    attn.core_attention = RecordQK()
    if packed_mrope:
        enable_packed_mrope(model)
    else:
        model.rotary_pos_emb = PackedMultimodalRotaryEmbedding.from_megatron(model.rotary_pos_emb)
    ids, real, cu_padded, per_sample = packed_row(SAMPLES, multiple=2 * cp)
    params = thd_params(SAMPLES, cu_padded)
    torch.manual_seed(2)
    hidden = torch.randn(ids.shape[-1], 1, 32)

    with torch.no_grad():
        attn(hidden, None, packed_seq_params=params)  # no rotary: the raw q, k of the full row
        raw_q, raw_k = attn.core_attention.query, attn.core_attention.key
        ref = megatron_mrope(1, 0)
        ref.inv_freq = model.rotary_pos_emb.inv_freq

        def reference(raw):
            return per_sample_reference(
                per_sample,
                cu_padded,
                lambda s, start: rope_utils._apply_rotary_pos_emb_bshd(
                    raw[start : start + s.shape[-1]].unsqueeze(1), ref(s.clone(), MODEL_SECTION)
                ).squeeze(1),
            )

        want_q, want_k = reference(raw_q), reference(raw_k)
        agree = []
        for rank in range(cp):
            idx = cp_partition_indices(cu_padded, cp, rank)
            attn.pg_collection = copy.copy(attn.pg_collection)
            attn.pg_collection.cp = FakeGroup(cp, rank)
            attn(
                hidden[idx],
                None,
                rotary_pos_emb=model.rotary_pos_emb(ids[..., idx], MODEL_SECTION),
                packed_seq_params=params,
            )
            assert attn.core_attention.packed_seq_params is params
            keep = real[idx]
            got_q, got_k = attn.core_attention.query[keep], attn.core_attention.key[keep]
            exp_q = torch.stack([want_q[t] for t in idx[keep].tolist()])
            exp_k = torch.stack([want_k[t] for t in idx[keep].tolist()])
            agree.append(torch.allclose(got_q, exp_q, atol=1e-6) and torch.allclose(got_k, exp_k, atol=1e-6))
    # With the hooks every rank is right; Megatron's THD rotary alone is wrong on every rank.
    assert agree == [packed_mrope] * cp


@pytest.mark.cpu_only
@pytest.mark.usefixtures("one_rank_megatron")
def test_enable_packed_mrope_refuses_a_model_without_mrope():
    from megatron.core.transformer.transformer_config import TransformerConfig

    from thdpack.megatron.models import build_gpt_model
    from thdpack.megatron.mrope import enable_packed_mrope

    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True)
    model = build_gpt_model(cfg, vocab_size=16, max_sequence_length=8, position_embedding_type="rope")
    with pytest.raises(ValueError, match="position_embedding_type='mrope'"):
        enable_packed_mrope(model)


@pytest.mark.cpu_only
@pytest.mark.usefixtures("one_rank_megatron")
def test_build_gpt_model_switches_packed_mrope_on_by_default():
    from megatron.core.transformer.transformer_config import TransformerConfig

    from thdpack.megatron.models import build_gpt_model
    from thdpack.megatron.mrope import enable_packed_mrope

    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        mrope_section=MODEL_SECTION,
        use_cpu_initialization=True,
    )
    model = build_gpt_model(cfg, vocab_size=16, max_sequence_length=8, position_embedding_type="mrope")
    assert isinstance(model.rotary_pos_emb, PackedMultimodalRotaryEmbedding)
    assert enable_packed_mrope(model) == 0  # already hooked
