"""Tiny Hugging Face models of every family thdpack imports, built with transformers from a config (random
weights, no download) and saved with ``save_pretrained`` (safetensors).

    directory = save_model("qwen3", tmp_path / "qwen3")     # config.json, model.safetensors, tokenizer files
    model = hf_model(directory)                             # transformers' own model on those weights, fp32
    model = build("qwen3")                                  # the same weights without the round trip to disk

Every family: 2 layers, hidden 64, 4 query heads in 2 groups (GQA; Gemma 3 1B's shape: one group). RoPE is given
as transformers 4 named it (``rope_theta``, ``rope_scaling``), which transformers 5 still takes and saves as
``rope_parameters``. Weights are drawn wider than transformers' initialisation (std 0.02 makes every logit about 0
and hides layout errors), norm gains around 1, biases non-zero.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 300
LLAMA3_SCALING = {  # Llama 3.1's values: Megatron's RotaryEmbedding(rope_scaling=True) hard-codes all but factor
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
# Values of one's own: scaling bites at short positions (wavelengths past 64 tokens are divided by 4).
OWN_SCALING = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 3.0,
    "original_max_position_embeddings": 64,
}
_COMMON = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
)
QWEN3_5 = dict(
    head_dim=16,
    layer_types=["linear_attention", "full_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    linear_conv_kernel_dim=4,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
)

# name: (transformers config class, model class, config keywords)
FAMILIES = {
    "llama2": ("LlamaConfig", "LlamaForCausalLM", dict(vocab_size=301, tie_word_embeddings=False)),
    "llama3": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            tie_word_embeddings=True,
            max_position_embeddings=131072,
            rope_theta=500000.0,
            rope_scaling=LLAMA3_SCALING,
        ),
    ),
    "llama3_own_scaling": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(max_position_embeddings=256, rope_theta=10000.0, rope_scaling=OWN_SCALING),
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24)),  # head_dim != hidden / heads
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True
        ),
    ),
    "qwen3_moe_unnormed": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False
        ),
    ),
    # Qwen3.5: a gated DeltaNet layer (2 key heads, each serving 2 value heads) then a gated full-attention layer
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", QWEN3_5),
    "qwen3_5_moe": (
        "Qwen3_5MoeTextConfig",
        "Qwen3_5MoeForCausalLM",
        dict(
            QWEN3_5,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
        ),
    ),
    # Gemma 3 4B's text shape at tiny size: grouped queries, linear scaling of the global RoPE, a window that
    # bites within these samples (4 tokens), a query scale of its own
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
            rope_theta=1_000_000.0,
            rope_local_base_freq=10_000.0,
            rope_scaling={"rope_type": "linear", "factor": 8.0},
        ),
    ),
    # Gemma 3 1B's: one key/value head (no tensor parallelism: Megatron splits whole query groups), no scaling
    "gemma3_1b": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            num_key_value_heads=1,
            head_dim=24,
            query_pre_attn_scalar=24,
            sliding_window=3,
            layer_types=["full_attention", "sliding_attention"],
        ),
    ),
    # gpt-oss at tiny size: 4 experts (top 2), attention sinks, a window of 4 on its first layer, YaRN that bites
    # at these positions (original context 16), and a clamp (swiglu_limit) that bites at these activations
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            head_dim=16,
            intermediate_size=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
            rope_scaling={
                "rope_type": "yarn",
                "factor": 8.0,
                "beta_fast": 8.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 16,
            },
            rope_theta=150000.0,
            max_position_embeddings=128,  # = factor x original context, as transformers' YaRN expects
            swiglu_limit=1.5,
        ),
    ),
}
DENSE = [f for f in FAMILIES if "moe" not in f and f != "gpt_oss"]
MOE = [f for f in FAMILIES if "moe" in f or f == "gpt_oss"]
# Families thdpack refuses under context parallelism (Qwen3.5: its recurrence runs over each whole sample).
NO_CP = ["qwen3_5", "qwen3_5_moe"]


def build(family: str, seed: int = 0, **overrides):
    """transformers' model of ``family`` with random weights (fp32, eval mode, eager attention)."""
    import transformers

    config_class, model_class, kwargs = FAMILIES[family]
    config = getattr(transformers, config_class)(
        **{**_COMMON, "vocab_size": VOCAB, **kwargs, **overrides}, attn_implementation="eager"
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).eval()
    # Qwen3.5's RMSNorms (but its DeltaNet's output norm) and Gemma's scale by 1 + weight: weights around 0 there
    centred = config.model_type.startswith(("qwen3_5", "gemma"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and centred and "linear_attn.norm" not in name:
                p.uniform_(-0.5, 0.5)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.15)
    return model


def save_model(family: str, directory: str | Path, seed: int = 0, **overrides) -> Path:
    """``build(family)`` saved to ``directory`` (safetensors) with a small tokenizer; returns the directory."""
    directory = Path(directory)
    model = build(family, seed, **overrides)
    model.save_pretrained(directory)
    write_tokenizer(directory, model.config.vocab_size)
    return directory


def exported_tensors(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of an exported Hugging Face directory's ``model-*.safetensors`` shards, by name."""
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(Path(directory).glob("model-*.safetensors")):
        tensors |= load_file(str(file))
    return tensors


def hf_model(directory: str | Path):
    """transformers' model from a saved directory (``AutoModelForCausalLM``, local files only), fp32, eager."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        directory, local_files_only=True, attn_implementation="eager", dtype=torch.float32
    ).eval()


def write_tokenizer(directory: Path, vocab_size: int) -> None:
    """A byte-level BPE ``tokenizer.json`` trained on a few lines of text, with at most ``vocab_size`` ids and an
    ``<|endoftext|>`` token, plus ``tokenizer_config.json``: the files an export copies."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = [json.__doc__ or "", torch.__doc__ or "", "def f(x):\n    return x + 1\n"] * 4
    tokenizer.train_from_iterator(text, trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}, indent=2)
    )


