"""LoRA on megatron-core's parallel linear layers: a low-rank branch beside each adapted layer, the base frozen.

    targets = [LoRATarget("decoder.layers.0.self_attention.linear_qkv", QKV, ("q_proj", None, "v_proj")), ...]
    adapters = add_lora(gpt, targets, LoRASettings(rank=16, alpha=32), config)   # after the weights are loaded
    freeze_base(gpt)                                                              # before wrap_model

The branch of a layer ``y = W x`` adds ``scale * B (A x)`` (``scale = alpha / rank``, or ``alpha / sqrt(rank)`` with
rsLoRA), PEFT's LoRA. A fused layer holds several Hugging Face modules (its *parts*): the QKV layer q, k and v, the
gated MLP's first layer gate and up. Each adapted part keeps its own ``A [rank, in]`` and ``B [rows, rank]``; on the
fused layer they act as the A's stacked (one GEMM) and the B's block-diagonal over the output rows, placed where
the fused layout puts each part: QKV per query group ``[q heads of g..., k_g, v_g]``, the gated layer ``[gate; up]``.
A part without an adapter contributes zeros.

Tensor parallelism follows the base layer. A column-parallel layer (QKV, gated) keeps A whole and B split on its
rows (each rank's B rows are the rows of its output slice: whole query groups, its slice of gate and of up); the
rank's ``A x`` (``[tokens, parts x rank]``) is all-reduced in the backward (without sequence parallelism) or
all-gathered over the sequence (with it: the input is this rank's tokens, and A's gradient, a sum over every rank's
tokens, is all-reduced over TP by megatron-core's ``finalize_model_grads`` as for the norms: ``sequence_parallel``
is set on it). A row-parallel layer (``linear_proj``, ``linear_fc2``) splits A on its input columns and keeps B
whole; ``A x`` is all-reduced (reduce-scattered over the sequence with sequence parallelism, B's gradient then
summed over TP as above). Only ``rank``-wide activations cross ranks.

Transformer Engine's fused norm + linear (``TELayerNormColumnParallelLinear``) returns its norm's output beside its
own (``return_layernorm_output``: in high precision, also under FP8, which then leaves the fused norm + cast) and
the branch takes it: the norm stays fused with the base GEMM. The branch's GEMMs are torch's, outside Transformer
Engine's FP8 autocast: FP8 base GEMMs, bf16 adapters.

The branch hangs on the base layer's forward hook; its module sits beside the base layer as ``<base>_lora``
(``self_attention.linear_qkv_lora.lora_A.q_proj``), so the base layer's own names, state dict and checkpoint layout
(Megatron's swiglu factory on ``linear_fc1``) are untouched. Only adapter parameters require gradients: megatron-core's
DDP gives the frozen base no gradient buffer, and its distributed optimizer neither fp32 main copies nor Adam state.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .distributed import run_forward_pre_hooks

__all__ = [
    "ADAPTER_SUFFIX",
    "GATED",
    "QKV",
    "ROW",
    "LoRAAdapter",
    "LoRASettings",
    "LoRATarget",
    "add_lora",
    "adapter_modules",
    "freeze_base",
    "is_adapter_name",
    "trainable_state",
]

QKV, GATED, ROW = "qkv", "gated", "row"  # the layouts of thdpack.hf.mapping of the same names
PARTS = {QKV: 3, GATED: 2, ROW: 1}
ADAPTER_SUFFIX = "_lora"  # the adapter module of base layer `linear_qkv` is its sibling `linear_qkv_lora`


def is_adapter_name(name: str) -> bool:
    """Whether a parameter or checkpoint name is a LoRA adapter's (``....lora_A.<part>`` / ``lora_B``)."""
    return ".lora_A." in name or ".lora_B." in name


