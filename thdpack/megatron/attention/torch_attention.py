"""THD core attention in plain PyTorch, as a Megatron-core `core_attention` submodule.

Megatron-core's own `DotProductAttention` asserts `packed_seq_params is None`; TE's
`TEDotProductAttention` needs a GPU and Transformer Engine. `TorchTHDAttention` takes Megatron's
arguments and serves both paths:

- THD (`packed_seq_params.qkv_format == "thd"`): Megatron squeezes the dummy batch dim, so q is
  `[T, Hq, D]` and k, v are `[T, Hkv, D]` (heads per TP partition); we return `[T, Hq*D]` like TE.
  Sample `i` owns physical rows `[cu_seqlens_padded[i], cu_seqlens_padded[i+1])`; its first
  `cu_seqlens[i+1] - cu_seqlens[i]` rows are real tokens, the rest is alignment pad whose output is
  exactly zero (TE writes zeros there too). Attention is causal within each sample.
- BSHD (`packed_seq_params is None`): q is `[S, B, Hq, D]`, k, v `[S, B, Hkv, D]`; returns
  `[S, B, Hq*D]`, causal, plus Megatron's optional boolean `attention_mask` (True = masked out).

The THD kernel, `attend_thd`, is callable on its own. Backends, first that applies:
`torch.nn.attention.varlen.varlen_attn` (CUDA, fp16/bf16, no CP), flash-attn's
`flash_attn_varlen_func` (same), an exact per-sample SDPA loop over host boundaries (always on CPU),
and a dense masked SDPA that needs no host values (CUDA fallback, O(T^2) memory).

Context parallelism: the local rows are this rank's zigzag shard, as
`thdpack.packing.context_parallel.cp_partition_indices` gives it (TE's `thd_get_partitioned_indices`). K and V
are all-gathered across the CP group with autograd, put back in global order, and every local query
attends by its global position.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor

from thdpack.megatron.packed_seq_params import THDPackedSeqParams
from thdpack.packing.context_parallel import cp_partition_indices

from .window_sink import causal_window_mask, sdpa_with_sinks

Boundaries = Tensor | Sequence[int]
BACKENDS = ("auto", "varlen", "flash", "sdpa", "dense")

_CAUSAL_TYPES = (AttnMaskType.causal, AttnMaskType.padding_causal)


# --------------------------------------------------------------------------------------------
# Context-parallel helpers
# --------------------------------------------------------------------------------------------


class _AllGatherRows(torch.autograd.Function):
    """All-gather along dim 0 (rank-major); backward sums every rank's grad back to the owner.

    Uses `all_gather` + `all_reduce` + slicing so it runs on gloo (which has no reduce-scatter);
    NCCL gets `reduce_scatter_tensor`.
    """

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(torch.distributed.get_world_size(group))]
        torch.distributed.all_gather(parts, x, group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: Tensor):
        group = ctx.group
        world = torch.distributed.get_world_size(group)
        rank = torch.distributed.get_rank(group)
        n = grad.shape[0] // world
        if torch.distributed.get_backend(group) == "nccl":
            out = grad.new_empty((n, *grad.shape[1:]))
            torch.distributed.reduce_scatter_tensor(out, grad.contiguous(), group=group)
            return out, None
        grad = grad.contiguous().clone()
        torch.distributed.all_reduce(grad, group=group)
        return grad[rank * n : (rank + 1) * n], None


def all_gather_rows(x: Tensor, group) -> Tensor:
    """`[n, ...]` on each rank -> `[world*n, ...]` rank-major, differentiable (grad summed to owner)."""
    return _AllGatherRows.apply(x, group)


# --------------------------------------------------------------------------------------------
# Boundaries
# --------------------------------------------------------------------------------------------


def _host_list(x: Boundaries | None) -> list[int] | None:
    if x is None:
        return None
    if isinstance(x, Tensor):
        if x.device.type != "cpu":
            return None  # reading it would stall the GPU; callers fall back to sync-free paths
        return x.tolist()
    return [int(v) for v in x]


def _as_device(x: Boundaries, device: torch.device) -> Tensor:
    if isinstance(x, Tensor):
        return x.to(device=device, dtype=torch.int32, non_blocking=True)
    return torch.tensor(list(x), dtype=torch.int32).to(device, non_blocking=True)


def _check_host(cu: list[int], cup: list[int], local_rows: int, cp_size: int) -> None:
    """Validate host boundaries, vectorized (this runs in every attention layer)."""
    if len(cu) != len(cup) or len(cu) < 2:
        raise ValueError(
            f"cu_seqlens has {len(cu)} entries and cu_seqlens_padded {len(cup)}: both must be "
            "[N+1] boundaries of the same N samples"
        )
    n, phys = np.diff(cu), np.diff(cup)
    bad = (n < 0) | (n > phys)
    if bad.any():
        i = int(bad.argmax())
        raise ValueError(
            f"sample {i} has {n[i]} real tokens in a physical segment of {phys[i]} rows "
            f"(cu_seqlens={cu[i]}..{cu[i + 1]}, cu_seqlens_padded={cup[i]}..{cup[i + 1]}): "
            "real length must be between 0 and the padded length"
        )
    if cp_size > 1 and (phys % (2 * cp_size)).any():
        i = int((phys % (2 * cp_size) != 0).argmax())
        raise ValueError(
            f"sample {i} has physical length {phys[i]}, not divisible by 2*cp={2 * cp_size}: "
            "context parallelism needs every cu_seqlens_padded segment aligned to 2*cp"
        )
    if cp_size > 1 and local_rows * cp_size != cup[-1]:
        raise ValueError(
            f"{local_rows} local rows x cp={cp_size} != cu_seqlens_padded[-1]={cup[-1]}: under context "
            "parallelism the padded boundaries must cover the whole (global) row"
        )
    if cp_size == 1 and cup[-1] > local_rows:
        raise ValueError(f"cu_seqlens_padded[-1]={cup[-1]} exceeds the {local_rows} rows of query")


@functools.lru_cache(maxsize=4)
def _cp_gather_order(cup: tuple[int, ...], cp_size: int, device: torch.device) -> Tensor:
    """Global row of every rank-major all-gathered row: TE's partition of each rank, concatenated.

    Every attention layer of a micro-batch asks for the same one, so it is built once per boundaries and sent
    to the device from pinned memory (a pageable copy would first wait for the GPU to drain).
    """
    order = torch.cat([_cp_local_rows(cup, cp_size, r) for r in range(cp_size)])
    if device.type == "cuda":
        order = order.pin_memory()
    return order.to(device, non_blocking=True)


@functools.lru_cache(maxsize=8)
def _cp_local_rows(cup: tuple[int, ...], cp_size: int, cp_rank: int) -> Tensor:
    """Host int64 ``[T / cp]``: the global row of each of rank ``cp_rank``'s local rows (all rows without CP)."""
    return cp_partition_indices(torch.tensor(cup, dtype=torch.int64), cp_size, cp_rank)