# ---------------------------------------------------------------------------------------------------------
# The two sides of a comparison: a padded batch, transformers on each sample alone, thdpack's Megatron model


LENGTHS = (7, 13, 5, 10)  # four samples of different lengths


def padded_batch(vocab: int, lengths=LENGTHS, seed: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded ``tokens`` and 0/1 ``attention_mask`` ``[len(lengths), max(lengths)]``, random real tokens."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    return {
        "tokens": torch.randint(0, vocab, (len(lengths), width), generator=g) * mask,
        "attention_mask": mask,
    }


@torch.no_grad()
def hf_logits_per_sample(model, batch) -> list[torch.Tensor]:
    """transformers' logits ``[L_i, V]`` of each sample run alone (no padding, no mask)."""
    lengths = batch["attention_mask"].sum(1).tolist()
    return [model(batch["tokens"][i : i + 1, :n]).logits[0] for i, n in enumerate(lengths)]


@torch.no_grad()
def packed_logits(model, batch) -> tuple[torch.Tensor, list[int]]:
    """thdpack's logits of ``batch`` packed into one row (``get_batch``, default ``BatchConfig``), ``[1, T, V]``,
    and the samples' starts in the row."""
    from thdpack.megatron.batch import BatchConfig, get_batch

    inputs = get_batch(iter([batch]), model.config, BatchConfig())
    logits = model(
        inputs.tokens,
        inputs.position_ids,
        None,
        packed_seq_params=inputs.packed_seq_params,
        padding_mask=inputs.padding_mask,
    )
    return logits, inputs.packed_seq_params.cu_seqlens_q_padded.tolist()


def max_logit_difference(model, hf, batch) -> float:
    """The largest ``|thdpack - transformers|`` over the real tokens' logits: ``model`` on ``batch`` packed,
    ``hf`` on each sample alone (the checkpoint's vocabulary only)."""
    logits, starts = packed_logits(model, batch)
    vocab = hf.config.vocab_size
    return max(
        float((logits[0, starts[i] : starts[i] + len(ref), :vocab] - ref).abs().max())
        for i, ref in enumerate(hf_logits_per_sample(hf, batch))
    )


@torch.no_grad()
def hf_loss(model, batch) -> float:
    """transformers' mean per-token loss on the padded batch (labels -100 on pad; it shifts them itself)."""
    labels = batch["tokens"].masked_fill(batch["attention_mask"] == 0, -100)
    return float(model(batch["tokens"], attention_mask=batch["attention_mask"], labels=labels).loss)


