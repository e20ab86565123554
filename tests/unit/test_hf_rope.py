"""thdpack.hf.rope: RoPE frequencies as transformers 5.24 computes them (``ROPE_INIT_FUNCTIONS``), bit for bit, for
the types the new families use, and parameters it cannot compute refused naming the key."""

from __future__ import annotations

import pytest
import torch

from thdpack.hf.checkpoint import HFCheckpoint, HFConfigError
from thdpack.hf.config_keys import ConfigReader
from thdpack.hf.rope import inverse_frequencies, rope_parameters

HEAD_DIM = 24


def transformers_rope(params: dict) -> tuple[torch.Tensor, float]:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(
        hidden_size=4 * HEAD_DIM, num_attention_heads=4, head_dim=HEAD_DIM, rope_parameters=dict(params)
    )
    rope_type = params["rope_type"]
    if rope_type == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[rope_type](config, None)


YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "original_max_position_embeddings": 4096}


@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
        {**YARN, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False},  # gpt-oss
        YARN,  # truncate defaults to true
        {**YARN, "mscale": 1.0, "mscale_all_dim": 0.707},  # DeepSeek's attention factor
        {**YARN, "attention_factor": 1.25, "beta_fast": 8.0},
    ],
    ids=["default", "linear", "yarn_gpt_oss", "yarn_truncated", "yarn_mscale", "yarn_attention_factor"],
)
def test_frequencies_and_attention_factor_are_transformers(params):
    ours, factor = inverse_frequencies(params, HEAD_DIM)
    theirs, their_factor = transformers_rope(params)
    assert torch.equal(ours, theirs) and factor == their_factor


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}, r"has rope_type 'dynamic': this family"),
        ({"rope_type": "linear", "rope_theta": 1e4}, r"has rope_type 'linear' without \['factor'\]"),
        (
            {"rope_type": "default", "rope_theta": 1e4, "factor": 2.0},
            r"has \['factor'\] with rope_type 'default'",
        ),
        ({"rope_type": "default", "rope_theta": -1}, r"has rope_theta -1: a positive number expected"),
    ],
)
def test_parameters_it_cannot_compute_are_refused_naming_the_key(params, match):
    reader = ConfigReader(HFCheckpoint.from_config({"rope_parameters": params}))
    with pytest.raises(HFConfigError, match=rf"key 'rope_parameters' {match}"):
        rope_parameters(reader, "rope_parameters", params, ("default", "linear", "yarn"))