@dataclass(frozen=True)
class LoRASettings:
    """The adapters' hyperparameters: ``rank`` (r), ``alpha`` (lora_alpha), ``dropout`` on the branch's input,
    ``rslora`` (scale ``alpha / sqrt(rank)`` instead of ``alpha / rank``), ``seed`` (A's initialisation, per part:
    :meth:`LoRAAdapter.initialize`)."""

    rank: int
    alpha: float
    dropout: float = 0.0
    rslora: bool = False
    seed: int = 0

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


@dataclass(frozen=True)
class LoRATarget:
    """One base layer to adapt. ``module``: its path in the ``GPTModel`` chunk (this rank's layer numbering);
    ``layout``: :data:`QKV`, :data:`GATED` or :data:`ROW`; ``parts``: the name of each part in the layout's order
    (q, k, v; gate, up; the one), None for a part left without adapter; ``keys``: a stable global name per part
    (the Hugging Face module path), which seeds its initialisation whatever the layout."""

    module: str
    layout: str
    parts: tuple[str | None, ...]
    keys: tuple[str | None, ...]

    def __post_init__(self):
        if (
            self.layout not in PARTS
            or len(self.parts) != PARTS[self.layout]
            or len(self.keys) != len(self.parts)
        ):
            raise ValueError(f"LoRA target {self.module}: layout {self.layout!r} with parts {self.parts}")
        if not any(self.parts):
            raise ValueError(f"LoRA target {self.module}: no part to adapt")


def _tp() -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