def megatron_model(
    directory, seq_length: int = 64, vocab_size: int | None = None, sequence_parallel: bool = False
):
    """thdpack's Megatron ``GPTModel`` of an HF directory for this rank's parallel layout (Megatron's parallel
    state must be initialised), as the training loop's family of the checkpoint builds it (weights loaded), torch attention,
    fp32, not wrapped. ``vocab_size``: the model's vocabulary instead of the recipe's (to force padding rows)."""
    from megatron.core import parallel_state as ps

    from thdpack.megatron.config import transformer_config
    from thdpack.megatron.runtime import Runtime
    from thdpack.models import get_family, pretrained_model_group

    tp = ps.get_tensor_model_parallel_world_size()
    group = pretrained_model_group(
        {"pretrained": str(directory), "attention_backend": "torch"}, seq_length=seq_length, tp=tp
    )
    parallel = parallel_sizes(sequence_parallel)
    runtime = Runtime("cpu", "fp32", "torch")
    config = transformer_config(group, parallel, runtime)
    family = get_family(group["family"])
    return family.build(group, config, vocab_size or group["vocab_size"], seq_length, runtime).eval()


def save_run_checkpoint(gpt, source: str | Path, root: str | Path, precision: str = "fp32") -> Path:
    """``gpt`` (one rank's whole model) written as a training run's checkpoint of ``source`` in ``root``: the
    distributed checkpoint ``root/iter_0000001`` (the model's sharded state dict, as the training loop saves it),
    marked the latest, and ``root/hf`` (what ``python -m thdpack.export`` needs). Returns the iteration
    directory."""
    from megatron.core import dist_checkpointing

    from thdpack.hf.directory import keep_with_checkpoint
    from thdpack.models import pretrained_model_group

    iteration = Path(root) / "iter_0000001"
    iteration.mkdir(parents=True)
    dist_checkpointing.save({"model": gpt.sharded_state_dict()}, str(iteration))
    group = pretrained_model_group(
        {"pretrained": str(source), "attention_backend": "torch"}, seq_length=64, tp=1
    )
    keep_with_checkpoint(root, group, precision)
    (Path(root) / "latest_checkpointed_iteration.txt").write_text("1")
    return iteration


def training_step_grads(model, batch) -> dict[str, torch.Tensor | None]:
    """The gradients of every parameter of ``model`` after thdpack's packed forward step on ``batch`` and a
    backward of its per-token loss (training mode)."""
    from thdpack.megatron.step import forward_step

    model.train()
    output, loss_func = forward_step(iter([batch]), model)
    loss_sum, count, _ = loss_func(output)
    (loss_sum / count).backward()
    return {name: p.grad for name, p in model.named_parameters()}


def write_config(directory: Path, config: dict):
    """``config`` written as ``directory/config.json``, opened as an :class:`~thdpack.hf.checkpoint.HFCheckpoint`."""
    from thdpack.hf.checkpoint import HFCheckpoint

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return HFCheckpoint.open(directory)


def parallel_sizes(sequence_parallel: bool = False) -> dict:
    """This rank's Megatron layout (its parallel state must be initialised) as a recipe's ``parallel`` group."""
    from megatron.core import parallel_state as ps

    return {
        "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
        "context_parallel_size": ps.get_context_parallel_world_size(),
        "expert_model_parallel_size": ps.get_expert_model_parallel_world_size(),
        "sequence_parallel": sequence_parallel,
    }


def whole_logits(local: torch.Tensor, starts: list[int]) -> torch.Tensor:
    """A last pipeline stage's logits ``[1, t, V / tp]`` as the whole row's ``[1, T, V]``: gathered over TP (the
    vocabulary) and CP (each CP rank holds its zigzag chunks of every sample; ``starts``: the samples' physical
    starts, ``cu_seqlens_q_padded``)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from thdpack import cp_unshard

    parts = [torch.empty_like(local) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, local.contiguous(), group=ps.get_tensor_model_parallel_group())
    logits = torch.cat(parts, dim=-1)
    if ps.get_context_parallel_world_size() > 1:
        shards = [torch.empty_like(logits) for _ in range(ps.get_context_parallel_world_size())]
        dist.all_gather(shards, logits.contiguous(), group=ps.get_context_parallel_group())
        logits = cp_unshard(shards, torch.tensor(starts), dim=1)
    return logits


def run_schedule(model, batch, forward_step, seq_length: int, forward_only: bool = False):
    """Megatron's schedule over the one micro-batch ``batch`` (gradients zeroed first unless ``forward_only``)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    if not forward_only:
        model.zero_grad_buffer()
    # megatron-core keeps the MoE aux-loss scale in a class attribute and copies each step's into it: another
    # in-process test's optimizer may have left one of another shape ([] against [1]), so start afresh
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter([batch]),
        model=[model],
        num_microbatches=1,
        seq_length=seq_length,
        micro_batch_size=1,
        forward_only=forward_only,
    )
