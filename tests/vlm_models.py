"""A tiny Qwen2.5-VL, Qwen3-VL or Qwen3-VL-MoE Hugging Face directory, built locally (no download): random weights from a
transformers config, the tests' Qwen tokenizer (:mod:`tests.hf_tokenizers`: a small byte-level BPE with Qwen's
special and vision tokens) with the family's chat template, and a PIL image processor: Qwen2.5-VL patch 14, merge 2
(a 56x56 image is 4 image tokens); Qwen3-VL patch 16, merge 2 (a 64x64 image is 4 image tokens).

    directory = build_tiny_vl(tmp_path / "vl")
    directory = build_tiny_vl(tmp_path / "vl3", family="qwen3_vl")
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.hf_tokenizers import (
    QWEN2_VL_CHAT_TEMPLATE,
    QWEN3_VL_CHAT_TEMPLATE,
    TokenizerInfo,
    write_tokenizer,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

IMAGE_PROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "merge_size": 2,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "resample": 3,
    "rescale_factor": 1 / 255,
    "size": {"shortest_edge": 56 * 56, "longest_edge": 224 * 224},
    "min_pixels": 56 * 56,
    "max_pixels": 224 * 224,
}


def build_tokenizer(directory: Path) -> TokenizerInfo:
    """The test Qwen2.5 tokenizer (:func:`tests.hf_tokenizers.write_tokenizer`, its vision tokens included) with
    the Qwen2-VL chat template, saved to ``directory``."""
    return write_tokenizer(directory, "qwen2_5", chat_template=QWEN2_VL_CHAT_TEMPLATE)


# Model sizes. tiny: a 2-layer Qwen2 text model, hidden 64, GQA 4/2, head dim 16 (MRoPE sections 2+3+3), and
# a 2-block vision tower of width 32 whose second block has full attention, the first window attention (CPU
# tests). small: 12 layers, hidden 1024, GQA 16/4, head dim 64 (MRoPE 8+12+12); an 8-block vision tower of
# width 512 (GPU runs).
SIZES = {
    "tiny": dict(
        text=dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
        section=[2, 3, 3],
        vision=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            window_size=56,
            fullatt_block_indexes=[1],
        ),
        max_side=224,
    ),
    "small": dict(
        text=dict(
            hidden_size=1024,
            intermediate_size=2816,
            num_hidden_layers=12,
            num_attention_heads=16,
            num_key_value_heads=4,
        ),
        section=[8, 12, 12],
        vision=dict(
            depth=8,
            hidden_size=512,
            intermediate_size=1024,
            num_heads=8,
            window_size=112,
            fullatt_block_indexes=[3, 7],
        ),
        max_side=448,
    ),
}


def tiny_config(tokenizer: TokenizerInfo, tie: bool = False, size: str = "tiny") -> dict:
    """A Qwen2.5-VL config.json (nested text_config, as transformers 5.x writes it) of ``SIZES[size]`` for
    ``tokenizer``: its vocabulary rounded up to a multiple of 64, rows no token reaches, as in the released
    checkpoints (151,936 rows for 151,665 tokens)."""
    shape, ids = SIZES[size], tokenizer.added_ids
    vocab_size = -(-tokenizer.vocab_size // 64) * 64
    return dict(
        architectures=["Qwen2_5_VLForConditionalGeneration"],
        model_type="qwen2_5_vl",
        text_config=dict(
            vocab_size=vocab_size,
            **shape["text"],
            rms_norm_eps=1e-6,
            max_position_embeddings=32768,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=shape["section"]),
            bos_token_id=ids["<|endoftext|>"],
            eos_token_id=ids["<|im_end|>"],
            pad_token_id=ids["<|endoftext|>"],
        ),
        vision_config=dict(
            **shape["vision"],
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            out_hidden_size=shape["text"]["hidden_size"],
            in_channels=3,
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=tie,
    )


def build_tiny_vl(
    directory: str | Path,
    seed: int = 0,
    tie: bool = False,
    size: str = "tiny",
    sharp: bool = True,
    family: str = "qwen2_5_vl",
) -> Path:
    """Write a Qwen2.5-VL (``family="qwen2_5_vl"``), Qwen3-VL (``"qwen3_vl"``) or Qwen3-VL-MoE
    (``"qwen3_vl_moe"``) directory of ``SIZES[size]`` (config, safetensors, tokenizer, chat template, image
    processor). ``sharp``: weights larger than transformers' initialisation (std 0.1; norms around 1), which make
    the parity checks sharper; False keeps transformers' own (for training runs)."""
    import torch

    if family == "qwen3_vl":
        return build_tiny_qwen3_vl(directory, seed=seed, tie=tie, size=size, sharp=sharp)
    if family == "qwen3_vl_moe":
        return build_tiny_qwen3_vl(directory, seed=seed, tie=tie, size=size, sharp=sharp, moe=True)
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(directory)
    config = Qwen2_5_VLConfig(
        **{k: v for k, v in tiny_config(tokenizer, tie=tie, size=size).items() if k != "architectures"}
    )
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config)
    if sharp:
        _sharpen(model)
    model.save_pretrained(str(directory))
    side = SIZES[size]["max_side"]
    processor = {**IMAGE_PROCESSOR, "size": {"shortest_edge": 56 * 56, "longest_edge": side * side}}
    (directory / "preprocessor_config.json").write_text(
        json.dumps({**processor, "max_pixels": side * side}, indent=1)
    )
    return directory