class LoRAAdapter(nn.Module):
    """The LoRA branch of one base layer (:class:`LoRATarget`), this tensor-parallel rank's slice of it.

    ``lora_A[part]``: ``[rank, in]`` (column-parallel base) or ``[rank, in / tp]`` (row-parallel);
    ``lora_B[part]``: ``[rows / tp, rank]`` (column-parallel) or ``[out, rank]`` (row-parallel). Called on the
    base layer's input (or its fused norm's output) ``[s, b, in]``, it returns what to add to the base output."""

    def __init__(self, base: nn.Module, target: LoRATarget, settings: LoRASettings, config):
        super().__init__()
        self.layout, self.parts, self.keys = target.layout, target.parts, target.keys
        self.column = target.layout != ROW
        self.settings = settings
        self.scale = settings.scale
        self.sequence_parallel = bool(config.sequence_parallel)
        self.tp_rank, self.tp_size = _tp()
        out_local, in_local = base.weight.shape
        rank = settings.rank
        if self.layout == QKV:
            heads, groups = config.num_attention_heads, config.num_query_groups or config.num_attention_heads
            self.head_dim, self.per_group = config.kv_channels, heads // groups
            self.groups_local = groups // self.tp_size
            rows = [self.groups_local * self.per_group * self.head_dim] + [
                self.groups_local * self.head_dim
            ] * 2
        elif self.layout == GATED:
            rows = [out_local // 2] * 2
        else:
            rows = [out_local]
        if sum(rows) != out_local:
            raise ValueError(
                f"{target.module}: {out_local} output rows, but the {self.layout} layout gives {rows}"
            )
        self.rows = rows
        dtype, device = base.weight.dtype, base.weight.device
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()
        for part, n in zip(self.parts, rows, strict=True):
            if part is None:
                continue
            self.lora_A[part] = nn.Parameter(torch.zeros(rank, in_local, dtype=dtype, device=device))
            self.lora_B[part] = nn.Parameter(torch.zeros(n, rank, dtype=dtype, device=device))
        self.dropout = nn.Dropout(settings.dropout) if settings.dropout else None
        from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

        split, whole = (self.lora_B, self.lora_A) if self.column else (self.lora_A, self.lora_B)
        for param in split.values():
            set_tensor_model_parallel_attributes(param, True, 0 if self.column else 1, 1)
        for param in whole.values():
            # Each rank's gradient of a whole tensor sums over its own tokens only under sequence parallelism:
            # megatron-core's finalize_model_grads all-reduces such parameters over TP, as it does the norms'.
            param.sequence_parallel = self.sequence_parallel and self.tp_size > 1

    # ------------------------------------------------------------------------------------------- weights

    def _local(self, tensor: torch.Tensor, which: str) -> torch.Tensor:
        """This rank's slice of a whole A or B (``which``) of one part."""
        if self.tp_size == 1:
            return tensor
        if which == "B" and self.column:
            return tensor.chunk(self.tp_size, dim=0)[self.tp_rank]
        if which == "A" and not self.column:
            return tensor.chunk(self.tp_size, dim=1)[self.tp_rank]
        return tensor

    def full_shape(self, part: str, which: str) -> tuple[int, int]:
        """The whole (all TP ranks) shape of a part's A or B: PEFT's ``lora_A`` / ``lora_B`` weight."""
        local = tuple((self.lora_A if which == "A" else self.lora_B)[part].shape)
        if which == "B" and self.column:
            return local[0] * self.tp_size, local[1]
        if which == "A" and not self.column:
            return local[0], local[1] * self.tp_size
        return local

    @torch.no_grad()
    def load_whole(self, part: str, a: torch.Tensor, b: torch.Tensor) -> None:
        """Set a part's A and B from the whole tensors (PEFT's ``lora_A.weight`` ``[rank, in]`` and ``lora_B.weight``
        ``[rows, rank]``): this rank keeps its slice."""
        for which, tensor in (("A", a), ("B", b)):
            param = (self.lora_A if which == "A" else self.lora_B)[part]
            want = self.full_shape(part, which)
            if tuple(tensor.shape) != want:
                raise ValueError(
                    f"lora_{which} of '{part}' is {list(tensor.shape)}; the model needs {list(want)}"
                )
            param.copy_(self._local(tensor, which))

    @torch.no_grad()
    def initialize(self, seed: int) -> None:
        """PEFT's default initialisation: A Kaiming-uniform (``a = sqrt(5)``: uniform in ``+-1/sqrt(in)``), B zero.
        Each part's whole A is drawn from a generator seeded by ``seed`` and its key, then sliced: the same
        adapters under every parallel layout."""
        for part, key in zip(self.parts, self.keys, strict=True):
            if part is None:
                continue
            shape = self.full_shape(part, "A")
            generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(str(key).encode()))
            bound = 1.0 / math.sqrt(shape[1])
            a = (torch.rand(shape, generator=generator, dtype=torch.float64) * 2 - 1) * bound
            b = torch.zeros(self.full_shape(part, "B"))
            self.load_whole(part, a.to(self.lora_A[part].dtype), b)

    # ------------------------------------------------------------------------------------------- forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core import tensor_parallel as tpm

        # A and B live in ParameterDicts that are read, not called: their hooks (the overlapped all-gather) here
        run_forward_pre_hooks(self.lora_A, x)
        run_forward_pre_hooks(self.lora_B, x)
        names = [p for p in self.parts if p is not None]
        a = self.lora_A[names[0]] if len(names) == 1 else torch.cat([self.lora_A[p] for p in names])
        if self.dropout is not None:
            x = self._dropout(x)
        h = F.linear(x, a) * self.scale  # [s, b, parts x rank]
        sp = self.sequence_parallel and self.tp_size > 1
        if self.column:
            h = (
                tpm.gather_from_sequence_parallel_region(h)
                if sp
                else tpm.copy_to_tensor_model_parallel_region(h)
            )
            outs = dict(zip(names, h.chunk(len(names), dim=-1), strict=True))
            return self._assemble({p: F.linear(outs[p], self.lora_B[p]) for p in names}, h.shape[:-1])
        h = (
            tpm.reduce_scatter_to_sequence_parallel_region(h)
            if sp
            else tpm.reduce_from_tensor_model_parallel_region(h)
        )
        return F.linear(h, self.lora_B[names[0]])

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        # An input that differs across TP ranks (a row-parallel slice, sequence-parallel tokens) draws its own mask
        # on each rank (Megatron's tensor-parallel stream); a replicated one the same mask everywhere.
        if not self.column or (self.sequence_parallel and self.tp_size > 1):
            from megatron.core.tensor_parallel import get_cuda_rng_tracker

            with get_cuda_rng_tracker().fork():
                return self.dropout(x)
        return self.dropout(x)

    def _assemble(self, outs: dict[str, torch.Tensor], lead: torch.Size) -> torch.Tensor:
        """The parts' outputs at their rows of the fused layout (zeros for a part without adapter)."""

        def part(i: int, n: int) -> torch.Tensor:
            name = self.parts[i]
            if name is not None:
                return outs[name]
            ref = next(iter(outs.values()))
            return ref.new_zeros(*lead, n)

        if self.layout == GATED:
            return torch.cat([part(0, self.rows[0]), part(1, self.rows[1])], dim=-1)
        if self.layout == ROW:
            return part(0, self.rows[0])
        g = self.groups_local
        q = part(0, self.rows[0]).reshape(*lead, g, self.per_group * self.head_dim)
        k = part(1, self.rows[1]).reshape(*lead, g, self.head_dim)
        v = part(2, self.rows[2]).reshape(*lead, g, self.head_dim)
        return torch.cat([q, k, v], dim=-1).reshape(*lead, sum(self.rows))

    # ------------------------------------------------------------------------------------------- checkpoints

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """The adapter's tensors for Megatron's distributed checkpoint: each at its whole (PEFT) shape, TP-split
        where the rank holds a slice, the layer offsets of the block prepended."""
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.utils import (
            ensure_metadata_has_dp_cp_group,
            make_sharded_tensors_for_checkpoint,
        )

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        state = self.state_dict(prefix="", keep_vars=True)
        which, axis = ("lora_B", 0) if self.column else ("lora_A", 1)
        split = {name: axis for name in state if name.startswith(which + ".")}
        return make_sharded_tensors_for_checkpoint(
            state,
            prefix,
            split,
            sharded_offsets,
            tp_group=ps.get_tensor_model_parallel_group(),
            dp_cp_group=metadata["dp_cp_group"],
        )


