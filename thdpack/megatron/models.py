"""GPT / MoE models whose core attention honours THD `packed_seq_params`, with either backend."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from thdpack.megatron.attention import CORE_ATTENTION_BACKENDS, get_core_attention

from .compat import define_te_general_gemm
from .mrope import enable_packed_mrope
from .norm import use_torch_norm
from .unwrap import unwrap_model

__all__ = ["build_gpt_model", "gpt_layer_spec", "torch_block_spec", "unwrap_model"]


def gpt_layer_spec(
    backend: str = "torch",
    num_experts: int | None = None,
    moe_grouped_gemm: bool = False,
    **spec_kwargs: Any,
) -> ModuleSpec:
    """Transformer-layer spec for `backend`.

    `"te"`: Megatron's `get_gpt_layer_with_transformer_engine_spec` (TE modules throughout, GPU).
    `"torch"`: Megatron's `get_gpt_layer_local_spec` with `core_attention` swapped for
    `TorchTHDAttention` (the local `DotProductAttention` rejects packed batches) and, without Apex, its torch
    norms for `TorchNorm` (which, unlike Megatron's, supports sequence parallelism). With experts, the MoE
    router's missing `te_general_gemm` is defined (`thdpack.megatron.compat`).
    `spec_kwargs` go to the Megatron spec function (e.g. `qk_layernorm=True`).
    """
    from megatron.core.models.gpt import gpt_layer_specs

    if backend == "te":
        get_core_attention("te")  # clear ImportError before Megatron's own TE asserts
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm, **spec_kwargs
        )
    if backend == "torch":
        spec = gpt_layer_specs.get_gpt_layer_local_spec(
            num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm, **spec_kwargs
        )
        spec.submodules.self_attention.submodules.core_attention = get_core_attention("torch")
        use_torch_norm(spec)  # without Apex: torch norms that also work with sequence parallelism
        if num_experts:
            define_te_general_gemm()
        return spec
    raise ValueError(f"unknown attention backend {backend!r}; choose one of {CORE_ATTENTION_BACKENDS}")


def torch_block_spec(
    layer_spec: ModuleSpec, config: TransformerConfig, vp_stage: int | None = None, pg_collection=None
):
    """The transformer block of this pipeline stage for a torch-backend layer spec: its layers, and a final
    norm of the same class as the layers' norms.

    Given a layer spec, Megatron's `TransformerBlock` picks the final norm itself: TE's when Transformer
    Engine imports, else Apex's, else `WrappedTorchNorm`, which refuses sequence parallelism. The torch
    backend's final norm is its layers' (`TorchNorm`, or Apex's where the spec has it), so TP + SP runs
    without TE on any device.
    """
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.utils import get_pg_rank

    pp_group = getattr(pg_collection, "pp", None)
    pp_rank = get_pg_rank(pp_group) if pp_group is not None else None
    num_layers = get_num_layers_to_build(config, vp_stage, pp_rank)
    return TransformerBlockSubmodules(
        layer_specs=[layer_spec] * num_layers, layer_norm=layer_spec.submodules.input_layernorm
    )


def check_te_op_fuser_model(config, backend: str, te_op_fuser: bool) -> None:
    """``te_op_fuser`` builds megatron-core's ``TEFusedMLP``: the TE backend and a dense MLP only."""
    if te_op_fuser and (backend != "te" or config.num_moe_experts):
        raise ValueError("te_op_fuser needs the TE backend and a dense MLP (no num_moe_experts)")


def stage_ends(pre_process: bool | None, post_process: bool | None) -> tuple[bool, bool]:
    """``(pre_process, post_process)``: whether this rank's stage holds the embedding and the output layer, each
    from the pipeline layout where not given."""
    from megatron.core import parallel_state

    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=True)
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    return pre_process, post_process


def build_gpt_model(
    config: TransformerConfig,
    vocab_size: int,
    max_sequence_length: int,
    backend: str = "torch",
    position_embedding_type: str = "rope",
    pre_process: bool | None = None,
    post_process: bool | None = None,
    packed_mrope: bool = True,
    mrope_interleaved: bool = False,
    te_op_fuser: bool = False,
    edit_spec: Callable[[ModuleSpec], ModuleSpec] | None = None,
    **model_kwargs: Any,
) -> GPTModel:
    """A `GPTModel` (MoE when `config.num_moe_experts` is set) with the `backend` layer spec.

    `pre_process` / `post_process` default to this rank's pipeline stage; `model_kwargs` go to
    `GPTModel` (e.g. `rotary_base`, `share_embeddings_and_output_weights`, `pg_collection`).
    An MRoPE model gets `enable_packed_mrope` (correct per-token MRoPE on packed rows, also under CP)
    unless `packed_mrope=False`; `mrope_interleaved` picks Qwen3-VL's frequency layout
    (`thdpack.megatron.mrope.mrope_frequencies`). `te_op_fuser` (TE backend, dense MLP) builds megatron-core's
    `TEFusedMLP`: norm, FC1, activation and FC2 as one Transformer Engine operation sequence, whose fused kernels
    write the activation's FP8 cast directly; its parameters and state-dict keys are the plain MLP's.
    `edit_spec` (a family's own layers, e.g. Gemma 3's post-norms) takes the backend's layer spec and returns the
    one to build.
    """
    check_te_op_fuser_model(config, backend, te_op_fuser)
    pre_process, post_process = stage_ends(pre_process, post_process)
    spec = gpt_layer_spec(
        backend,
        num_experts=config.num_moe_experts,
        moe_grouped_gemm=config.moe_grouped_gemm,
        # without it Megatron's specs build no q/k norm modules, whatever config.qk_layernorm says
        qk_layernorm=config.qk_layernorm,
        **({"use_te_op_fuser": True} if te_op_fuser else {}),
    )
    if edit_spec is not None:
        spec = edit_spec(spec)
    if backend == "torch":
        spec = torch_block_spec(spec, config, model_kwargs.get("vp_stage"), model_kwargs.get("pg_collection"))
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        pre_process=pre_process,
        post_process=post_process,
        position_embedding_type=position_embedding_type,
        **model_kwargs,
    )
    if position_embedding_type == "mrope" and packed_mrope:
        # Megatron's MRoPE is wrong on packed rows under CP; the hooks act on THD calls only.
        enable_packed_mrope(model, mrope_interleaved=mrope_interleaved)
    elif mrope_interleaved:
        raise ValueError(
            "mrope_interleaved=True needs position_embedding_type='mrope' with packed_mrope=True"
        )
    return model
