"""The gated delta rule (gated DeltaNet's linear attention) and its short causal convolution, in plain PyTorch, on
padded batches and on packed rows, where each sample starts from a zero state and sees none of the previous
sample's tokens.

    y = causal_conv1d(x, weight, offsets)                    # x [T, C]; offsets: segment_offsets(...)
    o = chunk_gated_delta_rule(q, k, v, g, beta)             # one sequence per row of [B, L, H, D]
    o = packed_gated_delta_rule(q, k, v, g, beta, cu_seqlens, cu_seqlens_padded, max_seqlen)   # [T, H, D]

The recurrence, per head, with state ``S [Dk, Dv]`` starting at zero (transformers' Qwen3.5 and Qwen3-Next,
flash-linear-attention's ``chunk_gated_delta_rule``)::

    S_t = exp(g_t) S_{t-1} + k_t delta_t^T,   delta_t = beta_t (v_t - (exp(g_t) S_{t-1})^T k_t),   o_t = S_t^T q_t

with ``q`` and ``k`` L2-normalised (eps 1e-6) and ``q`` scaled by ``Dk ** -0.5``. :func:`chunk_gated_delta_rule`
computes it chunk by chunk (64 positions, as transformers' reference does): inside a chunk the deltas solve one
unit lower-triangular system, and the state is carried from chunk to chunk. Everything runs in float32 and returns
the dtype of ``v``.

On a packed row the state must restart at every sample: :func:`packed_gated_delta_rule` gathers the samples into
rows of one padded batch by the boundaries (device tensors; ``max_seqlen``, a host int, sizes it), runs the
chunked rule on it and gathers the outputs back. The short convolution looks at most ``K - 1`` tokens back;
:func:`causal_conv1d` zeroes every tap that would reach before the token's segment start. Neither reads a device
tensor back (no host-device sync): shapes come from the row and ``max_seqlen`` only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "CHUNK",
    "causal_conv1d",
    "chunk_gated_delta_rule",
    "l2_normalize",
    "packed_gated_delta_rule",
    "segment_offsets",
]

CHUNK = 64  # positions per chunk: transformers' torch_chunk_gated_delta_rule default


def segment_offsets(cu_seqlens_padded: torch.Tensor, total: int) -> torch.Tensor:
    """``[total]`` int64: each position's distance from the start of its physical segment (``cu_seqlens_padded``,
    ``[M + 1]`` int32, on the row's device), e.g. ``[0, 3, 5]`` -> ``[0, 1, 2, 0, 1]``."""
    return _segments(cu_seqlens_padded, total)[1]


