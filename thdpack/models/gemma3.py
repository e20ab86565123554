"""Gemma 3 text (``Gemma3ForCausalLM``, ``model_type`` ``gemma3_text``: Gemma 3 1B, and the text model of the 4B and
larger shapes) as Megatron-core's ``GPTModel``, per transformers 5.24's ``modeling_gemma3.py``:

* layers of two kinds (``layer_types``, or ``sliding_window_pattern`` where a file predates it): sliding-window
  attention (``sliding_window`` w: a token sees itself and the w - 1 before it, within its own sample on packed
  rows: Megatron's ``window_size=(w - 1, 0)`` on those layers, ``window_attn_skip_freq`` saying which) and full
  attention; each kind with its RoPE (``rope_parameters.sliding_attention``, theta 10,000;
  ``rope_parameters.full_attention``, theta 1,000,000, ``linear`` scaling on the 4B+ shapes; transformers 4's
  ``rope_local_base_freq``, ``rope_theta``, ``rope_scaling``): :mod:`thdpack.megatron.local_global_rope`;
* RMSNorm with a zero-centred gain, ``x / rms(x) * (1 + w)`` in fp32 (the checkpoint stores ``w``: Megatron's
  ``layernorm_zero_centered_gamma``), on q and k per head too, and four norms per layer: input, post-attention,
  pre- and post-feedforward (the two "post" norms: :mod:`thdpack.megatron.post_norm`);
* embeddings scaled by ``sqrt(hidden_size)`` rounded to the embedding's dtype (as transformers'
  ``Gemma3TextScaledWordEmbedding``); attention scale ``query_pre_attn_scalar ** -0.5``; a gated MLP with
  ``gelu_pytorch_tanh``; tied embeddings.

Refused, naming the key: attention or final logit soft-capping (a ``tanh`` thdpack's attention and loss do not
compute), bidirectional attention, attention biases. Read with transformers 5.24.0.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from thdpack.hf.config_keys import ConfigReader
from thdpack.hf.mapping import HF_LAYER, LAYER, REPLICATED, Rule
from thdpack.hf.rope import inverse_frequencies, rope_parameters

from . import llama, qwen3
from .decoder import Extras, decoder_family

__all__ = ["FAMILY", "MAPPING", "gemma3_layers", "layer_types", "model_group"]

ATTENTION_KINDS = ("sliding_attention", "full_attention")
MAPPING = (
    llama.EMBEDDINGS
    + llama.ATTENTION
    + qwen3.QK_NORMS
    + (
        Rule(
            (LAYER + "self_attention.linear_proj.post_layernorm.weight",),
            (HF_LAYER + "post_attention_layernorm.weight",),
            REPLICATED,
        ),
        Rule(
            (LAYER + "pre_mlp_layernorm.weight", LAYER + "mlp.linear_fc1.layer_norm_weight"),
            (HF_LAYER + "pre_feedforward_layernorm.weight",),
            REPLICATED,
        ),
        Rule(
            (LAYER + "mlp.linear_fc2.post_layernorm.weight",),
            (HF_LAYER + "post_feedforward_layernorm.weight",),
            REPLICATED,
        ),
    )
    + llama.DENSE_MLP
)
ROPE_TYPES = ("default", "linear")


def layer_types(r: ConfigReader, num_layers: int) -> list[str]:
    """Each layer's attention kind: ``layer_types``, or transformers' rule from ``sliding_window_pattern``
    (default 6: every 6th layer full) where the file has none."""
    types = r.get("layer_types")
    # transformers reads sliding_window_pattern only without layer_types (and writes it back beside them), and
    # never reads the _sliding_window_pattern it writes
    pattern = r.get("sliding_window_pattern", 6)
    r.get("_sliding_window_pattern")
    if types is None:
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern <= 0:
            raise r.error("sliding_window_pattern", f"is {pattern!r}: a positive integer expected")
        return [ATTENTION_KINDS[(i + 1) % pattern == 0] for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers or set(types) - set(ATTENTION_KINDS):
        raise r.error(
            "layer_types", f"is {types!r}: one of {list(ATTENTION_KINDS)} per layer ({num_layers} layers)"
        )
    return list(types)


def _rope(r: ConfigReader) -> dict[str, dict]:
    """The two RoPEs (``full_attention``, ``sliding_attention``), merged from ``rope_parameters`` and transformers
    4's keys as transformers 5.24's ``Gemma3TextConfig.convert_rope_params_to_dict`` merges them."""
    given = r.get("rope_parameters")
    key = "rope_parameters" if given is not None else "rope_scaling"
    if given is not None and (not isinstance(given, Mapping) or set(given) - set(ATTENTION_KINDS)):
        raise r.error(
            "rope_parameters",
            f"is {given!r}: Gemma 3 gives one object per attention kind {list(ATTENTION_KINDS)}",
        )
    params = {kind: dict((given or {}).get(kind) or {"rope_type": "default"}) for kind in ATTENTION_KINDS}
    scaling = r.get("rope_scaling")
    if scaling is not None:
        if not isinstance(scaling, Mapping):
            raise r.error("rope_scaling", f"is {scaling!r}: a JSON object or null expected")
        params["full_attention"].update(scaling)
    params["full_attention"].setdefault("rope_theta", r.get("rope_theta", 1_000_000.0))
    params["sliding_attention"].setdefault("rope_theta", r.get("rope_local_base_freq", 10_000.0))
    return {kind: rope_parameters(r, key, p, ROPE_TYPES) for kind, p in params.items()}


def _refuse_unless_none(r: ConfigReader, key: str, rule: str) -> None:
    value = r.get(key)
    if value is not None:
        raise r.error(key, f"is {value!r}: thdpack needs null ({rule})")


def model_group(r: ConfigReader, *, seq_length: int, tp: int) -> dict[str, Any]:
    """Gemma 3's model group (:class:`~thdpack.models.family.ModelGroup`). Where ``config.json`` lacks a key,
    ``Gemma3TextConfig``'s default holds (tied embeddings); one whose default differs from Llama's rule
    (``head_dim``, ``num_key_value_heads``) must be given."""
    for key in ("head_dim", "num_key_value_heads"):
        r.require(key)
    config = llama.decoder_config(r, "gemma3_text")
    activation = r.get("hidden_activation", "gelu_pytorch_tanh")
    if activation != "gelu_pytorch_tanh":
        raise r.error(
            "hidden_activation", f"is {activation!r}: thdpack imports Gemma 3's gelu_pytorch_tanh (tanh GELU)"
        )
    scalar = r.get("query_pre_attn_scalar", 256)
    if isinstance(scalar, bool) or not isinstance(scalar, (int, float)) or scalar <= 0:
        raise r.error("query_pre_attn_scalar", f"is {scalar!r}: a positive number expected")
    for key, rule in (
        (
            "attn_logit_softcapping",
            "a tanh on the attention scores, which neither attention backend computes",
        ),
        (
            "final_logit_softcapping",
            "a tanh on the logits, which thdpack's output layer and loss do not compute",
        ),
    ):
        _refuse_unless_none(r, key, rule)
    if r.get("use_bidirectional_attention"):
        raise r.error("use_bidirectional_attention", "is true: thdpack's packed attention is causal")
    types = layer_types(r, config["num_layers"])
    config.update(
        activation_func="gelu_tanh",
        qk_layernorm=True,
        layernorm_zero_centered_gamma=True,
        softmax_scale=float(scalar) ** -0.5,
    )
    llama.sliding_windows(r, types, config, default=4096)
    rope = _rope(r)
    full, local = rope["full_attention"], rope["sliding_attention"]
    scaling = full if full["rope_type"] != "default" else None
    group = llama.decoder_group(r, "gemma3", config, tp, rotary=(float(full["rope_theta"]), scaling))
    tied = r.get("tie_word_embeddings", True)
    if not isinstance(tied, bool):
        raise r.error("tie_word_embeddings", f"is {tied!r}: true or false expected")
    group.update(
        share_embeddings_and_output_weights=tied,
        local_rotary_base=float(local["rope_theta"]),
        local_rope_scaling=local if local["rope_type"] != "default" else None,
    )
    return group


def gemma3_layers(spec, backend: str):
    """Gemma 3's layer from the backend's Megatron spec: the attention picks its RoPE by kind, its output
    projection ends in the post-attention norm, the MLP's in the post-feedforward norm."""
    from thdpack.megatron.local_global_rope import LocalGlobalRopeSelfAttention
    from thdpack.megatron.post_norm import with_post_norm

    if backend == "te":
        from megatron.core.extensions.transformer_engine import TENorm as norm
    else:
        from thdpack.megatron.norm import TorchNorm as norm
    attention, mlp = spec.submodules.self_attention, spec.submodules.mlp.submodules
    attention.module = LocalGlobalRopeSelfAttention
    attention.submodules.linear_proj = with_post_norm(attention.submodules.linear_proj, norm)
    mlp.linear_fc2 = with_post_norm(mlp.linear_fc2, norm)
    return spec


