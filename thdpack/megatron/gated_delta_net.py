"""Gated DeltaNet (Qwen3.5's linear attention) as a Megatron-core ``self_attention`` submodule that takes packed
(THD) rows: every sample starts from a zero recurrent state and its short convolution sees none of the previous
sample's tokens.

megatron-core 0.16.1 ships ``megatron.core.ssm.gated_delta_net.GatedDeltaNet``, but it refuses packed rows
(``packed_seq_params`` raises NotImplementedError), needs flash-linear-attention (fla) to be built, allocates on
CUDA and has no context parallelism. This layer computes what transformers' ``Qwen3_5GatedDeltaNet`` computes, per
sample:

    [q k v] = silu(causal_conv1d(in_proj_qkv(x)))   z = in_proj_z(x)   beta = sigmoid(in_proj_b(x))
    g = -exp(A_log) * softplus(in_proj_a(x) + dt_bias)
    o = gated_delta_rule(q, k, v, g, beta)          # q, k L2-normalised; key heads repeated for the value heads
    out = out_proj(rmsnorm(o) * out_norm.weight * silu(z))

The kernels: on CPU, in float32 and on CUDA without fla, thdpack's torch ones (:mod:`thdpack.megatron.delta_rule`,
exact against transformers' reference, no host-device sync); on CUDA in bf16/fp16 with fla installed, fla's
``chunk_gated_delta_rule`` over the physical boundaries (``cu_seqlens_padded``: pad after a sample's real tokens
never reaches them), given their host copy where fla takes one (``cu_seqlens_cpu``: no sync). The convolution is
thdpack's masked one on every device.

Parameters (tensor parallelism splits them by key heads; :mod:`thdpack.hf.delta_net_kinds` maps them to
transformers'): ``in_proj.weight`` (per key head: its queries, keys, values, z, beta and decay rows),
``conv1d.weight`` ``[channels, 1, K]`` (per key head: queries, keys, values), ``A_log`` and ``dt_bias`` (per value
head), ``out_norm.weight`` (``[value head dim]``, every rank), ``out_proj.weight``.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from .delta_rule import causal_conv1d, chunk_gated_delta_rule, packed_gated_delta_rule, segment_offsets
from .distributed import run_forward_pre_hooks
from .lora import ADAPTER_SUFFIX

__all__ = ["GatedDeltaNet", "GatedDeltaNetSubmodules", "fla_chunk_gated_delta_rule"]

log = logging.getLogger("thdpack")


@dataclass
class GatedDeltaNetSubmodules:
    """The layer's linear layers: ``in_proj`` column-parallel, ``out_proj`` row-parallel (local or TE)."""

    in_proj: ModuleSpec | type
    out_proj: ModuleSpec | type