def _sharpen(model) -> None:
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.1)
            elif "norm" in name or "ln_q" in name:
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, 0.05)


# Qwen3-VL sizes. tiny: a 3-layer Qwen3 text model, hidden 64, GQA 4/2, head dim 32 (free of hidden / heads),
# MRoPE sections 6+5+5 (the released 24+20+20 scaled, interleaved); a 3-block vision tower of width 32, learned
# position embeddings on a 4x4 grid (interpolated to every image), DeepStack from blocks 0 and 1 into decoder
# layers 1 and 2 (layer 3 gets none). small: 12 layers, hidden 1024, GQA 16/8, head dim 128 (24+20+20, as
# released); an 8-block vision tower of width 512, DeepStack from blocks 2, 4, 6 (GPU runs).
QWEN3_SIZES = {
    "tiny": dict(
        text=dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
        ),
        section=[6, 5, 5],
        vision=dict(
            depth=3,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            num_position_embeddings=16,
            deepstack_visual_indexes=[0, 1],
        ),
        max_side=224,
    ),
    "small": dict(
        text=dict(
            hidden_size=1024,
            intermediate_size=2816,
            num_hidden_layers=12,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
        ),
        section=[24, 20, 20],
        vision=dict(
            depth=8,
            hidden_size=512,
            intermediate_size=1024,
            num_heads=8,
            num_position_embeddings=576,
            deepstack_visual_indexes=[2, 4, 6],
        ),
        max_side=448,
    ),
}
# Qwen/Qwen3-VL-*-Instruct preprocessor_config.json, with small images (the released minimum is 256x256).
QWEN3_IMAGE_PROCESSOR = {
    **IMAGE_PROCESSOR,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "patch_size": 16,
    "size": {"shortest_edge": 64 * 64, "longest_edge": 224 * 224},
    "min_pixels": 64 * 64,
    "max_pixels": 224 * 224,
}


def qwen3_vl_config(tokenizer: TokenizerInfo, tie: bool = False, size: str = "tiny") -> dict:
    """A Qwen3-VL config.json (nested, as transformers 5.x and the released checkpoints write it) of
    ``QWEN3_SIZES[size]`` for ``tokenizer``, its vocabulary rounded up to a multiple of 64."""
    shape, ids = QWEN3_SIZES[size], tokenizer.added_ids
    return dict(
        architectures=["Qwen3VLForConditionalGeneration"],
        model_type="qwen3_vl",
        text_config=dict(
            vocab_size=-(-tokenizer.vocab_size // 64) * 64,
            **shape["text"],
            rms_norm_eps=1e-6,
            max_position_embeddings=32768,
            rope_parameters=dict(
                rope_type="default",
                rope_theta=5000000.0,
                mrope_section=shape["section"],
                mrope_interleaved=True,
            ),
            bos_token_id=ids["<|endoftext|>"],
            eos_token_id=ids["<|im_end|>"],
        ),
        vision_config=dict(
            **shape["vision"],
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            out_hidden_size=shape["text"]["hidden_size"],
            in_channels=3,
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=tie,
    )


# Qwen3-VL-MoE: the Qwen3-VL sizes with every decoder layer a mixture of experts. tiny: 4 experts of width 48, 2
# per token (2 * 48 differs from hidden 64, so the fused experts' orientation shows in their shape); small: 16 of
# width 512, 4 per token.
QWEN3_MOE_SIZES = {
    "tiny": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48),
    "small": dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=512),
}


