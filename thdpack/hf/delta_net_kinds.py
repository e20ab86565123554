"""Mapping kinds (:class:`thdpack.hf.mapping.Kind`) of gated attention and gated DeltaNet layers (Qwen3.5).

Each Megatron tensor is laid out so that tensor parallelism splits it into contiguous, whole groups of heads:
a rank's slice is its heads' rows, and the tensor a checkpoint stores is the same whatever the TP size.

- :data:`GATED_QKV`: transformers' ``q_proj`` holds, per query head, its ``head_dim`` query rows then its
  ``head_dim`` output-gate rows; Megatron's ``linear_qkv`` with ``attention_output_gate`` holds, per query
  group, its query heads, their gates, then the group's key and value (``SelfAttention.get_query_key_value_tensors``
  in megatron-core 0.16.1).
- :class:`KeyHeadGroups`: transformers' gated DeltaNet stores each projection whole (``in_proj_qkv``: every
  query head, then every key head, then every value head; ``in_proj_z``, ``in_proj_b``, ``in_proj_a``,
  ``conv1d``); thdpack's layer (:class:`thdpack.megatron.gated_delta_net.GatedDeltaNet`) groups them by key head:
  key head ``j`` with the ``r = value heads / key heads`` value heads it serves (transformers' grouped value
  attention repeats key head ``j`` for value heads ``j*r .. j*r + r-1``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .mapping import Dims, Shard

__all__ = ["CONV", "GATED_QKV", "IN_PROJ", "VALUE_HEADS", "GatedQKV", "KeyHeadGroups"]

_EVERY = slice(None)


@dataclass(frozen=True)
class GatedQKV:
    """``q_proj`` ``[heads * 2 * head_dim, ...]`` (per head: query, gate), ``k_proj``, ``v_proj`` <-> Megatron's
    gated ``linear_qkv``: per query group ``[its queries, their gates, key, value]``, split over TP by groups."""

    def hf_shapes(self, local: torch.Size, shard: Shard, dims: Dims) -> list[tuple[int, ...]]:
        rest = tuple(local[1:])
        kv = (dims.groups * dims.head_dim, *rest)
        return [(2 * dims.heads * dims.head_dim, *rest), kv, kv]

    def to_megatron(
        self, read: Callable[[int, slice, slice], torch.Tensor], local: torch.Size, shard: Shard, dims: Dims
    ) -> torch.Tensor:
        d, per = dims.head_dim, dims.heads // dims.groups
        g = dims.groups // shard.size
        g0 = shard.rank * g
        q_gate = read(0, slice(g0 * per * 2 * d, (g0 + g) * per * 2 * d), _EVERY)
        rest = tuple(q_gate.shape[1:])
        q_gate = q_gate.reshape(g, per, 2, d, *rest)
        k = read(1, slice(g0 * d, (g0 + g) * d), _EVERY).reshape(g, d, *rest)
        v = read(2, slice(g0 * d, (g0 + g) * d), _EVERY).reshape(g, d, *rest)
        query = q_gate[:, :, 0].reshape(g, per * d, *rest)
        gate = q_gate[:, :, 1].reshape(g, per * d, *rest)
        return torch.cat([query, gate, k, v], 1).reshape(g * (2 * per + 2) * d, *rest)

    def to_hf(self, tensor: torch.Tensor, dims: Dims) -> list[torch.Tensor]:
        d, per = dims.head_dim, dims.heads // dims.groups
        rest = tuple(tensor.shape[1:])
        grouped = tensor.reshape(dims.groups, (2 * per + 2) * d, *rest)
        query, gate, k, v = grouped.split([per * d, per * d, d, d], dim=1)
        q_gate = torch.stack(
            [query.reshape(dims.groups, per, d, *rest), gate.reshape(dims.groups, per, d, *rest)], 2
        )
        return [q_gate.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)]


@dataclass(frozen=True)
class KeyHeadGroups:
    """HF tensors made of sections that each hold one block per key head, in key-head order <-> a Megatron
    tensor holding, per key head, its block of every section (of every HF tensor, in order); split over TP by
    key heads.

    ``parts``: per HF tensor, its sections on dim 0, by size: ``"qk"`` (key heads x key head dim: queries or
    keys), ``"v"`` (value heads x value head dim), ``"heads"`` (one row per value head)."""

    parts: tuple[tuple[str, ...], ...]

    def _sections(self, dims: Dims) -> list[list[int]]:
        size = {
            "qk": dims.linear_key_heads * dims.linear_key_dim,
            "v": dims.linear_value_heads * dims.linear_value_dim,
            "heads": dims.linear_value_heads,
        }
        return [[size[s] for s in part] for part in self.parts]

    def hf_shapes(self, local: torch.Size, shard: Shard, dims: Dims) -> list[tuple[int, ...]]:
        return [(sum(sections), *local[1:]) for sections in self._sections(dims)]

    def to_megatron(
        self, read: Callable[[int, slice, slice], torch.Tensor], local: torch.Size, shard: Shard, dims: Dims
    ) -> torch.Tensor:
        heads = dims.linear_key_heads
        g = heads // shard.size
        g0 = shard.rank * g
        rest = tuple(local[1:])
        blocks = []
        for i, sections in enumerate(self._sections(dims)):
            start = 0
            for size in sections:
                block = size // heads
                rows = slice(start + g0 * block, start + (g0 + g) * block)
                blocks.append(read(i, rows, _EVERY).reshape(g, block, *rest))
                start += size
        return torch.cat(blocks, 1).reshape(-1, *rest)

    def to_hf(self, tensor: torch.Tensor, dims: Dims) -> list[torch.Tensor]:
        heads = dims.linear_key_heads
        rest = tuple(tensor.shape[1:])
        sections = self._sections(dims)
        blocks = tensor.reshape(heads, -1, *rest).split(
            [s // heads for part in sections for s in part], dim=1
        )
        out, b = [], 0
        for part in sections:
            out.append(torch.cat([blocks[b + j].reshape(-1, *rest) for j in range(len(part))]))
            b += len(part)
        return out


GATED_QKV = GatedQKV()
# in_proj <- in_proj_qkv [queries; keys; values], in_proj_z, in_proj_b (beta), in_proj_a (decay)
IN_PROJ = KeyHeadGroups((("qk", "qk", "v"), ("v",), ("heads",), ("heads",)))
# the short convolution's channels: the queries, keys and values of in_proj_qkv
CONV = KeyHeadGroups((("qk", "qk", "v"),))
# one value per value head (A_log, dt_bias)
VALUE_HEADS = KeyHeadGroups((("heads",),))