def _with_adapter(adapter: LoRAAdapter):
    """The base layer's forward hook: its output plus the branch's, in each of the output forms of megatron-core's
    linear layers (``(out, bias)``; a fused norm's ``((out, norm_out), bias)`` or ``(out, bias, norm_out)``)."""

    def hook(module, args, output):
        x = args[0]
        if len(output) == 3:
            out, bias, x = output
        else:
            out, bias = output
            if isinstance(out, tuple):
                out, x = out
        return out + adapter(x).to(out.dtype), bias

    return hook


def _before_post_norm(base: nn.Module, adapter: LoRAAdapter) -> None:
    """A projection followed by its own output norm (``post_layernorm``: Gemma 3's sandwich norms,
    :mod:`thdpack.megatron.post_norm`) returns the norm of its output: the branch joins the projection's output
    before that norm, as PEFT's branch joins ``o_proj``'s before transformers' ``post_attention_layernorm``."""
    inputs = {}

    def keep_input(module, args):
        inputs["x"] = args[0]

    def add_branch(module, args):
        out = args[0]
        return (out + adapter(inputs.pop("x")).to(out.dtype), *args[1:])

    base.register_forward_pre_hook(keep_input)
    base.post_layernorm.register_forward_pre_hook(add_branch)


def add_lora(
    gpt: nn.Module, targets: Iterable[LoRATarget], settings: LoRASettings, config
) -> list[LoRAAdapter]:
    """Give every target layer of ``gpt`` (a ``GPTModel`` chunk, weights loaded, not yet wrapped) its LoRA
    branch, initialised (:meth:`LoRAAdapter.initialize`). Returns the adapters, in the order of ``targets``."""
    adapters = []
    for target in targets:
        base = gpt.get_submodule(target.module)
        parent_path, _, name = target.module.rpartition(".")
        parent = gpt.get_submodule(parent_path)
        if hasattr(parent, name + ADAPTER_SUFFIX):
            raise ValueError(f"{target.module} has a LoRA adapter already")
        # Transformer Engine's norm + linear returns its norm's output too: the branch takes it
        if hasattr(base, "return_layernorm_output"):
            base.return_layernorm_output = True
            base.return_layernorm_output_gathered = False  # this rank's tokens under sequence parallelism
        adapter = LoRAAdapter(base, target, settings, config)
        adapter.initialize(settings.seed)
        setattr(parent, name + ADAPTER_SUFFIX, adapter)
        if isinstance(getattr(base, "post_layernorm", None), nn.Module):
            _before_post_norm(base, adapter)
        else:
            base.register_forward_hook(_with_adapter(adapter))
        adapters.append(adapter)
    if config.recompute_granularity == "full" and getattr(gpt, "pre_process", False):
        _decoder_input_requires_grad(gpt)
    return adapters