def _segments(cu_seqlens_padded: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each position's segment and its offset from the segment's start, ``[total]`` int64 each."""
    bounds = cu_seqlens_padded.to(torch.int64)
    position = torch.arange(total, device=bounds.device)
    segment = torch.searchsorted(bounds[1:], position, right=True).clamp_max(bounds.numel() - 2)
    return segment, position - bounds[segment]


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal convolution, no bias: ``out[t, c] = sum_j weight[c, K-1-j] * x[t-j, c]`` over
    ``j < K`` (transformers' ``causal_conv1d_fn``: ``conv1d`` with ``K - 1`` zeros in front).

    Args:
        x: ``[..., L, C]``: the sequence on dim -2 (a packed row ``[T, C]`` or rows ``[B, L, C]``).
        weight: ``[C, K]``.
        offsets: ``[L]`` positions from each token's segment start (:func:`segment_offsets`): tap ``j`` of
            token ``t`` counts only where ``offsets[t] >= j``, so no token sees the previous sample. None: each
            row is one sequence.
    """
    length, taps = x.shape[-2], weight.shape[-1]
    out = x * weight[:, taps - 1]
    for j in range(1, min(taps, length + 1)):
        shifted = F.pad(x, (0, 0, j, 0))[..., :length, :]  # shifted[t] = x[t - j], zero before the row
        if offsets is not None:
            shifted = torch.where((offsets >= j)[:, None], shifted, 0.0)
        out = out + shifted * weight[:, taps - 1 - j]
    return out


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (flash-linear-attention's and transformers' ``l2norm``)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def chunk_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, chunk: int = CHUNK
) -> torch.Tensor:
    """The gated delta rule on each row from a zero state (module docstring).

    Args:
        q, k: ``[B, L, H, Dk]`` raw (normalised and scaled here); as many heads as ``v`` (repeat the key heads
            of grouped value attention first).
        v: ``[B, L, H, Dv]``.
        g: ``[B, L, H]``, log decay (<= 0).
        beta: ``[B, L, H]``, the write strength in (0, 1).

    Returns ``[B, L, H, Dv]`` in ``v``'s dtype.
    """
    dtype = v.dtype
    batch, length, heads, dk = k.shape
    q, k = l2_normalize(q.float()), l2_normalize(k.float())
    q = q * dk**-0.5
    pad = (-length) % chunk
    # [B, H, N, C, D] and [B, H, N, C]: N chunks of C positions, zeros after the end (they come after every
    # real position, so they change none)
    q, k, v = (F.pad(x.float().transpose(1, 2), (0, 0, 0, pad)).unflatten(2, (-1, chunk)) for x in (q, k, v))
    g, beta = (F.pad(x.float().transpose(1, 2), (0, pad)).unflatten(2, (-1, chunk)) for x in (g, beta))

    cum = g.cumsum(-1)  # log decay from the chunk's start to each position, inclusive
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # decay[i, j] = exp(cum_i - cum_j) for j <= i (between positions j and i), 0 above the diagonal
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta[..., None]
    # delta = T (beta v) - T (beta exp(cum) k) S_0 with T = (I + A)^-1, A strictly lower: A_ij = beta_i decay_ij
    # k_i.k_j (the part of each write that the earlier writes of the chunk already predict)
    system = (k_beta @ k.transpose(-1, -2) * decay).masked_fill(~causal.tril(-1), 0.0)
    system = system + torch.eye(chunk, dtype=system.dtype, device=system.device)
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    within = q @ k.transpose(-1, -2) * decay  # causal (diagonal included) attention inside the chunk
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]

    state = q.new_zeros(batch, heads, dk, v.shape[-1])
    out = []
    for n in range(q.shape[2]):
        delta = u[:, :, n] - w[:, :, n] @ state
        out.append(q_decayed[:, :, n] @ state + within[:, :, n] @ delta)
        state = state * chunk_decay[:, :, n] + k_to_end[:, :, n].transpose(-1, -2) @ delta
    o = torch.stack(out, 2).flatten(2, 3)[:, :, :length]
    return o.transpose(1, 2).to(dtype)


def packed_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    max_seqlen: int,
) -> torch.Tensor:
    """:func:`chunk_gated_delta_rule` on a packed row, each sample from a zero state.

    Args:
        q, k: ``[T, H, Dk]``; v: ``[T, H, Dv]``; g, beta: ``[T, H]``: the row's tokens.
        cu_seqlens: ``[M + 1]`` logical boundaries (each sample's real tokens), on the row's device.
        cu_seqlens_padded: ``[M + 1]`` physical boundaries (where each sample starts in the row).
        max_seqlen: at least the longest sample (a host int: the packer's ``max_seqlen``).

    Returns ``[T, H, Dv]``; zero on positions past a sample's real tokens (alignment pad). Its batch holds
    ``M x max_seqlen`` positions (a row's trailing pad segment is one of the ``M``): more than the row's ``T``
    when lengths differ much (flash-linear-attention's varlen kernel, used on a GPU where installed, holds ``T``).
    """
    total = v.shape[0]
    device = v.device
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    starts = cu_seqlens_padded[:-1].to(torch.int64)
    step = torch.arange(max_seqlen, device=device)
    # row s of the batch holds sample s: position p is row position starts[s] + p, a zero row (index T) past
    # its end
    index = torch.where(step < lengths[:, None], starts[:, None] + step, total)

    def batched(x):
        rows = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
        return rows[index]

    o = chunk_gated_delta_rule(*(batched(x) for x in (q, k, v, g, beta)))
    # back to the row: position t of segment s is o[s, t - starts[s]] when that is a real token
    segment, offsets = _segments(cu_seqlens_padded, total)
    real = offsets < lengths[segment]
    flat = torch.where(real, segment * max_seqlen + offsets.clamp_max(max_seqlen - 1), 0)
    out = o.flatten(0, 1)[flat]
    return torch.where(real[:, None, None], out, 0.0)