def _real_rows(gidx: Tensor, cu: Tensor, cup: Tensor) -> Tensor:
    """Bool `[len(gidx)]`: True where a global row is a real token (sync-free)."""
    cu, cup = cu.to(torch.int64), cup.to(torch.int64)
    seg = torch.searchsorted(cup[1:], gidx, right=True)
    inside = seg < cup.numel() - 1
    seg = seg.clamp_max(cup.numel() - 2)
    return inside & (gidx - cup[seg] < cu[seg + 1] - cu[seg])


def _expand_kv(x: Tensor, groups: int, dim: int) -> Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=dim)


# --------------------------------------------------------------------------------------------
# Backends
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _torch_varlen():
    """`(varlen_attn, its parameter names)` or None when this torch has no varlen attention."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def _varlen_takes(window: int | None, sinks: Tensor | None) -> bool:
    """Whether this torch's `varlen_attn` computes the attention asked for (it has no sinks, and older torch no
    window)."""
    found = _torch_varlen()
    return found is not None and sinks is None and (window is None or "window_size" in found[1])


@functools.lru_cache(maxsize=1)
def _flash_attn_varlen():
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def _import_flash_attn_varlen():
    fn = _flash_attn_varlen()
    if fn is None:
        raise ImportError("backend='flash' needs flash-attn: install it with `pip install thdpack[flash]`")
    return fn


def _attend_varlen(q, k, v, cu_padded, max_seqlen, scale, dropout_p, kernel, window=None):
    """One varlen call over the *physical* segments (pad folded in).

    FlashAttention cannot skip pad between samples (TE's `pad_between_seqs` rule), but under causal
    attention a real token never sees the pad after it, so real outputs are exact; pad rows are
    zeroed by the caller, which also zeroes every gradient that would flow through them. A sliding
    `window` (left size) is the kernels' own `window_size=(window, 0)`, within each segment.
    """
    cu = cu_padded.to(torch.int32)
    if kernel == "flash":
        fn = _import_flash_attn_varlen()
        extra = {} if window is None else {"window_size": (window, 0)}
        return fn(
            q,
            k,
            v,
            cu,
            cu,
            max_seqlen,
            max_seqlen,
            dropout_p=dropout_p,
            softmax_scale=scale,
            causal=True,
            **extra,
        )
    if dropout_p:
        raise ValueError("torch varlen_attn has no attention dropout: use backend='flash' or 'sdpa'")
    found = _torch_varlen()
    if found is None:
        raise ImportError(
            f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn "
            "(needs torch >= 2.10); use backend='flash', 'sdpa' or 'dense'"
        )
    fn, params = found
    kwargs = {"scale": scale}
    if "window_size" in params:
        kwargs["window_size"] = (-1 if window is None else window, 0)
    elif window is not None:
        raise NotImplementedError(
            f"torch {torch.__version__}'s varlen_attn has no window_size: use backend='sdpa' or 'dense' for "
            "sliding-window attention"
        )
    else:
        kwargs["is_causal"] = True
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    else:
        k, v = _expand_kv(k, groups, 1), _expand_kv(v, groups, 1)
    return fn(q, k, v, cu, cu, max_seqlen, max_seqlen, **kwargs)


def _sdpa(q, k, v, scale, dropout_p, mask=None, causal=False, sinks=None):
    """q `[Lq, H, D]`, k/v `[Lk, H, D]` (heads already expanded) -> `[Lq, H, D]`; with `sinks` (`[H]`, see
    `window_sink`), `mask` says which keys each query sees."""
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if sinks is None:
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal, scale=scale
        )
    else:
        out = sdpa_with_sinks(q, k, v, allowed=mask, sinks=sinks, scale=scale, dropout_p=dropout_p)
    return out.transpose(0, 1)


def _attend_per_sample(
    q, k_full, v_full, cu, cup, cp_size, cp_rank, scale, dropout_p, window=None, sinks=None
):
    """Exact reference: one SDPA per sample over its real tokens only; pad rows are zeros.

    `k_full`/`v_full` hold every global row (gathered under CP); `q` holds the local rows, those
    `cp_partition_indices` gives this rank (every row without CP). Each sample's local rows are contiguous and
    in order, and its real ones come first: under CP, chunks `r` and `2*cp-1-r` of its slot.
    """
    rows = _cp_local_rows(tuple(cup), cp_size, cp_rank)
    local_cu = np.searchsorted(rows.numpy(), cup).tolist()  # each sample's first local row
    pieces = []
    for i in range(len(cu) - 1):
        n, start, lo, hi = cu[i + 1] - cu[i], cup[i], local_cu[i], local_cu[i + 1]
        positions = rows[lo:hi] - start  # within the sample
        qpos = positions[positions < n].to(q.device)  # this rank's real rows of the sample: a prefix of them
        m = qpos.numel()
        if m:
            allowed = causal_window_mask(qpos, torch.arange(n, device=q.device), window)
            keys = slice(start, start + n)
            pieces.append(
                _sdpa(q[lo : lo + m], k_full[keys], v_full[keys], scale, dropout_p, mask=allowed, sinks=sinks)
            )
        pieces.append(q.new_zeros((hi - lo - m, *q.shape[1:])))
    pieces.append(q.new_zeros((q.shape[0] - local_cu[-1], *q.shape[1:])))  # rows past the last sample
    return torch.cat(pieces)


def _attend_dense(q, k_full, v_full, gidx, cu, cup, scale, dropout_p, window=None, sinks=None):
    """Sync-free exact fallback: full `[Tq, T]` mask (same sample, key <= query position, within `window`)."""
    cup64 = cup.to(torch.int64)
    kidx = torch.arange(k_full.shape[0], device=q.device)
    seg_q = torch.searchsorted(cup64[1:], gidx, right=True)
    seg_k = torch.searchsorted(cup64[1:], kidx, right=True)
    mask = (seg_q[:, None] == seg_k[None, :]) & causal_window_mask(gidx, kidx, window)
    return _sdpa(q, k_full, v_full, scale, dropout_p, mask=mask, sinks=sinks)


# --------------------------------------------------------------------------------------------
# Public kernel
# --------------------------------------------------------------------------------------------


def attend_thd(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    cu_seqlens: Boundaries,
    cu_seqlens_padded: Boundaries | None = None,
    *,
    max_seqlen: int | None = None,
    softmax_scale: float | None = None,
    dropout_p: float = 0.0,
    cp_group=None,
    cp_size: int | None = None,
    cp_rank: int | None = None,
    kv_gather: Callable[[Tensor], Tensor] | None = None,
    host_cu_seqlens: Sequence[int] | None = None,
    host_cu_seqlens_padded: Sequence[int] | None = None,
    backend: str = "auto",
    window: int | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Causal attention within each packed sample.

    Args:
        query: `[T_local, Hq, D]` (T_local = T / cp under context parallelism, this rank's shard).
        key, value: `[T_local, Hkv, D]`, `Hq % Hkv == 0` (GQA).
        cu_seqlens: `[N+1]` logical boundaries (real tokens only), global (before CP sharding);
            a tensor (any device) or a host sequence of ints.
        cu_seqlens_padded: `[N+1]` physical boundaries. None, or the very same object as
            `cu_seqlens` ("fold" mode), means every row of a segment is a token.
        max_seqlen: longest physical sample (host int), for the varlen kernels; T if unknown.
        softmax_scale: default `1/sqrt(D)`.
        dropout_p: attention dropout (not with the torch varlen kernel).
        cp_group: context-parallel process group; its size/rank give `cp_size`/`cp_rank`, and
            K/V are gathered with `all_gather_rows` over it.
        cp_size, cp_rank, kv_gather: explicit alternative to `cp_group` (e.g. to simulate CP in one
            process). `kv_gather(x [T_local, ...]) -> [cp*T_local, ...]` must return every rank's
            rows rank-major and be differentiable.
        host_cu_seqlens, host_cu_seqlens_padded: host copies of the boundaries (the packer keeps
            them); CPU tensors are read directly, CUDA ones are never read on the host.
        backend: one of `BACKENDS`.
        window: sliding window (Megatron's left `window_size`): a query at position `i` of its sample sees
            keys `i - window .. i` (`thdpack.megatron.attention.window_sink`); None: the whole causal prefix.
        sinks: `[Hq]` learned sink logit per query head (gpt-oss), or None. The varlen kernels take none:
            `auto` picks `sdpa` (host boundaries) or `dense`.

    Returns:
        `[T_local, Hq, D]`: attention output; exactly zero on pad rows and rows past the last sample.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
    fold = cu_seqlens_padded is None or cu_seqlens_padded is cu_seqlens
    if cp_group is not None:
        cp_size = torch.distributed.get_world_size(cp_group)
        cp_rank = torch.distributed.get_rank(cp_group)
        if kv_gather is None:
            kv_gather = functools.partial(all_gather_rows, group=cp_group)
    cp_size, cp_rank = cp_size or 1, cp_rank or 0
    if cp_size > 1 and kv_gather is None:
        raise ValueError(f"cp_size={cp_size} needs cp_group or kv_gather to collect K/V")
    if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
        raise ValueError(
            f"THD attention takes [T, H, D] q/k/v, got {tuple(query.shape)}, "
            f"{tuple(key.shape)}, {tuple(value.shape)}"
        )
    hq, hkv = query.shape[1], key.shape[1]
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} key/value heads")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(query.shape[-1])
    device = query.device

    # Python int lists, read once per call (host copies from the packer, or CPU tensors).
    host_cu = _host_list(host_cu_seqlens if host_cu_seqlens is not None else cu_seqlens)
    if fold:
        host_cup = host_cu
    else:
        host_cup = _host_list(
            host_cu_seqlens_padded if host_cu_seqlens_padded is not None else cu_seqlens_padded
        )
    have_host = host_cu is not None and host_cup is not None
    half = query.dtype in (torch.float16, torch.bfloat16)

    if backend == "auto":
        if device.type == "cuda" and cp_size == 1 and half and not dropout_p and _varlen_takes(window, sinks):
            backend = "varlen"
        elif device.type == "cuda" and cp_size == 1 and half and sinks is None and _flash_attn_varlen():
            backend = "flash"
        elif have_host:
            backend = "sdpa"
        else:
            backend = "dense"
    if backend == "sdpa" and not have_host:
        raise ValueError(
            "backend='sdpa' loops over samples on the host: pass host_cu_seqlens / "
            "host_cu_seqlens_padded (or CPU tensors); CUDA boundaries are never read back"
        )
    if have_host:
        _check_host(host_cu, host_cup, query.shape[0], cp_size)

    if backend in ("varlen", "flash"):
        if sinks is not None:
            raise ValueError(f"backend={backend!r} has no attention sinks: use 'sdpa' or 'dense'")
        if cp_size > 1:
            raise NotImplementedError(
                f"backend={backend!r} does not do context parallelism yet; use 'sdpa' or 'dense'"
            )
        cu_dev = _as_device(cu_seqlens, device)
        cup_dev = cu_dev if fold else _as_device(cu_seqlens_padded, device)
        if max_seqlen is None:
            max_seqlen = (
                max(b - a for a, b in zip(host_cup[:-1], host_cup[1:], strict=False))
                if have_host
                else query.shape[0]
            )
        out = _attend_varlen(query, key, value, cup_dev, max_seqlen, scale, dropout_p, backend, window)
        if fold and have_host and host_cup[-1] == query.shape[0]:
            return out
        real = _real_rows(torch.arange(query.shape[0], device=device), cu_dev, cup_dev)
        return torch.where(real[:, None, None], out, out.new_zeros(()))

    groups = hq // hkv
    gidx = torch.arange(query.shape[0], device=device)
    if cp_size > 1:
        t_local = query.shape[0]
        kv = kv_gather(torch.stack((key, value), dim=1))  # one collective for K and V
        if kv.shape[0] != t_local * cp_size:
            raise ValueError(f"kv_gather returned {kv.shape[0]} rows, expected {t_local * cp_size}")
        if not have_host:
            raise ValueError(
                "context parallelism in the torch attention needs host copies of the boundaries "
                "(host_cu_seqlens*; thd_packed_seq_params() declares them in THDPackedSeqParams)"
            )
        # Rank-major gathered rows -> global order, with TE's partition computed on the host boundaries.
        order = _cp_gather_order(tuple(host_cup), cp_size, device)
        gidx = order[cp_rank * t_local : (cp_rank + 1) * t_local]
        kv = torch.empty_like(kv).index_copy_(0, order, kv)
        key, value = kv[:, 0], kv[:, 1]
    k_full, v_full = _expand_kv(key, groups, 1), _expand_kv(value, groups, 1)

    if backend == "sdpa":
        return _attend_per_sample(
            query, k_full, v_full, host_cu, host_cup, cp_size, cp_rank, scale, dropout_p, window, sinks
        )

    cu_dev = _as_device(cu_seqlens, device)
    cup_dev = cu_dev if fold else _as_device(cu_seqlens_padded, device)
    out = _attend_dense(query, k_full, v_full, gidx, cu_dev, cup_dev, scale, dropout_p, window, sinks)
    real = _real_rows(gidx, cu_dev, cup_dev)
    return torch.where(real[:, None, None], out, out.new_zeros(()))


def attend_bshd(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    dropout_p: float = 0.0,
    window: int | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Padded attention in Megatron's layout.

    Args:
        query: `[S, B, Hq, D]`; key, value: `[S, B, Hkv, D]`.
        attention_mask: optional bool, True = masked out, broadcastable to `[B, 1|Hq, S, S]`
            (Megatron's convention). Combined with the causal mask when `causal`.
        window, sinks: a causal sliding window (left size) and per-head sink logits `[Hq]`, as in `attend_thd`.

    Returns:
        `[S, B, Hq*D]`.
    """
    s, b, hq, d = query.shape
    groups = hq // key.shape[2]
    q = query.permute(1, 2, 0, 3)
    k = _expand_kv(key, groups, 2).permute(1, 2, 0, 3)
    v = _expand_kv(value, groups, 2).permute(1, 2, 0, 3)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    if attention_mask is None and window is None and sinks is None:
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal, scale=scale)
    else:
        allowed = torch.ones(s, k.shape[2], dtype=torch.bool, device=q.device)
        if causal or window is not None:
            positions = torch.arange(s, device=q.device)
            allowed = causal_window_mask(positions, torch.arange(k.shape[2], device=q.device), window)
        if attention_mask is not None:
            allowed = allowed & ~attention_mask.bool()
        if sinks is not None:
            out = sdpa_with_sinks(q, k, v, allowed=allowed, sinks=sinks, scale=scale, dropout_p=dropout_p)
        else:
            # Additive rather than boolean: a fully masked row (e.g. a left-pad query) must stay finite,
            # as in Megatron's softmax, instead of turning into NaN that survives loss masking.
            bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device)
            bias = bias.masked_fill(~allowed, torch.finfo(q.dtype).min)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p, scale=scale)
    return out.permute(2, 0, 1, 3).reshape(s, b, hq * d)


