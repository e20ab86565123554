"""The Hugging Face <-> Megatron-core tensor mapping engine, written once for every family and both ways.

A family declares its mapping as data (``mapping`` of :class:`thdpack.models.family.ModelFamily`): one
:class:`Rule` per Megatron tensor: its name in the built model (alternatives where Megatron's layer specs
differ: the local/torch spec's ``input_layernorm.weight`` is Transformer Engine's fused
``self_attention.linear_qkv.layer_norm_weight``; ``SequentialMLP``'s ``experts.local_experts.{e}.linear_fc1.weight``
is grouped GEMM's ``experts.linear_fc1.weight{e}``), the HF tensors it is made of, and its kind:

- ``replicated``: every tensor-parallel rank holds the whole tensor (norms, the MoE router);
- ``vocab``: rows are vocabulary ids, padded to the model's vocabulary and split on dim 0 over TP (embedding,
  output layer);
- ``qkv``: q, k and v fused per query group g as ``[q heads of g..., k_g, v_g]`` (``head_dim`` rows each), the
  groups stacked and split over TP by whole groups (weights and, for Qwen2, biases);
- ``gated``: ``[gate; up]`` stacked on dim 0, each half split on dim 0 over TP, then stacked again per rank;
- ``row``: split on dim 1 over TP (``linear_proj``, ``linear_fc2``);
- ``column``: split on dim 0 over TP, nothing fused (one value per attention head: gpt-oss's sinks);
- a :class:`Kind` object: a layout of its own (:mod:`thdpack.hf.delta_net_kinds`: gated attention's QKV, gated
  DeltaNet's projections grouped by key head).

Expert tensors split over the expert-tensor-parallel group; an expert-parallel rank holds its own experts,
a pipeline stage its own layers. Facts from Megatron-Bridge (``models/{llama,qwen}/*_bridge.py``,
``models/conversion/param_mapping.py``); the code is thdpack's. Checked against transformers 5.24.0 (CPU) and
5.17 (GPU host).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = [
    "COLUMN",
    "GATED",
    "HF_EXPERT",
    "HF_LAYER",
    "LAYER",
    "QKV",
    "REPLICATED",
    "ROW",
    "VOCAB",
    "Dims",
    "Kind",
    "Match",
    "Rule",
    "Shard",
    "active_rules",
    "expected_hf_names",
    "hf_shapes",
    "layer_types",
    "match_name",
    "megatron_to_hf",
    "to_hf",
    "to_megatron",
]

REPLICATED, VOCAB, QKV, GATED, ROW = "replicated", "vocab", "qkv", "gated", "row"
COLUMN = "column"

# The name prefixes a rule writes its per-layer (per-expert) tensors with.
LAYER = "decoder.layers.{layer}."
HF_LAYER = "model.layers.{layer}."
HF_EXPERT = HF_LAYER + "mlp.experts.{expert}."


class Kind(Protocol):
    """A layout the kinds named by strings do not cover: the three directions of one kind (hashable, compared by
    identity or value), with the arguments and results of :func:`hf_shapes`, :func:`to_megatron` and
    :func:`to_hf`."""

    def hf_shapes(self, local: torch.Size, shard: Shard, dims: Dims) -> list[tuple[int, ...]]: ...

    def to_megatron(
        self, read: Callable[[int, slice, slice], torch.Tensor], local: torch.Size, shard: Shard, dims: Dims
    ) -> torch.Tensor: ...

    def to_hf(self, tensor: torch.Tensor, dims: Dims) -> list[torch.Tensor]: ...


@dataclass(frozen=True)
class Rule:
    """One Megatron tensor. ``megatron``: its names (alternatives, one per layer spec) with ``{layer}`` and
    ``{expert}`` placeholders; ``hf``: the HF tensors it is made of, in order; ``kind``: how they combine and
    split (module docstring); ``when``: ``always``, or ``tied`` / ``untied`` for a tensor that exists with tied
    embeddings or without (:func:`active_rules`); ``layer_type``: in a model whose layers differ, the type of the
    layers that hold it (config.json's ``layer_types``, :func:`layer_types`), None for every layer."""

    megatron: tuple[str, ...]
    hf: tuple[str, ...]
    kind: str | Kind
    when: str = "always"
    layer_type: str | None = None

    @property
    def per_expert(self) -> bool:
        return "{expert}" in self.hf[0]


def active_rules(rules: Iterable[Rule], tied: bool) -> tuple[Rule, ...]:
    """The rules of a model with tied embeddings (``tied``) or not: ``always`` and the matching output layer."""
    on = {"always", "tied" if tied else "untied"}
    return tuple(rule for rule in rules if rule.when in on)


@dataclass(frozen=True)
class Dims:
    """What the fused layouts need: attention heads, query groups, ``head_dim``, and the checkpoint's
    vocabulary (rows past it are Megatron's padding); for gated DeltaNet layers, their key and value heads and
    head sizes (0 in models without them)."""

    heads: int
    groups: int
    head_dim: int
    vocab: int
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0

    @classmethod
    def of(cls, config, vocab: int) -> Dims:
        """The dims of a model built from Megatron's ``TransformerConfig`` ``config``; ``vocab``: config.json's
        ``vocab_size``."""
        linear = {}
        if getattr(config, "experimental_attention_variant", None) == "gated_delta_net":
            linear = dict(
                linear_key_heads=config.linear_num_key_heads,
                linear_value_heads=config.linear_num_value_heads,
                linear_key_dim=config.linear_key_head_dim,
                linear_value_dim=config.linear_value_head_dim,
            )
        return cls(
            config.num_attention_heads,
            config.num_query_groups or config.num_attention_heads,
            config.kv_channels,
            int(vocab),
            **linear,
        )


@dataclass(frozen=True)
class Shard:
    """A tensor-parallel slice: this rank's index and the group's size (the expert-tensor-parallel group for
    expert tensors)."""

    rank: int = 0
    size: int = 1


@dataclass(frozen=True)
class Match:
    """A Megatron tensor name resolved to its rule and its global layer and expert (None where it has none)."""

    rule: Rule
    layer: int | None
    expert: int | None

    @property
    def hf_names(self) -> tuple[str, ...]:
        return tuple(n.format(layer=self.layer, expert=self.expert) for n in self.rule.hf)


def _pattern(name: str) -> re.Pattern:
    escaped = (
        re.escape(name).replace(r"\{layer\}", r"(?P<layer>\d+)").replace(r"\{expert\}", r"(?P<expert>\d+)")
    )
    return re.compile(escaped + r"\Z")


@functools.cache
def _patterns(rule: Rule) -> tuple[re.Pattern, ...]:
    return tuple(_pattern(name) for name in rule.megatron)


def match_name(
    name: str, rules: Iterable[Rule], layer_offset: int = 0, expert_offset: int = 0
) -> Match | None:
    """The rule of the Megatron tensor ``name`` (a local name: layer and expert indices of this rank's chunk,
    shifted by ``layer_offset`` and ``expert_offset`` to the global ones), or None."""
    for rule in rules:
        for pattern in _patterns(rule):
            m = pattern.match(name)
            if m:
                groups = m.groupdict()
                layer = int(groups["layer"]) + layer_offset if "layer" in groups else None
                expert = int(groups["expert"]) + expert_offset if "expert" in groups else None
                return Match(rule, layer, expert)
    return None


def layer_types(config) -> list[str] | None:
    """Each layer's type in a model built from Megatron's ``TransformerConfig`` ``config`` whose layers differ
    (gated DeltaNet models: ``linear_attention_freq`` as a list, 1 = ``linear_attention``, 0 =
    ``full_attention``), None where every layer is alike."""
    freq = getattr(config, "linear_attention_freq", None)
    if freq is None or isinstance(freq, int):
        return None
    return ["linear_attention" if f else "full_attention" for f in freq]


def expected_hf_names(
    rules: Iterable[Rule], num_layers: int, num_experts: int, types: list[str] | None = None
) -> set[str]:
    """Every HF tensor name the model built from ``rules`` is made of; ``types``: each layer's type where the
    layers differ (:func:`layer_types`)."""
    names = set()
    for rule in rules:
        layers = range(num_layers) if "{layer}" in rule.megatron[0] else [None]
        if rule.layer_type is not None and types is not None and layers != [None]:
            layers = [i for i in layers if types[i] == rule.layer_type]
        experts = range(num_experts) if rule.per_expert else [None]
        names.update(n.format(layer=i, expert=e) for n in rule.hf for i in layers for e in experts)
    return names


# ---------------------------------------------------------------------------------------------------------
# HF -> Megatron: this rank's slice, reading only the rows and columns it holds


def hf_shapes(kind: str, local: torch.Size, shard: Shard, dims: Dims) -> list[tuple[int, ...]]:
    """The full shapes the HF tensors of a ``kind`` rule must have, given the shape of this rank's Megatron
    tensor (``local``) and its slice."""
    if not isinstance(kind, str):
        return kind.hf_shapes(local, shard, dims)
    rest = tuple(local[1:])
    if kind == REPLICATED:
        return [tuple(local)]
    if kind == VOCAB:
        return [(dims.vocab, *rest)]
    if kind == ROW:
        return [(local[0], local[1] * shard.size)]
    if kind == COLUMN:
        return [(local[0] * shard.size, *rest)]
    if kind == GATED:
        return [(local[0] // 2 * shard.size, *rest)] * 2
    if kind == QKV:
        q = dims.heads * dims.head_dim
        kv = dims.groups * dims.head_dim
        return [(q, *rest), (kv, *rest), (kv, *rest)]
    raise ValueError(f"unknown mapping kind {kind!r}")


def to_megatron(
    kind: str, read: Callable[[int, slice, slice], torch.Tensor], local: torch.Size, shard: Shard, dims: Dims
) -> torch.Tensor:
    """This rank's Megatron tensor of a ``kind`` rule, of shape ``local``.

    ``read(i, rows, cols)``: rows and columns of the rule's i-th HF tensor (``cols`` is ``slice(None)`` except
    for ``row`` tensors); only these are read from the file."""
    if not isinstance(kind, str):
        return kind.to_megatron(read, local, shard, dims)
    every = slice(None)
    if kind == REPLICATED:
        return read(0, every, every)
    if kind == ROW:
        n = local[1]
        return read(0, every, slice(shard.rank * n, (shard.rank + 1) * n))
    if kind == COLUMN:
        n = local[0]
        return read(0, slice(shard.rank * n, (shard.rank + 1) * n), every)
    if kind == GATED:
        n = local[0] // 2
        rows = slice(shard.rank * n, (shard.rank + 1) * n)
        return torch.cat([read(0, rows, every), read(1, rows, every)])
    if kind == VOCAB:
        n = local[0]
        start, stop = shard.rank * n, min((shard.rank + 1) * n, dims.vocab)
        out = torch.zeros(local, dtype=torch.float32)  # padded rows: never looked up, never predicted
        if stop > start:
            part = read(0, slice(start, stop), every)
            out = out.to(part.dtype)
            out[: stop - start] = part
        return out
    if kind == QKV:
        d, per_group = dims.head_dim, dims.heads // dims.groups
        g = dims.groups // shard.size  # whole query groups on each rank
        g0 = shard.rank * g
        q = read(0, slice(g0 * per_group * d, (g0 + g) * per_group * d), every)
        k = read(1, slice(g0 * d, (g0 + g) * d), every)
        v = read(2, slice(g0 * d, (g0 + g) * d), every)
        rest = tuple(q.shape[1:])
        fused = torch.cat(
            [q.reshape(g, per_group * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)], 1
        )
        return fused.reshape(g * (per_group + 2) * d, *rest)
    raise ValueError(f"unknown mapping kind {kind!r}")


# ---------------------------------------------------------------------------------------------------------
# Megatron -> HF: whole tensors (one rank holding the whole model)


def to_hf(kind: str, tensor: torch.Tensor, dims: Dims) -> list[torch.Tensor]:
    """The HF tensors of a ``kind`` rule from the whole Megatron tensor (no tensor parallelism), in the rule's
    order; views where the layout allows."""
    if not isinstance(kind, str):
        return kind.to_hf(tensor, dims)
    if kind in (REPLICATED, ROW, COLUMN):
        return [tensor]
    if kind == VOCAB:
        return [tensor[: dims.vocab]]
    if kind == GATED:
        return list(tensor.chunk(2))
    if kind == QKV:
        d, per_group = dims.head_dim, dims.heads // dims.groups
        rest = tuple(tensor.shape[1:])
        grouped = tensor.reshape(dims.groups, (per_group + 2) * d, *rest)
        q, k, v = grouped.split([per_group * d, d, d], dim=1)
        return [q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)]
    raise ValueError(f"unknown mapping kind {kind!r}")


def megatron_to_hf(
    state: Mapping[str, torch.Tensor], rules: Iterable[Rule], dims: Dims
) -> dict[str, torch.Tensor]:
    """A whole Megatron state dict (one rank, every layer and expert) as HF tensors. Names without a rule
    (``_extra_state``) are skipped; a tensor name that matches no rule is an error."""
    rules = tuple(rules)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.endswith("_extra_state") or tensor is None:
            continue
        m = match_name(name, rules)
        if m is None:
            raise KeyError(
                f"Megatron tensor '{name}' has no Hugging Face counterpart in the family's mapping"
            )
        for hf_name, part in zip(m.hf_names, to_hf(m.rule.kind, tensor, dims), strict=True):
            out[hf_name] = part
    return out
