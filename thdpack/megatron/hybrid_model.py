"""A ``GPTModel`` whose layers mix gated DeltaNet (:class:`~thdpack.megatron.gated_delta_net.GatedDeltaNet`) and
full attention, per layer as ``layer_types`` says (Qwen3.5's ``linear_attention`` / ``full_attention``).

    model = build_hybrid_model(config, ["linear_attention", "full_attention"], vocab_size, 4096, backend="torch")

Both kinds of layer are Megatron's ``TransformerLayer`` with the same MLP (dense or MoE) and norms; a DeltaNet
layer has the DeltaNet in place of self-attention and its own input norm (Transformer Engine's spec fuses that
norm into ``linear_qkv``, which a DeltaNet layer lacks). The full-attention layers are Megatron's, with whatever the
config asks (``attention_output_gate``, ``qk_layernorm``; partial RoPE is the model's ``rotary_percent``). With
``config.layernorm_zero_centered_gamma`` every norm multiplies by ``1 + weight``: Transformer Engine's norms do it
themselves, the torch backend's are :class:`~thdpack.megatron.zero_centered_norm.ZeroCenteredRMSNorm`.
Megatron's checkpoints of these models keep each layer under its own name (``linear_attention_freq`` is a list:
``TransformerBlock.sharded_state_dict`` then treats the layers as non-homogeneous).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.spec_utils import ModuleSpec

from .gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from .models import check_te_op_fuser_model, gpt_layer_spec, stage_ends

__all__ = ["LAYER_TYPES", "build_hybrid_model", "hybrid_layer_specs"]

LAYER_TYPES = ("linear_attention", "full_attention")


def hybrid_layer_specs(config, backend: str, te_op_fuser: bool = False) -> dict[str, ModuleSpec]:
    """The layer spec of each layer type (:data:`LAYER_TYPES`) for ``backend`` ("torch" or "te"), and the final
    norm under ``"final_norm"``. ``te_op_fuser``: the dense MLP as TE's fused operations (TE backend)."""
    attention = gpt_layer_spec(
        backend,
        num_experts=config.num_moe_experts,
        moe_grouped_gemm=config.moe_grouped_gemm,
        qk_layernorm=config.qk_layernorm,
        **({"use_te_op_fuser": True} if te_op_fuser else {}),
    )
    if backend == "te":
        from megatron.core.extensions.transformer_engine import (
            TEColumnParallelLinear,
            TENorm,
            TERowParallelLinear,
        )

        norm, column, row = TENorm, TEColumnParallelLinear, TERowParallelLinear
    else:
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        norm, column, row = _torch_norm(config), ColumnParallelLinear, RowParallelLinear
        holders = [attention.submodules, attention.submodules.self_attention.submodules]
        for holder in holders:
            for name in ("input_layernorm", "pre_mlp_layernorm", "q_layernorm", "k_layernorm"):
                if getattr(holder, name, None) is not None and not _is_identity(getattr(holder, name)):
                    setattr(holder, name, norm)
    linear = copy.deepcopy(attention)
    linear.submodules.self_attention = ModuleSpec(
        module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(in_proj=column, out_proj=row)
    )
    linear.submodules.input_layernorm = norm
    keys = dict(linear.submodules.sharded_state_dict_keys_map or {})
    keys.pop(
        "input_layernorm.", None
    )  # the local spec saves it as linear_qkv's fused norm, which this layer lacks
    linear.submodules.sharded_state_dict_keys_map = keys
    return {"full_attention": attention, "linear_attention": linear, "final_norm": norm}


def _torch_norm(config):
    if config.layernorm_zero_centered_gamma:
        from .zero_centered_norm import ZeroCenteredRMSNorm

        return ZeroCenteredRMSNorm
    from .norm import TorchNorm

    return TorchNorm


def _is_identity(spec) -> bool:
    from megatron.core.transformer.identity_op import IdentityOp

    return spec is IdentityOp


def _block_spec(config, layer_types: Sequence[str], backend: str, te_op_fuser: bool, vp_stage, pg_collection):
    """This pipeline stage's layers (their global indices pick their types) and the final norm."""
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    from megatron.core.utils import get_pg_rank

    specs = hybrid_layer_specs(config, backend, te_op_fuser)
    pp_group = getattr(pg_collection, "pp", None)
    pp_rank = get_pg_rank(pp_group) if pp_group is not None else None
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(
        layer_specs=[specs[layer_types[i]] for i in range(offset, offset + count)],
        layer_norm=specs["final_norm"],
    )


def build_hybrid_model(
    config,
    layer_types: Sequence[str],
    vocab_size: int,
    max_sequence_length: int,
    backend: str = "torch",
    pre_process: bool | None = None,
    post_process: bool | None = None,
    te_op_fuser: bool = False,
    **model_kwargs: Any,
) -> GPTModel:
    """This rank's ``GPTModel`` stage with ``layer_types`` (one of :data:`LAYER_TYPES` per layer of
    ``config.num_layers``). ``pre_process`` / ``post_process`` default to this rank's pipeline stage;
    ``model_kwargs`` go to ``GPTModel`` (``rotary_percent``, ``rotary_base``, ``share_embeddings_and_output_weights``,
    ``pg_collection``...); ``te_op_fuser``: the dense MLP as TE's fused operations (TE backend)."""
    check_te_op_fuser_model(config, backend, te_op_fuser)
    bad = sorted(set(layer_types) - set(LAYER_TYPES))
    if bad or len(layer_types) != config.num_layers:
        raise ValueError(
            f"layer_types {list(layer_types)}: one of {list(LAYER_TYPES)} per layer ({config.num_layers} layers)"
        )
    pre_process, post_process = stage_ends(pre_process, post_process)
    spec = _block_spec(
        config,
        layer_types,
        backend,
        te_op_fuser,
        model_kwargs.get("vp_stage"),
        model_kwargs.get("pg_collection"),
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        pre_process=pre_process,
        post_process=post_process,
        position_embedding_type="rope",
        **model_kwargs,
    )