# --------------------------------------------------------------------------------------------
# Megatron module
# --------------------------------------------------------------------------------------------


class TorchTHDAttention(MegatronModule):
    """Drop-in `core_attention` for `SelfAttentionSubmodules`, honouring `packed_seq_params`.

    Constructor and forward mirror megatron-core 0.16.1's `DotProductAttention`. Head counts and
    head size are read from the tensors, so TP needs nothing here (Megatron passes per-partition
    heads). Host copies of the boundaries are taken from a `THDPackedSeqParams` (what
    `thd_packed_seq_params(packed)` returns); from a plain `PackedSeqParams` the boundaries are read on the
    host only when they are host tensors.

    As Megatron's and TE's attention: `config.window_size=(left, 0)` gives the layers that
    `config.window_attn_skip_freq` marks (every layer without it) a sliding window; `config.softmax_type`
    `"learnable"` gives each of this rank's heads a sink logit, the parameter `softmax_offset` (`[heads / TP]`,
    split over tensor parallelism: TE's name and shape, so a checkpoint moves between the backends), and
    `"off-by-one"` a sink of 0.
    """

    backend: str = "auto"

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
    ):
        super().__init__(config=config)
        self.window = _layer_window(config, layer_number)
        self._add_softmax_offset(config)
        if config.qk_clip or config.log_max_attention_logit:
            raise NotImplementedError("TorchTHDAttention does not report max attention logits (qk_clip)")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.cp_comm_type = cp_comm_type  # K/V are always all-gathered
        self.pg_collection = pg_collection
        # Megatron's apply_query_key_layer_scaling divides the scale by the layer number and
        # multiplies the scores back in fp32: the product is the same, so it is ignored here.
        self.softmax_scale = softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def _add_softmax_offset(self, config: TransformerConfig) -> None:
        heads = config.num_attention_heads // config.tensor_model_parallel_size
        if config.softmax_type == "vanilla":
            self.softmax_offset = None
        elif config.softmax_type == "off-by-one":
            self.register_buffer("softmax_offset", torch.zeros(heads), persistent=False)
        elif config.softmax_type == "learnable":
            from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

            offset = torch.nn.Parameter(torch.zeros(heads, dtype=config.params_dtype))
            if config.perform_initialization:
                config.init_method(offset)
            # each TP rank holds its own heads' sinks: not a duplicate for the gradient norm
            set_tensor_model_parallel_attributes(offset, True, 0, 1)
            self.softmax_offset = offset
        else:
            raise NotImplementedError(f"TorchTHDAttention has no softmax_type {config.softmax_type!r}")

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """The learnable `softmax_offset`, split over tensor parallelism on dim 0 (as Megatron's and TE's)."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = {}
        if isinstance(self.softmax_offset, torch.nn.Parameter):
            state = {"softmax_offset": self.softmax_offset}
        return make_sharded_tensors_for_checkpoint(  # None groups: Megatron's parallel state
            state,
            prefix,
            {"softmax_offset": 0},
            sharded_offsets,
            tp_group=getattr(self.pg_collection, "tp", None),
            dp_cp_group=(metadata or {}).get("dp_cp_group"),
        )

    def _cp_group(self, packed_seq_params: PackedSeqParams):
        dynamic = getattr(packed_seq_params, "cp_group", None)
        if dynamic is not None:
            return dynamic
        if getattr(packed_seq_params, "local_cp_size", None) == 1:
            return None
        if self.config.context_parallel_size == 1:
            return None
        if self.pg_collection is not None and getattr(self.pg_collection, "cp", None) is not None:
            return self.pg_collection.cp
        from megatron.core import parallel_state

        return parallel_state.get_context_parallel_group()

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> Tensor:
        """THD: q `[T, Hq, D]`, k/v `[T, Hkv, D]` -> `[T, Hq*D]`. BSHD: `[S, B, H, D]` -> `[S, B, Hq*D]`."""
        if attention_bias is not None:
            raise NotImplementedError("TorchTHDAttention does not take attention_bias")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        dropout_p = self.dropout_p if self.training else 0.0
        fmt = None if packed_seq_params is None else packed_seq_params.qkv_format
        if fmt == "thd":
            if mask_type not in _CAUSAL_TYPES:
                raise NotImplementedError(f"THD attention is causal only, got attn_mask_type={mask_type}")
            if self.attention_type != "self":
                raise NotImplementedError("THD attention supports self-attention only")
            p = packed_seq_params
            fold = p.cu_seqlens_q_padded is None or p.cu_seqlens_q_padded is p.cu_seqlens_q
            host = p if isinstance(p, THDPackedSeqParams) else None
            out = attend_thd(
                query,
                key,
                value,
                p.cu_seqlens_q,
                p.cu_seqlens_q if fold else p.cu_seqlens_q_padded,
                max_seqlen=p.max_seqlen_q,
                softmax_scale=self.softmax_scale,
                dropout_p=dropout_p,
                cp_group=self._cp_group(p),
                host_cu_seqlens=None if host is None else host.cu_seqlens_q_host,
                host_cu_seqlens_padded=None if host is None else host.cu_seqlens_q_padded_host,
                backend=self.backend,
                window=self.window,
                sinks=self.softmax_offset,
            )
            return out.reshape(out.shape[0], -1)
        if fmt not in (None, "sbhd"):
            raise NotImplementedError(f"TorchTHDAttention handles qkv_format 'thd' or 'sbhd', got {fmt!r}")
        if self.config.context_parallel_size > 1:
            raise NotImplementedError("TorchTHDAttention does context parallelism on THD batches only")
        if mask_type not in (*_CAUSAL_TYPES, AttnMaskType.no_mask, AttnMaskType.padding):
            raise NotImplementedError(f"unsupported attn_mask_type {mask_type}")
        return attend_bshd(
            query,
            key,
            value,
            attention_mask,
            causal=mask_type in _CAUSAL_TYPES,
            softmax_scale=self.softmax_scale,
            dropout_p=dropout_p,
            window=self.window,
            sinks=self.softmax_offset,
        )


def _layer_window(config: TransformerConfig, layer_number: int) -> int | None:
    """The left window of layer `layer_number` (1-based, global), or None for full causal attention: Megatron's
    rule (`is_layer_window_attention`), with TE's `(-1, 0)` meaning no window."""
    from megatron.core.transformer.utils import is_layer_window_attention

    if not is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
        return None
    left, right = config.window_size
    if right != 0:
        raise NotImplementedError(
            f"TorchTHDAttention's windows are causal: window_size must be (left, 0), got {config.window_size}"
        )
    return None if left < 0 else int(left)
