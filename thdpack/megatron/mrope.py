"""MRoPE (Qwen2-VL style multimodal RoPE) that is correct for packed THD rows, also under context parallelism.

A packed row carries MRoPE ids ``[3, 1, T]`` (temporal, height, width), computed per sample and restarted at
0 per sample; under CP every rank holds the ids of its own tokens, sliced with the same per-sample zigzag
indices as the tokens (``thdpack.packing.context_parallel.cp_partition_indices``). The only correct use of such ids
is per token: token ``i`` rotates by the frequencies of ``ids[:, 0, i]``, nothing else.

Megatron-core 0.16.1 gets this wrong in two places (``GPTModel(position_embedding_type="mrope")``):

1. ``MultimodalRotaryEmbedding.forward`` (models/common/embeddings/rotary_pos_embedding.py) ends with
   ``get_pos_emb_on_this_cp_rank(emb, 0, cp_group)`` whenever ``cp_size > 1``: it cuts the *whole row* into
   ``2*cp`` chunks and keeps two (BSHD zigzag). For a packed row the rank's tokens are per-sample zigzag
   chunks, so the kept frequencies belong to other tokens (ids given for the full row), or the row shrinks
   a second time to ``T / cp**2`` (ids already sliced like the tokens).
2. ``Attention.forward`` (transformer/attention.py) calls ``apply_rotary_pos_emb(..., cu_seqlens=...)``
   whenever ``packed_seq_params.qkv_format == "thd"``. That THD path (rope_utils.py) treats ``freqs`` as
   indexed by position within a sample and re-derives the zigzag per sample:
   - unfused ``_apply_rotary_pos_emb_thd``: only when ``freqs.size(0) == cu_seqlens[-1]`` (the full,
     un-CP-sliced row) does it index per token ("exact mapping"); it then slices ``freqs`` for this CP rank
     itself, and costs host syncs (``.tolist()``, one ``.item()`` per sample, per layer, for q and k).
     Rank-local per-token freqs (length ``T / cp``) fall into the other branch: wrong frequencies, silently.
   - fused ``fused_apply_rotary_pos_emb_thd`` (``apply_rope_fusion=True``, TE): no per-token branch at all.

The fix, per model instance (no global patch; models without MRoPE are untouched):

- :class:`PackedMultimodalRotaryEmbedding` replaces ``model.rotary_pos_emb``: the same frequencies as
  Megatron's module, computed from the ids it is given, never re-sliced for CP.
- Two forward pre-hooks on every attention layer: the one on ``self_attention`` takes the per-token
  frequencies out of ``rotary_pos_emb`` for THD calls (so Megatron's THD rotary never sees them) and carries
  them to ``core_attention`` inside a copy of ``packed_seq_params``; the one on ``core_attention`` rotates
  ``query`` ``[T, H, D]`` and ``key`` elementwise over the token axis (Megatron's own BSHD rotary with a
  batch of one), then passes the original ``packed_seq_params`` on. The rotary lands exactly where Megatron
  would apply it (after q/k layernorm, before core attention). Carrying the frequencies as call arguments
  (not module state) keeps activation recomputation and interleaved pipeline schedules correct.

:func:`enable_packed_mrope` installs both. After it, MRoPE ids must always be the rank's own ids (sliced
like the tokens), in THD and BSHD batches alike, and every pipeline stage needs them (``_preprocess``
computes the rotary on every stage).

What this relies on in megatron-core (checked on 0.16.1; the line numbers are that release's):

- ``GPTModel.rotary_pos_emb`` and its call in ``GPTModel._preprocess`` (models/gpt/gpt_model.py:388,
  ``self.rotary_pos_emb(position_ids, self.mrope_section, cp_group=...)``): the module is swapped per model.
- ``Attention.forward`` (transformer/attention.py:875) taking ``rotary_pos_emb``, ``packed_seq_params`` and
  ``inference_context`` by these names, and calling ``self.core_attention(..., packed_seq_params=...)`` with
  query and key first (attention.py:1142): the pre-hooks bind and rewrite those arguments.
- Two private helpers, called as Megatron itself calls them: ``rope_utils._apply_rotary_pos_emb_bshd``
  (models/common/embeddings/rope_utils.py:92; the public ``apply_rotary_pos_emb`` reaches it for
  ``cu_seqlens=None`` too, but first reads ``parallel_state.get_context_parallel_group()``, which a model
  built with its own process groups need not have) and
  ``yarn_rotary_pos_embedding._yarn_get_concentration_factor_from_config`` (yarn_rotary_pos_embedding.py:274,
  the ``mscale`` Attention.forward passes at attention.py:1102). ``rope_utils.fused_apply_rotary_pos_emb`` is
  the public TE kernel (None without Transformer Engine).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Sequence

import torch
from torch import nn

from .unwrap import unwrap_model

__all__ = [
    "PackedMultimodalRotaryEmbedding",
    "apply_rotary_per_token",
    "enable_packed_mrope",
    "mrope_frequencies",
]


def mrope_frequencies(
    position_ids: torch.Tensor,
    inv_freq: torch.Tensor,
    mrope_section: Sequence[int],
    rotary_interleaved: bool = False,
    seq_len_interpolation_factor: float | None = None,
    mrope_interleaved: bool = False,
) -> torch.Tensor:
    """Per-token MRoPE rotation angles, in Megatron's freqs layout.

    Args:
        position_ids: int ``[3, B, S]`` (temporal, height, width) ids; for a packed row ``[3, 1, T]``.
        inv_freq: float32 ``[rot_dim // 2]`` inverse frequencies.
        mrope_section: how many of the ``rot_dim // 2`` frequencies follow the temporal, height and width
            id, in that order (e.g. Qwen2-VL ``[16, 24, 24]``); must sum to ``rot_dim // 2``.
        rotary_interleaved: layout of the rotary dims, as Megatron's ``config.rotary_interleaved``:
            False = halves ``[f_0 .. f_{n-1}, f_0 .. f_{n-1}]``, True = pairs ``[f_0, f_0, f_1, f_1, ..]``.
        seq_len_interpolation_factor: ids are divided by it (linear position interpolation).
        mrope_interleaved: which frequencies follow which axis. False (Qwen2-VL, Qwen2.5-VL): contiguous
            sections, the first ``s_t`` frequencies temporal, the next ``s_h`` height, the last ``s_w`` width.
            True (Qwen3-VL, its config's ``mrope_interleaved``): frequency ``j`` follows the height id when
            ``j % 3 == 1`` and ``j < 3 * s_h``, the width id when ``j % 3 == 2`` and ``j < 3 * s_w``, else the
            temporal id: transformers' ``Qwen3VLTextRotaryEmbedding.recomposition_frequencies``
            (models/qwen3_vl/modeling_qwen3_vl.py; ``apply_interleaved_mrope`` in 4.57), tested against it in
            tests/unit/test_mrope.py.

    Returns:
        float32 ``[S, B, 1, rot_dim]``: row ``s`` is the angle of token ``s``, on ``position_ids``' device.

    With ``rotary_interleaved=False`` this equals Megatron-core's ``MultimodalRotaryEmbedding`` (which splits
    ``mrope_section * 2`` over the duplicated halves: the same frequency-to-axis map). Its interleaved branch
    fails on any sequence (0.16.1 views a transposed tensor); here the section still selects per frequency,
    so text-only ids (t = h = w) give exactly 1D RoPE in either layout.
    """
    if position_ids.dim() != 3 or position_ids.size(0) != 3:
        raise ValueError(
            f"MRoPE position_ids must be [3, batch, seq] (temporal, height, width), got {tuple(position_ids.shape)}"
        )
    half = inv_freq.numel()
    if len(mrope_section) != 3 or sum(mrope_section) != half:
        raise ValueError(
            f"mrope_section {list(mrope_section)} must have 3 entries summing to rot_dim // 2 = {half} "
            f"(kv_channels * rotary_percent / 2)"
        )
    inv_freq = inv_freq.to(device=position_ids.device, dtype=torch.float32)
    pos = position_ids.to(torch.float32)
    if seq_len_interpolation_factor is not None:
        pos = pos / seq_len_interpolation_factor
    if mrope_interleaved:
        # The axis of each frequency from an arange made on the device (no host-to-device copy); one fp32
        # product per element, as transformers computes it.
        j = torch.arange(half, device=position_ids.device)
        height = ((j % 3) == 1) & (j < 3 * mrope_section[1])
        width = ((j % 3) == 2) & (j < 3 * mrope_section[2])
        by_axis = pos[:, :, :, None] * inv_freq  # [3, B, S, rot_dim // 2]
        freqs = torch.where(height, by_axis[1], torch.where(width, by_axis[2], by_axis[0]))
    else:
        # Frequencies [0, s_t) follow the temporal id, the next s_h the height id, the last s_w the width id.
        # Slices, not an index tensor: no host-to-device copy per call. A single fp32 product per element,
        # bit-equal to Megatron's outer-product matmul (inner dim 1) on CPU.
        parts, start = [], 0
        for axis, n in enumerate(mrope_section):
            parts.append(pos[axis, :, :, None] * inv_freq[start : start + n])
            start += n
        freqs = torch.cat(parts, dim=-1)  # [B, S, rot_dim // 2]
    if rotary_interleaved:
        emb = torch.repeat_interleave(freqs, 2, dim=-1)
    else:
        emb = torch.cat((freqs, freqs), dim=-1)
    return emb.transpose(0, 1).unsqueeze(2).contiguous()


class PackedMultimodalRotaryEmbedding(nn.Module):
    """Drop-in for Megatron-core's ``MultimodalRotaryEmbedding`` (``GPTModel.rotary_pos_emb``) that never
    re-slices for context parallelism: ``position_ids`` are the rank's own ids, already sliced with the same
    indices as its tokens (``[3, 1, T // cp]`` for a packed row), so the frequencies are simply theirs.

    Args mirror Megatron's module: ``kv_channels``, ``rotary_percent``, ``rotary_interleaved``,
    ``seq_len_interpolation_factor``, ``rotary_base``. ``device`` defaults to the current CUDA device when
    there is one, else the CPU. ``mrope_interleaved``: Qwen3-VL's frequency-to-axis layout
    (:func:`mrope_frequencies`); megatron-core 0.16.1 has only the contiguous one.
    """

    def __init__(
        self,
        kv_channels: int,
        rotary_percent: float = 1.0,
        rotary_interleaved: bool = False,
        seq_len_interpolation_factor: float | None = None,
        rotary_base: int = 10000,
        device: torch.device | str | None = None,
        mrope_interleaved: bool = False,
    ) -> None:
        super().__init__()
        dim = int(kv_channels * rotary_percent) if rotary_percent < 1.0 else kv_channels
        if device is None:
            device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        # A plain attribute, as in Megatron: a buffer would be cast to bf16 by Float16Module.
        self.inv_freq = 1.0 / (
            rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
        )
        self.rotary_interleaved = rotary_interleaved
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self.mrope_interleaved = mrope_interleaved

    @classmethod
    def from_megatron(
        cls, module: nn.Module, mrope_interleaved: bool = False
    ) -> PackedMultimodalRotaryEmbedding:
        """The same frequencies as an existing ``MultimodalRotaryEmbedding`` (its ``inv_freq`` is reused)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.inv_freq = module.inv_freq
        new.rotary_interleaved = module.rotary_interleaved
        new.seq_len_interpolation_factor = module.seq_len_interpolation_factor
        new.mrope_interleaved = mrope_interleaved
        return new

    def forward(
        self, position_ids: torch.Tensor, mrope_section: Sequence[int], cp_group=None
    ) -> torch.Tensor:
        """``position_ids`` int ``[3, B, S]`` -> float32 freqs ``[S, B, 1, rot_dim]``.

        ``cp_group`` is accepted for ``GPTModel._preprocess``'s call and ignored on purpose: the ids are
        already this rank's (re-slicing them is the bug this module exists to avoid).
        """
        if self.inv_freq.device != position_ids.device:
            self.inv_freq = self.inv_freq.to(position_ids.device)
        return mrope_frequencies(
            position_ids,
            self.inv_freq,
            mrope_section,
            rotary_interleaved=self.rotary_interleaved,
            seq_len_interpolation_factor=self.seq_len_interpolation_factor,
            mrope_interleaved=self.mrope_interleaved,
        )


def apply_rotary_per_token(t: torch.Tensor, freqs: torch.Tensor, config, mscale: float = 1.0) -> torch.Tensor:
    """Rotate a THD tensor by per-token frequencies.

    Args:
        t: ``[T, H, D]`` query or key of a packed row (this CP rank's tokens).
        freqs: ``[T, 1, 1, rot_dim]`` angles of those same tokens (``PackedMultimodalRotaryEmbedding``).
        config: Megatron ``TransformerConfig`` (``rotary_interleaved``, ``apply_rope_fusion``,
            ``multi_latent_attention``).
        mscale: Megatron's YaRN concentration factor (1.0 for MRoPE).

    Returns:
        ``[T, H, D]``, ``t``'s dtype. The row is rotated as one BSHD/SBHD sequence of batch 1 with Megatron's
        own kernels (TE fused SBHD RoPE under ``apply_rope_fusion``), i.e. elementwise over tokens: no
        ``cu_seqlens``, no CP re-slicing, no host syncs.
    """
    from megatron.core.models.common.embeddings import rope_utils

    if t.dim() != 3 or freqs.dim() != 4 or freqs.size(0) != t.size(0) or freqs.size(1) != 1:
        raise ValueError(
            f"per-token rotary needs t [T, H, D] and freqs [T, 1, 1, rot_dim] with the same T, got t "
            f"{tuple(t.shape)} and freqs {tuple(freqs.shape)}: MRoPE ids must be sliced for context "
            f"parallelism with the same indices as the tokens (and not re-sliced)"
        )
    x = t.unsqueeze(1)
    if config.apply_rope_fusion and mscale == 1.0 and not config.multi_latent_attention:
        if rope_utils.fused_apply_rotary_pos_emb is None:
            raise RuntimeError(
                "apply_rope_fusion=True needs Transformer Engine's fused RoPE; it is not importable"
            )
        out = rope_utils.fused_apply_rotary_pos_emb(x, freqs, interleaved=config.rotary_interleaved)
    else:
        out = rope_utils._apply_rotary_pos_emb_bshd(
            x,
            freqs,
            rotary_interleaved=config.rotary_interleaved,
            multi_latent_attention=config.multi_latent_attention,
            mscale=mscale,
        )
    return out.squeeze(1)


def _packed_seq_params_with_rotary():
    """``PackedSeqParams`` (with thdpack's host boundaries, when given) plus the per-token rotary that rides from
    ``self_attention`` to ``core_attention``. Built lazily so importing this module does not import Megatron."""
    global _PackedSeqParamsWithRotary
    if _PackedSeqParamsWithRotary is None:
        from .packed_seq_params import THDPackedSeqParams

        @dataclasses.dataclass
        class PackedSeqParamsWithRotary(THDPackedSeqParams):
            rotary_q: torch.Tensor = None
            rotary_k: torch.Tensor = None
            mscale: float = 1.0
            original: object = None  # the PackedSeqParams core_attention gets back

        _PackedSeqParamsWithRotary = PackedSeqParamsWithRotary
    return _PackedSeqParamsWithRotary


_PackedSeqParamsWithRotary = None
_HOOKED = "_thdpack_packed_mrope_hooks"


def _attention_pre_hook(signature: inspect.Signature):
    def hook(attention, args, kwargs):
        bound = signature.bind(*args, **kwargs)
        params = bound.arguments.get("packed_seq_params")
        rotary = bound.arguments.get("rotary_pos_emb")
        if rotary is None or params is None or params.qkv_format != "thd":
            return None  # BSHD: Megatron applies [S, B, 1, D] freqs elementwise already, which is right.
        if isinstance(params, _packed_seq_params_with_rotary()):
            return None
        config = attention.config
        if config.no_rope_freq and config.no_rope_freq[attention.layer_number - 1]:
            return None  # Megatron drops the rotary on this layer itself.
        if bound.arguments.get("inference_context") is not None or bound.arguments.get("inference_params"):
            raise NotImplementedError(
                "packed MRoPE supports training/eval forward only, not inference contexts"
            )
        from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
            _yarn_get_concentration_factor_from_config,
        )

        q_freqs, k_freqs = rotary if isinstance(rotary, tuple) else (rotary, rotary)
        fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
        bound.arguments["packed_seq_params"] = _packed_seq_params_with_rotary()(
            **fields,
            rotary_q=q_freqs,
            rotary_k=k_freqs,
            mscale=_yarn_get_concentration_factor_from_config(config),
            original=params,
        )
        bound.arguments["rotary_pos_emb"] = None  # keep Megatron's THD rotary away from per-token freqs
        return bound.args, bound.kwargs

    return hook


def _core_attention_pre_hook(config):
    def hook(core_attention, args, kwargs):
        carrier = _packed_seq_params_with_rotary()
        params = kwargs.get("packed_seq_params")
        if not isinstance(params, carrier):
            if any(isinstance(a, carrier) for a in args):
                raise RuntimeError(
                    "packed MRoPE expects core_attention(..., packed_seq_params=...) as a keyword"
                )
            return None
        query, key, *rest = args
        if params.rotary_q is not None:
            query = apply_rotary_per_token(query, params.rotary_q, config, params.mscale)
        if params.rotary_k is not None:
            key = apply_rotary_per_token(key, params.rotary_k, config, params.mscale)
        return (query, key, *rest), {**kwargs, "packed_seq_params": params.original}

    return hook


def enable_packed_mrope(model: nn.Module | Sequence[nn.Module], mrope_interleaved: bool = False) -> int:
    """Make an MRoPE ``GPTModel`` (or its model chunks, possibly DDP/Float16Module-wrapped) correct on packed
    THD rows, with or without context parallelism. Idempotent; returns how many attention layers it hooked.

    Replaces ``rotary_pos_emb`` with :class:`PackedMultimodalRotaryEmbedding` and adds the two pre-hooks
    (see the module docstring) to every ``Attention`` of the model (MTP layers included). From then on the
    model expects the rank's own MRoPE ids ``[3, 1, T // cp]`` as ``position_ids`` on every pipeline stage.
    ``mrope_interleaved``: Qwen3-VL's frequency-to-axis layout (:func:`mrope_frequencies`).
    Raises ``ValueError`` for a model that is not ``position_embedding_type="mrope"``.
    """
    from megatron.core.transformer.attention import Attention

    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    hooked = 0
    for chunk in chunks:
        gpt = unwrap_model(chunk)
        if getattr(gpt, "position_embedding_type", None) != "mrope" or getattr(
            gpt.config, "multi_latent_attention", False
        ):
            raise ValueError(
                f"enable_packed_mrope needs a GPTModel built with position_embedding_type='mrope' (and no MLA), "
                f"got {type(gpt).__name__} with position_embedding_type="
                f"{getattr(gpt, 'position_embedding_type', None)!r}"
            )
        if not isinstance(gpt.rotary_pos_emb, PackedMultimodalRotaryEmbedding):
            gpt.rotary_pos_emb = PackedMultimodalRotaryEmbedding.from_megatron(gpt.rotary_pos_emb)
        gpt.rotary_pos_emb.mrope_interleaved = mrope_interleaved
        for module in gpt.modules():
            if not isinstance(module, Attention) or getattr(module, _HOOKED, None):
                continue
            signature = inspect.signature(module.forward)
            handles = (
                module.register_forward_pre_hook(_attention_pre_hook(signature), with_kwargs=True),
                module.core_attention.register_forward_pre_hook(
                    _core_attention_pre_hook(module.config), with_kwargs=True
                ),
            )
            setattr(module, _HOOKED, handles)
            hooked += 1
    return hooked