class GatedDeltaNet(MegatronModule):
    """Gated DeltaNet on ``[s, b, h]`` hidden states: a packed row (``packed_seq_params`` in THD form, ``b`` 1)
    or padded rows (``attention_mask`` ``[b, 1, 1, s]``, True on pad: pad tokens are zeroed first, as
    transformers does). Returns ``(output, None)`` like Megatron's attention."""

    def __init__(
        self, config, submodules: GatedDeltaNetSubmodules, layer_number: int, pg_collection=None, **_
    ):
        super().__init__(config)
        from megatron.core import parallel_state as ps

        if config.context_parallel_size > 1:
            raise ValueError(
                "gated DeltaNet runs one recurrence over each whole sample: context parallelism would split it "
                "over ranks, which thdpack does not pass the state between"
            )
        tp_group = getattr(pg_collection, "tp", None) or ps.get_tensor_model_parallel_group()
        tp = tp_group.size()
        self.layer_number = layer_number
        self.key_heads = config.linear_num_key_heads // tp
        self.value_heads = config.linear_num_value_heads // tp
        self.key_dim, self.value_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.repeat = config.linear_num_value_heads // config.linear_num_key_heads
        r = self.repeat
        # one key head's rows of in_proj: queries, keys, values, z, beta, decay
        self.split = [self.key_dim, self.key_dim, r * self.value_dim, r * self.value_dim, r, r]
        self.in_proj = build_module(
            submodules.in_proj,
            config.hidden_size,
            config.linear_num_key_heads * sum(self.split),
            config=config,
            init_method=config.init_method,
            gather_output=False,
            bias=False,
            skip_bias_add=False,
            is_expert=False,
            tp_comm_buffer_name="fc1",
            tp_group=tp_group,
        )
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        channels = self.key_heads * (2 * self.key_dim + r * self.value_dim)
        kind = dict(device=device, dtype=config.params_dtype)
        self.conv1d = torch.nn.Module()
        self.conv1d.weight = torch.nn.Parameter(
            torch.empty(channels, 1, config.linear_conv_kernel_dim, **kind)
        )
        self.A_log = torch.nn.Parameter(torch.empty(self.value_heads, **kind))
        self.dt_bias = torch.nn.Parameter(torch.ones(self.value_heads, **kind))
        self.out_norm = torch.nn.Module()
        self.out_norm.weight = torch.nn.Parameter(torch.ones(self.value_dim, **kind))
        self.eps = config.layernorm_epsilon
        with torch.no_grad():  # transformers' initialisation (a checkpoint's weights replace it)
            torch.nn.init.kaiming_uniform_(self.conv1d.weight, a=5**0.5)
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0.01, 16).log())
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        for param in (self.conv1d.weight, self.A_log, self.dt_bias):
            set_tensor_model_parallel_attributes(param, True, 0, 1)
        self.out_proj = build_module(
            submodules.out_proj,
            config.linear_num_value_heads * self.value_dim,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=False,
            input_is_parallel=True,
            skip_bias_add=True,
            is_expert=False,
            tp_comm_buffer_name="fc2",
            tp_group=tp_group,
        )
        self.tp_group = tp_group

    def forward(self, hidden_states, attention_mask=None, packed_seq_params=None, **_):
        packed = packed_seq_params is not None and getattr(packed_seq_params, "qkv_format", None) == "thd"
        projected, _ = self.in_proj(
            hidden_states
        )  # [s, b, ...]: the whole sequence under sequence parallelism
        if not packed and attention_mask is not None:
            # transformers zeroes pad tokens' inputs (in_proj has no bias: their projections are zero), so they
            # write nothing to the state; attention_mask [b, 1, 1, s] is True on pad
            projected = projected.masked_fill(attention_mask[:, 0, 0, :].t()[..., None], 0.0)
        s, b = projected.shape[:2]
        # [b, s, key heads, per key head] -> the six parts, each [b, s, key heads, part]
        q, k, v, z, beta, a = (
            projected.transpose(0, 1).unflatten(-1, (self.key_heads, -1)).split(self.split, -1)
        )
        mixed = torch.cat([q, k, v], -1).flatten(2)
        # conv1d and out_norm hold weights that are read, not called: their hooks (the overlap's all-gather) here
        run_forward_pre_hooks(self.conv1d, mixed)
        weight = self.conv1d.weight[:, 0, :]
        if packed:
            offsets = segment_offsets(packed_seq_params.cu_seqlens_q_padded, s)
            mixed = causal_conv1d(mixed[0], weight, offsets)[None]
        else:
            mixed = causal_conv1d(mixed, weight)
        q, k, v = F.silu(mixed).unflatten(-1, (self.key_heads, -1)).split(self.split[:3], -1)
        v = v.reshape(b, s, self.value_heads, self.value_dim)
        z = z.reshape(b, s, self.value_heads, self.value_dim)
        q, k = (x.repeat_interleave(self.repeat, dim=2) for x in (q, k))
        beta = beta.reshape(b, s, self.value_heads).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.reshape(b, s, self.value_heads).float() + self.dt_bias)
        if packed:
            o = self._packed_rule(q[0], k[0], v[0], g[0], beta[0], packed_seq_params)[None]
        else:
            o = chunk_gated_delta_rule(q, k, v, g, beta)
        o = self._gated_norm(o, z)  # [b, s, value heads, value dim]
        out, bias = self.out_proj(o.flatten(2).transpose(0, 1).contiguous())
        return out, bias

    def _packed_rule(self, q, k, v, g, beta, params):
        if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):  # fla's kernels take no float32
            fla = fla_chunk_gated_delta_rule()
            if fla is not None:
                host = getattr(params, "cu_seqlens_q_padded_host", None)
                return fla(q, k, v, g, beta, params.cu_seqlens_q_padded, host)
        return packed_gated_delta_rule(
            q, k, v, g, beta, params.cu_seqlens_q, params.cu_seqlens_q_padded, int(params.max_seqlen_q)
        )

    def _gated_norm(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """transformers' ``Qwen3_5RMSNormGated``: float32 RMSNorm over each head, the weight in the input's
        dtype, times ``silu(z)`` in float32."""
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

        dtype = o.dtype
        x = o.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        # every TP rank normalises its own heads with the one weight: its gradient is the sum over the ranks
        run_forward_pre_hooks(self.out_norm, o)
        weight = copy_to_tensor_model_parallel_region(self.out_norm.weight, group=self.tp_group)
        x = weight * x.to(dtype)
        return (x * F.silu(z.float())).to(dtype)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Megatron's distributed-checkpoint form: ``conv1d.weight``, ``A_log`` and ``dt_bias`` split on dim 0
        over TP (whole key heads: the global tensor is the same at every TP size), ``out_norm.weight``
        replicated; the linear layers as they shard themselves."""
        from megatron.core.transformer.utils import (
            ensure_metadata_has_dp_cp_group,
            make_sharded_tensors_for_checkpoint,
            sharded_state_dict_default,
        )

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        own = {"conv1d.weight": self.conv1d.weight, "A_log": self.A_log, "dt_bias": self.dt_bias}
        state = make_sharded_tensors_for_checkpoint(
            {"out_norm.weight": self.out_norm.weight, **own},
            prefix,
            dict.fromkeys(own, 0),
            sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=metadata["dp_cp_group"],
        )
        for name in ("in_proj", "out_proj"):
            state.update(
                sharded_state_dict_default(
                    getattr(self, name), f"{prefix}{name}.", sharded_offsets, metadata, tp_group=self.tp_group
                )
            )
        for name, child in self.named_children():  # a LoRA adapter beside a projection shards itself
            if name.endswith(ADAPTER_SUFFIX):
                state.update(child.sharded_state_dict(f"{prefix}{name}.", sharded_offsets, metadata))
        return state


@functools.cache
def fla_chunk_gated_delta_rule():
    """flash-linear-attention's varlen ``chunk_gated_delta_rule`` as ``(q, k, v, g, beta, cu_seqlens,
    cu_seqlens_host) -> o`` on ``[T, H, D]`` rows, or None when fla is not installed (logged once: the torch
    kernels run instead, exact and slower)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_rule
    except ImportError:
        log.warning(
            "flash-linear-attention is not installed: gated DeltaNet layers run thdpack's torch kernels on the GPU "
            "(exact, slower); pip install flash-linear-attention for its Triton kernels"
        )
        return None
    takes_host = "cu_seqlens_cpu" in inspect.signature(fla_rule).parameters
    if not takes_host:
        log.warning(
            "this flash-linear-attention's chunk_gated_delta_rule takes no cu_seqlens_cpu: it reads the sample "
            "boundaries back from the GPU (a host-device sync per gated DeltaNet layer); a newer fla avoids it"
        )

    def rule(q, k, v, g, beta, cu_seqlens, cu_seqlens_host):
        extra = {}
        if takes_host and cu_seqlens_host is not None:
            extra["cu_seqlens_cpu"] = cu_seqlens_host.to(torch.int64)
        o, _ = fla_rule(
            q[None],
            k[None],
            v[None],
            g[None],
            beta[None],
            use_qk_l2norm_in_kernel=True,
            cu_seqlens=cu_seqlens.to(torch.int64),
            **extra,
        )
        return o[0]

    return rule