def _decoder_input_requires_grad(gpt) -> None:
    """With a frozen embedding the first stage's decoder input needs no gradient, and megatron-core's recomputed
    layers (a ``torch.autograd.Function`` of their inputs) would then never run their backward: the adapters inside
    would get no gradient. A leaf input is made to require one (it has no graph upstream to cut)."""

    def pre_hook(module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        if isinstance(hidden, torch.Tensor) and not hidden.requires_grad and hidden.is_floating_point():
            hidden = hidden.detach().requires_grad_(True)
            if "hidden_states" in kwargs:
                kwargs["hidden_states"] = hidden
            else:
                args = (hidden, *args[1:])
        return args, kwargs

    gpt.decoder.register_forward_pre_hook(pre_hook, with_kwargs=True)


def adapter_modules(module: nn.Module) -> list[tuple[str, LoRAAdapter]]:
    """``(path, adapter)`` of every LoRA adapter in ``module``."""
    return [(name, m) for name, m in module.named_modules() if isinstance(m, LoRAAdapter)]


def freeze_base(module: nn.Module) -> int:
    """Every parameter of ``module`` that is no adapter's stops requiring gradients (megatron-core's DDP then
    gives it no gradient buffer, its optimizer no state). Returns the number of trainable parameters left."""
    for name, param in module.named_parameters():
        param.requires_grad_(is_adapter_name("." + name))
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def trainable_state(sharded: dict, module: nn.Module) -> dict:
    """A model's sharded state dict without its frozen parameters: what a LoRA run's checkpoint holds (adapters,
    buffers, Transformer Engine's extra state); the base comes from the run's Hugging Face directory."""
    frozen = {id(p) for p in module.parameters() if not p.requires_grad}

    def keep(value) -> bool:
        data = getattr(value, "data", None)
        return not (isinstance(data, torch.Tensor) and id(data) in frozen)

    return {k: v for k, v in sharded.items() if keep(v)}


def check_loaded_keys(
    missing: Sequence[str], unexpected: Sequence[str], module: nn.Module, where: str
) -> None:
    """After ``load_state_dict(strict=False)`` of a LoRA checkpoint: every key the checkpoint lacks must be a frozen
    parameter of ``module``, and it may hold none the model lacks."""
    frozen = {name for name, p in module.named_parameters() if not p.requires_grad}
    lacking = sorted(set(missing) - frozen)
    if lacking or unexpected:
        raise ValueError(
            f"{where}: the checkpoint does not fit this run's adapters"
            + (f"; it lacks {lacking[:6]}" if lacking else "")
            + (f"; it holds {sorted(unexpected)[:6]} which this model has not" if unexpected else "")
            + " (same peft settings and model as the run that saved it?)"
        )
