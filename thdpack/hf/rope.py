"""RoPE as transformers computes it from a ``config.json``'s RoPE parameters, for the families whose rotation is
not Llama's: ``default``, ``linear`` (Gemma 3's global layers) and ``yarn`` (gpt-oss).

    params = rope_parameters(reader, "rope_parameters", {"rope_type": "yarn", "factor": 32.0, ...}, ("yarn",))
    inv_freq, attention_factor = inverse_frequencies(params, head_dim)

``inverse_frequencies`` follows transformers 5.24's ``modeling_rope_utils`` (``_compute_default_rope_parameters``,
``_compute_linear_scaling_rope_parameters``, ``_compute_yarn_parameters``) step by step, so the frequencies are
the same floats. YaRN's ``attention_factor`` multiplies transformers' cos and sin, hence both q and k: a family
folds its square into the attention's softmax scale (the same product), which leaves Megatron's RoPE plain.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from .config_keys import ConfigReader

__all__ = ["ROPE_TYPE_KEYS", "inverse_frequencies", "rope_parameters"]

# The keys each rope_type reads besides rope_type and rope_theta (transformers 5.24).
ROPE_TYPE_KEYS = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "yarn": frozenset(
        {
            "factor",
            "original_max_position_embeddings",
            "beta_fast",
            "beta_slow",
            "truncate",
            "attention_factor",
            "mscale",
            "mscale_all_dim",
        }
    ),
}
_REQUIRED = {"default": (), "linear": ("factor",), "yarn": ("factor", "original_max_position_embeddings")}


def rope_parameters(r: ConfigReader, key: str, params: Any, types: tuple[str, ...]) -> dict[str, Any]:
    """``params`` (read from ``config.json``'s ``key``) checked: a ``rope_type`` of ``types``, a positive
    ``rope_theta``, the type's required keys and no key it does not read. Raises
    :class:`~thdpack.hf.checkpoint.HFConfigError` naming ``key``."""
    if not isinstance(params, Mapping):
        raise r.error(key, f"is {params!r}: a JSON object with rope_type and rope_theta expected")
    params = dict(params)
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in types:
        raise r.error(
            key,
            f"has rope_type '{rope_type}': this family imports {list(types)} (transformers' rotation, computed "
            "the same way); another type would change every position's rotation",
        )
    theta = params.get("rope_theta")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise r.error(key, f"has rope_theta {theta!r}: a positive number expected")
    extra = sorted(set(params) - {"rope_type", "type", "rope_theta"} - ROPE_TYPE_KEYS[rope_type])
    if extra:
        raise r.error(
            key, f"has {extra} with rope_type '{rope_type}': thdpack does not know what they change"
        )
    missing = [k for k in _REQUIRED[rope_type] if params.get(k) is None]
    if missing:
        raise r.error(key, f"has rope_type '{rope_type}' without {missing}")
    if rope_type in ("linear", "yarn") and not params["factor"] > 0:
        raise r.error(key, f"has factor {params['factor']!r}: a positive number expected")
    return {**{k: v for k, v in params.items() if k != "type"}, "rope_type": rope_type}


def inverse_frequencies(params: Mapping[str, Any], head_dim: int) -> tuple[torch.Tensor, float]:
    """``(inv_freq [head_dim / 2] float32, attention_factor)`` of checked RoPE ``params``, as transformers
    computes them (the factor multiplies cos and sin: 1.0 but for YaRN)."""
    base, dim = params["rope_theta"], head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim
    rope_type = params["rope_type"]
    if rope_type == "default":
        return 1.0 / (base**exponents), 1.0
    if rope_type == "linear":
        return 1.0 / (base**exponents) / params["factor"], 1.0
    return _yarn(params, base, dim, exponents)


def _yarn(
    params: Mapping[str, Any], base: float, dim: int, exponents: torch.Tensor
) -> tuple[torch.Tensor, float]:
    factor = params["factor"]
    original = params["original_max_position_embeddings"]

    def get_mscale(scale, mscale=1):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base**exponents
    extrapolation = 1 - ramp
    inv_freq = 1.0 / (factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation
    return inv_freq, float(attention_factor)
