"""gpt-oss (``GptOssForCausalLM``, ``model_type`` ``gpt_oss``) as Megatron-core's ``GPTModel``, per transformers
5.24's ``modeling_gpt_oss.py``:

* attention with biases on q, k, v and o (Megatron ``add_bias_linear``), a learned sink logit per head in every
  softmax (``self_attn.sinks``: Megatron's and TE's ``softmax_type="learnable"``, ``core_attention.softmax_offset``),
  sliding-window layers (``sliding_window`` 128: ``window_size=(127, 0)``) alternating with full attention
  (``layer_types``);
* YaRN RoPE (:mod:`thdpack.hf.rope`: transformers' frequencies; its ``attention_factor``, which multiplies cos and
  sin and so both q and k, is folded into the softmax scale as its square: ``head_dim ** -0.5 * factor ** 2``);
* a mixture of experts in every layer: router ``mlp.router`` with a bias, top-k of its logits then a softmax over
  those k (Megatron ``moe_router_pre_softmax=false``); experts with biases computing
  ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, ``g = clamp(gate, max=limit)`` (Megatron's
  ``quick_gelu`` with ``glu_linear_offset`` 1 and ``activation_func_clamp_value`` limit; alpha must be 1.702);
* checkpoint experts fused per layer, ``mlp.experts.gate_up_proj`` ``[E, H, 2I]`` with gate and up interleaved
  (columns 0, 2, 4... gate, 1, 3, 5... up), ``down_proj`` ``[E, I, H]`` and their biases, or MXFP4
  (``*_blocks``, ``*_scales``, the released checkpoints: dequantised exactly on import, :mod:`thdpack.hf.mxfp4`).
  :class:`ExpertsReader` shows each expert as ``mlp.experts.{e}.{gate,up,down}_proj.{weight,bias}`` (``nn.Linear``
  tensors), so the mapping splits them as Qwen3-MoE's; the export writes them back fused, unquantised, in the
  checkpoint's dtype (config.json without ``quantization_config``).

Read with transformers 5.24.0.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from thdpack.hf.checkpoint import HFCheckpoint
from thdpack.hf.config_keys import ConfigReader
from thdpack.hf.mapping import COLUMN, GATED, HF_EXPERT, HF_LAYER, LAYER, REPLICATED, ROW, Rule
from thdpack.hf.rope import inverse_frequencies, rope_parameters

from . import llama, qwen2
from .decoder import Extras, decoder_family

__all__ = ["FAMILY", "MAPPING", "ExpertsReader", "fuse_experts", "layer_types", "model_group"]

_EXPERT = LAYER + "mlp.experts."
MAPPING = (
    llama.EMBEDDINGS
    + llama.ATTENTION
    + qwen2.QKV_BIAS
    + llama.MLP_NORM
    + (
        Rule((LAYER + "self_attention.linear_proj.bias",), (HF_LAYER + "self_attn.o_proj.bias",), REPLICATED),
        Rule(
            (LAYER + "self_attention.core_attention.softmax_offset",), (HF_LAYER + "self_attn.sinks",), COLUMN
        ),
        Rule((LAYER + "mlp.router.weight",), (HF_LAYER + "mlp.router.weight",), REPLICATED),
        Rule((LAYER + "mlp.router.bias",), (HF_LAYER + "mlp.router.bias",), REPLICATED),
        Rule(
            (_EXPERT + "local_experts.{expert}.linear_fc1.weight", _EXPERT + "linear_fc1.weight{expert}"),
            (HF_EXPERT + "gate_proj.weight", HF_EXPERT + "up_proj.weight"),
            GATED,
        ),
        Rule(
            (_EXPERT + "local_experts.{expert}.linear_fc1.bias", _EXPERT + "linear_fc1.bias{expert}"),
            (HF_EXPERT + "gate_proj.bias", HF_EXPERT + "up_proj.bias"),
            GATED,
        ),
        Rule(
            (_EXPERT + "local_experts.{expert}.linear_fc2.weight", _EXPERT + "linear_fc2.weight{expert}"),
            (HF_EXPERT + "down_proj.weight",),
            ROW,
        ),
        Rule(
            (_EXPERT + "local_experts.{expert}.linear_fc2.bias", _EXPERT + "linear_fc2.bias{expert}"),
            (HF_EXPERT + "down_proj.bias",),
            REPLICATED,
        ),
    )
)

# Llama's fixed values, but for what gpt-oss has (attention biases), reads otherwise (MXFP4 experts) or ignores
# (hidden_act: transformers' GptOssExperts always gate with the clamped sigmoid below).
FIXED_VALUES = {
    **{
        k: v
        for k, v in llama.FIXED_VALUES.items()
        if k not in ("attention_bias", "quantization_config", "hidden_act")
    },
    "attention_bias": (True, "gpt-oss's q, k, v and o projections have biases (Megatron add_bias_linear)"),
    "swiglu_alpha": (1.702, "Megatron's quick_gelu gates with sigmoid(1.702 x)"),
}


# GptOssConfig's RoPE where config.json names none.
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


def _yarn(r: ConfigReader) -> dict[str, Any]:
    """The RoPE parameters (``rope_parameters``, or transformers 4's ``rope_theta`` and ``rope_scaling``, or
    ``GptOssConfig``'s defaults)."""
    params = r.get("rope_parameters")
    key = "rope_parameters"
    if params is None:
        key, params = "rope_scaling", dict(r.get("rope_scaling") or DEFAULT_ROPE)
        params.setdefault("rope_theta", r.get("rope_theta", 150000.0))
    elif r.get("rope_theta") is not None and isinstance(params, Mapping):
        params = {"rope_theta": r.config["rope_theta"], **params}
    return rope_parameters(r, key, params, ("default", "yarn"))


def _moe(r: ConfigReader) -> dict[str, Any]:
    experts = r.require("num_local_experts")
    r.used.add("num_experts")  # transformers' attribute_map name of num_local_experts
    topk = r.require("num_experts_per_tok")
    legacy = r.get(
        "experts_per_token"
    )  # the released config.json says it twice; transformers reads the other
    if legacy is not None and legacy != topk:
        raise r.error("experts_per_token", f"is {legacy!r} but num_experts_per_tok is {topk}: which is it?")
    if topk > experts:
        raise r.error("num_experts_per_tok", f"is {topk}: more than the {experts} experts")
    limit = r.get("swiglu_limit", 7.0)
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit > 0:
        raise r.error("swiglu_limit", f"is {limit!r}: a positive number expected")
    return {
        "num_moe_experts": experts,
        "moe_router_topk": topk,
        "moe_ffn_hidden_size": r.require("intermediate_size"),
        "moe_router_pre_softmax": False,  # transformers: top-k of the logits, then a softmax over those k
        "moe_router_score_function": "softmax",
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": float(r.get("router_aux_loss_coef") or 0.0),
        "moe_router_dtype": "fp32",
        "moe_token_dispatcher_type": "alltoall",  # packed rows differ in length from rank to rank
        "activation_func": "quick_gelu",
        "glu_linear_offset": 1.0,
        "activation_func_clamp_value": float(limit),
    }


def model_group(r: ConfigReader, *, seq_length: int, tp: int) -> dict[str, Any]:
    """gpt-oss's model group (:class:`~thdpack.models.family.ModelFamily`). Where ``config.json`` lacks a key,
    ``GptOssConfig``'s default holds (YaRN, swiglu_limit 7, attention biases); one whose default differs from
    Llama's rule (``head_dim``, ``num_key_value_heads``) must be given."""
    for key in ("head_dim", "num_key_value_heads"):
        r.require(key)
    config = llama.decoder_config(r, "gpt_oss", FIXED_VALUES)
    r.get("hidden_act")  # never read by transformers' gpt-oss (FIXED_VALUES)
    # the released config.json's context before YaRN, from OpenAI's own code: transformers never reads it (YaRN
    # reads rope_scaling's original_max_position_embeddings)
    r.get("initial_context_length")
    quantization = r.get("quantization_config")
    if quantization is not None and (
        not isinstance(quantization, Mapping) or quantization.get("quant_method") != "mxfp4"
    ):
        raise r.error(
            "quantization_config",
            f"is {quantization!r}: thdpack imports gpt-oss unquantised or with MXFP4 experts (quant_method mxfp4)",
        )
    types = layer_types(r, config["num_layers"])
    params = _yarn(r)
    _, attention_factor = inverse_frequencies(params, config["kv_channels"])
    config.update(
        add_bias_linear=True,
        add_qkv_bias=True,
        softmax_type="learnable",
        softmax_scale=config["kv_channels"] ** -0.5 * attention_factor**2,
        bias_dropout_fusion=False,  # TE's grouped experts refuse it with biases
        **_moe(r),
    )
    if "sliding_attention" in types:
        window = r.get("sliding_window", 128)
        if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
            raise r.error("sliding_window", f"is {window!r}: the sliding layers need a positive window")
        config["window_size"] = [
            window - 1,
            0,
        ]  # transformers' kv > q - w: Megatron/TE (left, right) = (w-1, 0)
        config["window_attn_skip_freq"] = [int(kind == "sliding_attention") for kind in types]
    else:
        r.get("sliding_window")
    scaling = params if params["rope_type"] != "default" else None
    return llama.decoder_group(r, "gpt_oss", config, tp, rotary=(float(params["rope_theta"]), scaling))


def layer_types(r: ConfigReader, num_layers: int) -> list[str]:
    """``layer_types`` (transformers' default: sliding, full, sliding...)."""
    types = r.get("layer_types")
    if types is None:
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    kinds = {"sliding_attention", "full_attention"}
    if not isinstance(types, list) or len(types) != num_layers or set(types) - kinds:
        raise r.error("layer_types", f"is {types!r}: one of {sorted(kinds)} per layer ({num_layers} layers)")
    return list(types)


def setup(chunk, model: Mapping) -> None:
    """YaRN's inverse frequencies (its attention factor is in the softmax scale)."""
    from thdpack.hf.load import use_inverse_frequencies

    params = dict(model.get("rope_scaling") or {"rope_type": "default"}) | {
        "rope_theta": model["rotary_base"]
    }
    inv_freq, _ = inverse_frequencies(params, chunk.config.kv_channels)
    use_inverse_frequencies(chunk, inv_freq)


# ------------------------------------------------------------------------------------------- fused experts

_FUSED = re.compile(
    r"model\.layers\.(?P<layer>\d+)\.mlp\.experts\.(?P<part>gate_up_proj|down_proj)(?P<form>|_bias|_blocks|_scales)\Z"
)
_PER_EXPERT = re.compile(
    r"model\.layers\.(?P<layer>\d+)\.mlp\.experts\.(?P<expert>\d+)\.(?P<part>gate|up|down)_proj\.(?P<kind>weight|bias)\Z"
)


class ExpertsReader:
    """A gpt-oss checkpoint's tensors (``reader``: :class:`~thdpack.hf.checkpoint.SafetensorsReader`) with each
    layer's fused experts shown per expert: ``model.layers.{l}.mlp.experts.{e}.gate_proj.weight`` ``[I, H]``,
    ``up_proj.weight`` ``[I, H]``, ``down_proj.weight`` ``[H, I]`` and their biases. A read touches only the asked
    expert's slice of the fused tensor (dequantised from MXFP4 where the checkpoint stores it so)."""

    def __init__(self, reader, experts: int, hidden: int, intermediate: int):
        self.reader, self.directory = reader, reader.directory
        self.experts, self.hidden, self.intermediate = experts, hidden, intermediate
        names = set(reader.names())
        layers: dict[int, set[str]] = {}
        for name in names:
            m = _FUSED.fullmatch(name)
            if m:
                layers.setdefault(int(m["layer"]), set()).add(m["part"] + m["form"])
        self._quantized: dict[int, bool] = {}
        for layer, parts in sorted(layers.items()):
            self._quantized[layer] = self._check_layer(layer, parts)
        self._names = {n for n in names if not _FUSED.fullmatch(n)} | {
            f"model.layers.{layer}.mlp.experts.{e}.{part}_proj.{kind}"
            for layer in layers
            for e in range(experts)
            for part in ("gate", "up", "down")
            for kind in ("weight", "bias")
        }

    def _fused(self, layer: int, part: str) -> str:
        return f"model.layers.{layer}.mlp.experts.{part}"

    def _check_layer(self, layer: int, parts: set[str]) -> bool:
        """Whether the layer's expert weights are MXFP4; their shapes checked against config.json."""
        e, h, i = self.experts, self.hidden, self.intermediate
        plain = {"gate_up_proj": (e, h, 2 * i), "down_proj": (e, i, h)}
        mxfp4 = {
            "gate_up_proj_blocks": (e, 2 * i, h // 32, 16),
            "gate_up_proj_scales": (e, 2 * i, h // 32),
            "down_proj_blocks": (e, h, i // 32, 16),
            "down_proj_scales": (e, h, i // 32),
        }
        biases = {"gate_up_proj_bias": (e, 2 * i), "down_proj_bias": (e, h)}
        for expected in (plain, mxfp4):
            if parts == set(expected) | set(biases):
                for part, shape in {**expected, **biases}.items():
                    name = self._fused(layer, part)
                    if tuple(self.reader.shape(name)) != shape:
                        raise ValueError(
                            f"{self.reader.where(name)}: '{name}' is {list(self.reader.shape(name))} but config.json "
                            f"(num_local_experts {e}, hidden_size {h}, intermediate_size {i}) needs {list(shape)}"
                        )
                return expected is mxfp4
        raise ValueError(
            f"{self.directory}: layer {layer}'s experts are {sorted(parts)}: gpt-oss stores {sorted({**plain, **biases})}"
            f" or, with MXFP4 experts, {sorted({**mxfp4, **biases})}"
        )

    def names(self) -> set[str]:
        return set(self._names)

    def shape(self, name: str) -> tuple[int, ...]:
        m = _PER_EXPERT.fullmatch(name)
        if m is None or not self._is_virtual(m):
            return self.reader.shape(name)
        h, i = self.hidden, self.intermediate
        if m["kind"] == "bias":
            return (h,) if m["part"] == "down" else (i,)
        return (h, i) if m["part"] == "down" else (i, h)

    def _is_virtual(self, m: re.Match) -> bool:
        return int(m["layer"]) in self._quantized

    def _expert(self, layer: int, part: str, expert: int) -> torch.Tensor:
        """Expert ``expert``'s ``gate_up_proj`` ``[H, 2I]`` or ``down_proj`` ``[I, H]`` (transformers' layout)."""
        one = slice(expert, expert + 1)
        if not self._quantized[layer]:
            return self.reader.read(self._fused(layer, part), one)[0]
        from thdpack.hf.mxfp4 import dequantize_mxfp4

        blocks = self.reader.read(self._fused(layer, part + "_blocks"), one)[0]
        scales = self.reader.read(self._fused(layer, part + "_scales"), one)[0]
        return dequantize_mxfp4(blocks, scales).T  # stored [out, in / 32, 16]: transformers' transpose(1, 2)

    def read(self, name: str, rows: slice = slice(None), cols: slice = slice(None)) -> torch.Tensor:
        m = _PER_EXPERT.fullmatch(name)
        if m is None or not self._is_virtual(m):
            return self.reader.read(name, rows, cols)
        layer, expert, part = int(m["layer"]), int(m["expert"]), m["part"]
        fused = "down_proj" if part == "down" else "gate_up_proj"
        if m["kind"] == "bias":
            bias = self.reader.read(self._fused(layer, fused + "_bias"), slice(expert, expert + 1))[0]
            return (bias if part == "down" else bias[part == "up" :: 2])[rows]
        matrix = self._expert(layer, fused, expert)
        weight = matrix.T if part == "down" else matrix[:, part == "up" :: 2].T  # nn.Linear's [out, in]
        return weight[rows, cols]

    def where(self, name: str) -> str:
        m = _PER_EXPERT.fullmatch(name)
        if m is None or not self._is_virtual(m):
            return self.reader.where(name)
        layer = int(m["layer"])
        part = "down_proj" if m["part"] == "down" else "gate_up_proj"
        part += "_bias" if m["kind"] == "bias" else "_blocks" if self._quantized[layer] else ""
        return f"{self.reader.where(self._fused(layer, part))} (expert {m['expert']})"


def experts_reader(reader) -> ExpertsReader:
    """The checkpoint's tensors (``reader``, of its directory) as :class:`ExpertsReader` shows them."""
    config = HFCheckpoint.open(reader.directory).config
    return ExpertsReader(
        reader,
        int(config["num_local_experts"]),
        int(config["hidden_size"]),
        int(config["intermediate_size"]),
    )


def fuse_experts(
    tensors: dict[str, torch.Tensor], kept: HFCheckpoint | None = None
) -> dict[str, torch.Tensor]:
    """``tensors`` with every layer's per-expert tensors (:class:`ExpertsReader`'s names) fused back as gpt-oss
    stores them unquantised: ``gate_up_proj`` ``[E, H, 2I]`` (gate and up interleaved), ``down_proj``
    ``[E, I, H]`` and their biases; the dtypes and bits as given."""
    out: dict[str, torch.Tensor] = {}
    layers: dict[int, dict[tuple[int, str, str], torch.Tensor]] = {}
    for name, tensor in tensors.items():
        m = _PER_EXPERT.fullmatch(name)
        if m is None:
            out[name] = tensor
        else:
            layers.setdefault(int(m["layer"]), {})[(int(m["expert"]), m["part"], m["kind"])] = tensor
    for layer, parts in sorted(layers.items()):
        experts = range(1 + max(e for e, _, _ in parts))
        missing = [(e, p, k) for e in experts for p in ("gate", "up", "down") for k in ("weight", "bias")]
        missing = [key for key in missing if key not in parts]
        if missing:
            raise ValueError(
                f"layer {layer}'s experts lack {missing[:4]}: every expert's tensors are fused together"
            )
        prefix = f"model.layers.{layer}.mlp.experts."
        gate_up = torch.stack(
            [_interleave(parts[e, "gate", "weight"].T, parts[e, "up", "weight"].T) for e in experts]
        )
        gate_up_bias = torch.stack(
            [_interleave(parts[e, "gate", "bias"], parts[e, "up", "bias"]) for e in experts]
        )
        out[prefix + "gate_up_proj"] = gate_up
        out[prefix + "gate_up_proj_bias"] = gate_up_bias
        out[prefix + "down_proj"] = torch.stack([parts[e, "down", "weight"].T for e in experts])
        out[prefix + "down_proj_bias"] = torch.stack([parts[e, "down", "bias"] for e in experts])
    return out


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``[..., I]`` and ``[..., I]`` as ``[..., 2I]``: gate in the even columns, up in the odd ones."""
    return torch.stack([gate, up], dim=-1).flatten(-2)


def gpt_oss_layers(spec, backend: str):
    """Megatron's layer spec; on the torch backend the experts' output projection that lets megatron-core add
    their biases during training (:mod:`thdpack.megatron.expert_bias`)."""
    if backend == "te":
        return spec
    from thdpack.megatron.expert_bias import use_expert_row_parallel_linear

    return use_expert_row_parallel_linear(spec)


def check(recipe: Mapping) -> None:
    """No tensor parallelism (megatron-core 0.16.1 takes expert biases with expert tensor parallelism 1 only,
    ``TransformerConfig.__post_init__``; thdpack splits experts over the tensor-parallel group); sinks and windows
    under context parallelism on Transformer Engine (its rules, :mod:`thdpack.megatron.attention.te_rules`)."""
    from thdpack.megatron.attention.te_rules import check_te_context_parallel

    tp = int(recipe["parallel"]["tensor_model_parallel_size"])
    if tp > 1:
        raise ValueError(
            f"parallel.tensor_model_parallel_size is {tp}: gpt-oss's experts have biases, which megatron-core "
            "0.16.1 computes only without expert tensor parallelism, and thdpack splits the experts over the "
            "tensor-parallel group; spread gpt-oss with parallel.expert_model_parallel_size (and pipeline or context "
            "parallelism) and tensor_model_parallel_size=1"
        )
    check_te_context_parallel(recipe, "gpt-oss's attention sinks and sliding windows")


FAMILY = decoder_family(
    "gpt_oss",
    ("GptOssForCausalLM",),
    model_group,
    MAPPING,
    Extras(layers=gpt_oss_layers, setup=setup, tensors=experts_reader, written=fuse_experts, check=check),
)
