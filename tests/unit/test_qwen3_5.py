"""Qwen3.5 (dense and MoE, tiny models of tests/hf_models.py) against transformers, fp32 CPU: the gated DeltaNet
kernels on packed rows (the recurrent state and the short convolution restart at every sample), the whole model's
logits per sample within 1e-5, packed equal to alone, the padded baseline, and what is refused at start-up."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from tests.hf_models import (
    _COMMON,
    build,
    max_logit_difference,
    megatron_model,
    packed_logits,
    padded_batch,
    save_model,
)
from tests.hf_models import FAMILIES as FAMILIES_OF_TESTS
from thdpack.megatron.delta_rule import (
    causal_conv1d,
    chunk_gated_delta_rule,
    packed_gated_delta_rule,
    segment_offsets,
)

pytestmark = [pytest.mark.cpu_only]

FAMILIES = ["qwen3_5", "qwen3_5_moe"]
TOLERANCE = 1e-5
# a sample longer than one 64-token chunk, short ones, pad between samples (the packer's physical slots)
LENGTHS, PADS = (70, 5, 13), (2, 0, 3)


def delta_rule_inputs(length: int, heads: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, length, heads, 8, generator=g) for _ in range(2))
    v = torch.randn(1, length, heads, 12, generator=g)
    decay = -torch.rand(1, length, heads, generator=g) * 2  # log decay <= 0
    beta = torch.rand(1, length, heads, generator=g)
    return q, k, v, decay, beta


def packed_row(samples):
    """The samples' tensors one after another, ``PADS`` random rows after each; the boundaries."""
    cu, cup, parts = [0], [0], []
    for sample, pad in zip(samples, PADS, strict=True):
        parts.append([torch.cat([x[0], 9 * torch.randn(pad, *x.shape[2:])]) for x in sample])
        cu.append(cu[-1] + sample[0].shape[1])
        cup.append(cup[-1] + sample[0].shape[1] + pad)
    row = [torch.cat(column) for column in zip(*parts, strict=True)]
    return row, torch.tensor(cu, dtype=torch.int32), torch.tensor(cup, dtype=torch.int32)


def test_the_chunked_delta_rule_equals_transformers_reference():
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    q, k, v, decay, beta = delta_rule_inputs(100)
    ours = chunk_gated_delta_rule(q, k, v, decay, beta)
    for reference in (torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule):
        theirs, _ = reference(q, k, v, g=decay, beta=beta, use_qk_l2norm_in_kernel=True)
        assert (ours - theirs).abs().max() <= TOLERANCE, reference.__name__


def test_a_packed_row_restarts_the_recurrent_state_at_every_sample():
    samples = [delta_rule_inputs(n, seed=i) for i, n in enumerate(LENGTHS)]
    row, cu, cup = packed_row(samples)
    out = packed_gated_delta_rule(*row, cu, cup, max_seqlen=max(LENGTHS) + max(PADS))
    for i, sample in enumerate(samples):
        alone = chunk_gated_delta_rule(*sample)[0]
        assert (out[cup[i] : cup[i] + LENGTHS[i]] - alone).abs().max() <= TOLERANCE
        assert not out[cup[i] + LENGTHS[i] : cup[i + 1]].any()  # pad: zero
    # the check can fail: the row run as one sequence carries the state into the next sample
    leaked = chunk_gated_delta_rule(*(x[None] for x in row))[0]
    second = chunk_gated_delta_rule(*samples[1])[0]
    assert (leaked[cup[1] : cup[1] + LENGTHS[1]] - second).abs().max() > 1e-2


def test_the_short_convolution_never_reaches_the_previous_sample():
    x, weight = torch.randn(20, 6), torch.randn(6, 4)
    bounds = torch.tensor([0, 7, 9, 20], dtype=torch.int32)
    out = causal_conv1d(x, weight, segment_offsets(bounds, 20))
    for start, end in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        alone = F.conv1d(x[start:end].T[None], weight[:, None], padding=3, groups=6)[0, :, : end - start].T
        assert (out[start:end] - alone).abs().max() <= TOLERANCE
    unmasked = causal_conv1d(x, weight)
    assert (unmasked[7:10] - out[7:10]).abs().min() > 0  # the first K-1 tokens of a sample would see back


