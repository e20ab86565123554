"""Two RoPEs in one model, chosen per layer: Gemma 3 rotates its sliding-window layers with a local base
(``rope_parameters.sliding_attention``, theta 10,000) and its full-attention layers with a global one (theta
1,000,000, possibly scaled).

Megatron's ``GPTModel`` computes one rotary embedding per forward and hands it to every layer. Here it computes
both (:class:`LocalGlobalRotaryEmbedding`, which replaces ``gpt.rotary_pos_emb``) as a :class:`LocalGlobal` pair,
and each layer's attention (:class:`LocalGlobalRopeSelfAttention`) takes the one of its kind: local in the layers
with a sliding window (Megatron's ``is_layer_window_attention``: ``window_size`` and ``window_attn_skip_freq``),
global in the others. Both are Megatron ``RotaryEmbedding`` modules, so packed rows (positions restarting at
every sample) and context parallelism rotate as Megatron's RoPE does.

    use_local_global_rope(gpt, local_inv_freq, global_inv_freq)
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.utils import is_layer_window_attention

__all__ = [
    "LocalGlobal",
    "LocalGlobalRopeSelfAttention",
    "LocalGlobalRotaryEmbedding",
    "use_local_global_rope",
]


class LocalGlobal(NamedTuple):
    """The rotary embeddings of one forward: for the sliding-window layers and for the full-attention ones."""

    local: torch.Tensor
    global_: torch.Tensor


class LocalGlobalRotaryEmbedding(torch.nn.Module):
    """``GPTModel.rotary_pos_emb`` giving a :class:`LocalGlobal` pair: ``global_rope`` (the model's own) and
    ``local_rope``, called with the same arguments."""

    def __init__(self, global_rope: RotaryEmbedding, local_rope: RotaryEmbedding):
        super().__init__()
        self.global_rope, self.local_rope = global_rope, local_rope

    def get_rotary_seq_len(self, *args, **kwargs) -> int:
        return self.global_rope.get_rotary_seq_len(*args, **kwargs)

    def forward(self, *args, **kwargs) -> LocalGlobal:
        return LocalGlobal(self.local_rope(*args, **kwargs), self.global_rope(*args, **kwargs))


class LocalGlobalRopeSelfAttention(SelfAttention):
    """Megatron's ``SelfAttention`` taking the local embedding of a :class:`LocalGlobal` pair in a sliding-window
    layer and the global one elsewhere."""

    def forward(self, *args, rotary_pos_emb=None, **kwargs):
        if isinstance(rotary_pos_emb, LocalGlobal):
            window = self.config.window_size, self.config.window_attn_skip_freq, self.layer_number
            rotary_pos_emb = (
                rotary_pos_emb.local if is_layer_window_attention(*window) else rotary_pos_emb.global_
            )
        return super().forward(*args, rotary_pos_emb=rotary_pos_emb, **kwargs)


def use_local_global_rope(gpt, local_inv_freq: torch.Tensor, global_inv_freq: torch.Tensor) -> None:
    """Give ``gpt`` (a ``GPTModel`` chunk with RoPE, its attention :class:`LocalGlobalRopeSelfAttention`) the two
    rotations: its own ``RotaryEmbedding`` with ``global_inv_freq``, a second one with ``local_inv_freq`` (each
    ``[head_dim / 2]``, float32)."""
    rope = gpt.rotary_pos_emb
    if isinstance(rope, LocalGlobalRotaryEmbedding):
        rope = rope.global_rope
    local = RotaryEmbedding(
        kv_channels=rope.inv_freq.numel() * 2,
        rotary_percent=1.0,
        rotary_interleaved=rope.rotary_interleaved,
        use_cpu_initialization=True,
        cp_group=rope.cp_group,
    )
    rope.inv_freq = global_inv_freq.to(rope.inv_freq.device)
    local.inv_freq = local_inv_freq.to(rope.inv_freq.device)
    RotaryEmbedding.forward.cache_clear()  # an lru_cache over (module, lengths): the frequencies changed
    gpt.rotary_pos_emb = LocalGlobalRotaryEmbedding(rope, local)