def _params(model: Mapping, prefix: str) -> dict:
    return dict(model.get(f"{prefix}rope_scaling") or {"rope_type": "default"}) | {
        "rope_theta": model[f"{prefix}rotary_base"]
    }


def setup(chunk, model: Mapping) -> None:
    """Both RoPEs (:func:`~thdpack.megatron.local_global_rope.use_local_global_rope`) and the embedding's scale."""
    from thdpack.megatron.local_global_rope import use_local_global_rope

    head_dim = chunk.config.kv_channels
    local, _ = inverse_frequencies(_params(model, "local_"), head_dim)
    global_, _ = inverse_frequencies(_params(model, ""), head_dim)
    use_local_global_rope(chunk, local, global_)
    if getattr(chunk, "embedding", None) is not None:
        scale_embeddings(chunk.embedding, math.sqrt(chunk.config.hidden_size))


def scale_embeddings(embedding, scale: float) -> None:
    """Multiply the embedding's output by ``scale`` rounded to its dtype (transformers:
    ``embed * embed_scale.to(weight.dtype)``, so sqrt(3072) is 55.5 in bf16)."""
    import torch

    factor = torch.tensor(scale, dtype=torch.float32)  # a 0-dim host tensor: a kernel argument, no copy

    def hook(module, args, output):
        return output * factor.to(output.dtype)

    embedding.register_forward_hook(hook)


def check(recipe: Mapping) -> None:
    """Sliding windows under context parallelism on Transformer Engine: its fused or flash attention takes
    windows with ``cp_comm_type`` a2a or all_gather only (TE's ``attn_forward_func_with_cp``)."""
    from thdpack.megatron.attention.te_rules import check_te_context_parallel

    check_te_context_parallel(recipe, "Gemma 3's sliding-window layers")


FAMILY = decoder_family(
    "gemma3",
    ("Gemma3ForCausalLM",),
    model_group,
    MAPPING,
    Extras(
        layers=gemma3_layers,
        setup=setup,
        check=check,
        model_keys=("local_rotary_base", "local_rope_scaling"),
    ),
)