@pytest.fixture(scope="module")
def directories(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_5")
    return {family: save_model(family, root / family) for family in FAMILIES}


@pytest.mark.usefixtures("one_rank_megatron")
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_logits_are_transformers_on_each_sample_alone_within_1e_5(family, directories):
    hf = build(family)
    worst = max_logit_difference(megatron_model(directories[family]), hf, padded_batch(hf.config.vocab_size))
    print(f"{family}: max |logit difference| {worst:.3g}")
    assert worst <= TOLERANCE


@pytest.mark.usefixtures("one_rank_megatron")
@pytest.mark.parametrize("family", FAMILIES)
def test_a_sample_packed_after_another_computes_what_it_computes_alone(family, directories):
    model = megatron_model(directories[family])
    both = padded_batch(300, lengths=(70, 13), seed=3)  # the first fills a 64-token chunk and more
    second = {k: v[1:, :13] for k, v in both.items()}
    packed, starts = packed_logits(model, both)
    alone, _ = packed_logits(model, second)
    difference = float((packed[0, starts[1] : starts[1] + 13] - alone[0, :13]).abs().max())
    print(f"{family}: max |packed - alone| {difference:.3g}")
    assert difference <= TOLERANCE
    # the check can fail: the two as one sample (state and convolution running on) change the second's logits
    joined = {
        "tokens": torch.cat([both["tokens"][0, :70], both["tokens"][1, :13]])[None],
        "attention_mask": torch.ones(1, 83, dtype=torch.long),
    }
    leaked, _ = packed_logits(model, joined)
    assert float((leaked[0, 70:83] - alone[0, :13]).abs().max()) > 1e-2


@pytest.mark.usefixtures("one_rank_megatron")
def test_the_padded_baseline_with_left_padding_is_transformers(directories):
    """The unpacked (BSHD) path: pad tokens write nothing to the state (transformers zeroes their inputs)."""
    from thdpack.megatron.batch import BatchConfig, get_batch

    hf = build("qwen3_5")
    batch = padded_batch(300, lengths=(9, 4))
    batch = {k: torch.stack([v[0], v[1].roll(5)]) for k, v in batch.items()}  # row 1: 5 pad tokens in front
    model = megatron_model(directories["qwen3_5"])
    with torch.no_grad():
        inputs = get_batch(iter([batch]), model.config, BatchConfig(pack_sequences_in_batch=False))
        logits = model(inputs.tokens, inputs.position_ids, inputs.attention_mask)
        reference = hf(batch["tokens"], attention_mask=batch["attention_mask"]).logits
    real = batch["attention_mask"].bool()
    assert float((logits[real] - reference[real]).abs().max()) <= TOLERANCE


@pytest.mark.usefixtures("one_rank_megatron")
def test_the_language_model_of_a_multimodal_checkpoint_imports_once_transformers_took_it_out(tmp_path):
    """The README's way for the Hub's Qwen3_5ForConditionalGeneration checkpoints: transformers'
    Qwen3_5ForCausalLM.from_pretrained(DIR).save_pretrained(TEXT_DIR), which names the tensors
    model.language_model.*."""
    from transformers import Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration

    hf = build("qwen3_5")
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    multimodal = Qwen3_5ForConditionalGeneration(
        Qwen3_5Config(text_config=hf.config.to_dict(), vision_config=vision, image_token_id=299)
    )
    multimodal.model.language_model.load_state_dict(hf.model.state_dict())
    multimodal.lm_head.load_state_dict(hf.lm_head.state_dict())
    multimodal.save_pretrained(tmp_path / "multimodal")
    Qwen3_5ForCausalLM.from_pretrained(tmp_path / "multimodal").save_pretrained(tmp_path / "text")
    from safetensors import safe_open

    with safe_open(tmp_path / "text" / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "model.language_model.layers.0.linear_attn.A_log" in names
    assert max_logit_difference(megatron_model(tmp_path / "text"), hf, padded_batch(300)) <= TOLERANCE


# ------------------------------------------------------------------------------------------------ refused


def test_context_parallelism_is_refused_at_start_up_naming_the_reason(directories):
    from hydra import compose, initialize_config_dir

    from thdpack.training.checks import ConfigError, check_recipe
    from thdpack.training.loop import recipes_dir
    from thdpack.training.recipe import resolve_recipe

    overrides = ["model=hf", f"model.pretrained={directories['qwen3_5']}", "parallel=cp2"]
    with initialize_config_dir(str(recipes_dir()), version_base="1.3"):
        cfg = resolve_recipe(compose("train", overrides=overrides), device="cpu")
    with pytest.raises(
        ConfigError,
        match=r"parallel.context_parallel_size=2: Qwen3.5's gated DeltaNet layers run one recurrence over each "
        r"whole sample",
    ):
        check_recipe(cfg, world_size=2, device="cpu")


def test_tensor_parallelism_must_divide_the_deltanet_key_heads(directories):
    from thdpack.hf.checkpoint import HFCheckpoint, HFConfigError
    from thdpack.models import model_group

    with pytest.raises(
        HFConfigError, match=r"key 'linear_num_key_heads' is 2: tensor parallelism \(4 ranks\)"
    ):
        model_group(HFCheckpoint.open(directories["qwen3_5"]), seq_length=64, tp=4)


@pytest.mark.parametrize(
    ("family", "key", "value", "message"),
    [
        ("qwen3_5", "rope_parameters", {"rope_type": "yarn", "factor": 4.0}, "has rope_type 'yarn'"),
        ("qwen3_5", "hidden_act", "gelu", "is 'gelu': thdpack needs 'silu'"),
        ("qwen3_5", "attn_output_gate", False, "gates the output of every full-attention layer"),
        ("qwen3_5_moe", "mlp_only_layers", [1], "experts in every layer"),
        ("qwen3_5_moe", "norm_topk_prob", False, "always renormalises the top-k"),
    ],
)
def test_a_config_thdpack_cannot_compute_is_refused_naming_the_key(family, key, value, message, tmp_path):
    import transformers

    from thdpack.hf.checkpoint import HFCheckpoint, HFConfigError
    from thdpack.models import model_group

    config_class, model_class, keywords = FAMILIES_OF_TESTS[family]
    config = getattr(transformers, config_class)(**{**_COMMON, "vocab_size": 300, **keywords})
    config = {**config.to_dict(), "architectures": [model_class], key: value}
    (tmp_path / "config.json").write_text(json.dumps(config, indent=2))
    with pytest.raises(HFConfigError, match=rf"key '{key}' .*{message}"):
        model_group(HFCheckpoint.open(tmp_path), seq_length=64)


@pytest.mark.parametrize(
    ("in_rope_parameters", "top_level"),
    [(0.5, 0.25), (None, 0.5), (None, None), (0.5, None)],
    ids=["both-rope-parameters-win", "top-level-only", "neither-default", "rope-parameters-only"],
)
def test_partial_rotary_factor_is_read_as_transformers_reads_it(in_rope_parameters, top_level, tmp_path):
    # transformers 5.17 writes a top-level partial_rotary_factor beside rope_parameters (refused as an unknown key
    # on an H200, 2026-12-01); transformers: rope_parameters' value wins, the top-level one fills in, else 0.25
    import transformers

    from thdpack.hf.checkpoint import HFCheckpoint
    from thdpack.models import model_group

    config_class, model_class, keywords = FAMILIES_OF_TESTS["qwen3_5"]
    config = getattr(transformers, config_class)(**{**_COMMON, "vocab_size": 300, **keywords}).to_dict()
    config["architectures"] = [model_class]
    config["rope_parameters"].pop("partial_rotary_factor")
    if in_rope_parameters is not None:
        config["rope_parameters"]["partial_rotary_factor"] = in_rope_parameters
    if top_level is not None:
        config["partial_rotary_factor"] = top_level
    (tmp_path / "config.json").write_text(json.dumps(config, indent=2))
    expected = transformers.AutoConfig.from_pretrained(tmp_path).rope_parameters["partial_rotary_factor"]
    group = model_group(HFCheckpoint.open(tmp_path), seq_length=64)
    assert group["rotary_percent"] == expected