def qwen3_vl_moe_config(tokenizer: TokenizerInfo, tie: bool = False, size: str = "tiny") -> dict:
    """A Qwen3-VL-MoE config.json: :func:`qwen3_vl_config` with ``QWEN3_MOE_SIZES[size]`` experts in every layer,
    ``norm_topk_prob`` true as in the released checkpoints."""
    config = qwen3_vl_config(tokenizer, tie=tie, size=size)
    config.update(architectures=["Qwen3VLMoeForConditionalGeneration"], model_type="qwen3_vl_moe")
    config["text_config"].update(
        **QWEN3_MOE_SIZES[size], decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True
    )
    return config


def build_tiny_qwen3_vl(
    directory: str | Path,
    seed: int = 0,
    tie: bool = False,
    size: str = "tiny",
    sharp: bool = True,
    moe: bool = False,
) -> Path:
    """Write a Qwen3-VL directory (``moe``: Qwen3-VL-MoE) of ``QWEN3_SIZES[size]``: the Qwen3 tokenizer with the
    Qwen3-VL chat template, config, safetensors, image processor (see :func:`build_tiny_vl`)."""
    import torch
    import transformers

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = write_tokenizer(directory, "qwen3", chat_template=QWEN3_VL_CHAT_TEMPLATE)
    make_config, prefix = (qwen3_vl_moe_config, "Qwen3VLMoe") if moe else (qwen3_vl_config, "Qwen3VL")
    config = getattr(transformers, f"{prefix}Config")(
        **{k: v for k, v in make_config(tokenizer, tie=tie, size=size).items() if k != "architectures"}
    )
    torch.manual_seed(seed)
    model = getattr(transformers, f"{prefix}ForConditionalGeneration")(config)
    if sharp:
        _sharpen(model)
    model.save_pretrained(str(directory))
    side = QWEN3_SIZES[size]["max_side"]
    processor = {**QWEN3_IMAGE_PROCESSOR, "size": {"shortest_edge": 64 * 64, "longest_edge": side * side}}
    (directory / "preprocessor_config.json").write_text(
        json.dumps({**processor, "max_pixels": side * side}, indent=1)
    )
    return directory


def released_orientation(directory: str | Path, copy: str | Path) -> Path:
    """A copy (at ``copy``) of the Qwen3-VL-MoE ``directory`` with its fused experts stored as the released
    checkpoints store them (``[E, H, 2I]``, ``[E, I, H]``: transformers 4.57's orientation; transformers 5.x saves
    ``[E, 2I, H]``, ``[E, H, I]``)."""
    import shutil

    from safetensors.torch import load_file, save_file

    copy = Path(copy)
    shutil.copytree(directory, copy)
    tensors = load_file(copy / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        tensors[name] = tensors[name].transpose(1, 2).contiguous()
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    return copy


try:  # the builders above run without pytest (python tests/make_tiny_hf.py); the session fixtures need it
    import pytest
except ImportError:
    pytest = None

if pytest is not None:

    @pytest.fixture(scope="session")
    def tiny_vl(tmp_path_factory) -> Path:
        """One tiny Qwen2.5-VL directory for the whole test session (import the fixture into a test module)."""
        return build_tiny_vl(tmp_path_factory.mktemp("tiny_vl"))

    @pytest.fixture(scope="session")
    def tiny_qwen3_vl(tmp_path_factory) -> Path:
        """One tiny Qwen3-VL directory for the whole test session (import the fixture into a test module)."""
        return build_tiny_vl(tmp_path_factory.mktemp("tiny_qwen3_vl"), family="qwen3_vl")

    @pytest.fixture(scope="session")
    def tiny_qwen3_vl_moe(tmp_path_factory) -> Path:
        """One tiny Qwen3-VL-MoE directory for the whole test session (import the fixture into a test module)."""
        return build_tiny_vl(tmp_path_factory.mktemp("tiny_qwen3_vl_moe"), family="qwen3_vl_moe")
