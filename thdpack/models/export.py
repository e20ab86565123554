"""A thdpack training checkpoint as a Hugging Face directory: ``python -m thdpack.export CHECKPOINT_DIR OUT_DIR``
(a LoRA run's: merged into its base, or ``--adapter``: PEFT's adapter directory, :mod:`thdpack.models.lora`).

The export reads the model's tensors straight from the distributed checkpoint with ``torch.distributed.checkpoint``
(:mod:`thdpack.hf.dist_checkpoint`: whole tensors whatever tensor, pipeline, context and expert parallel layout
the run saved with, and whichever layer spec it trained with: local or Transformer Engine, sequential or
grouped-GEMM experts); the run's family (found by the kept ``config.json``'s architectures) maps them to the
checkpoint's tensors (``ModelFamily.export``), and :func:`thdpack.hf.directory.write_hf_directory` writes
``config.json``, safetensors shards with ``model.safetensors.index.json``, and the tokenizer and processor files.
No model is built. The tensors keep the checkpoint's dtype and bits.

Vision-language runs (Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE; :mod:`thdpack.hf.vl_export`): the language model
through its text family's mapping (Qwen3-VL-MoE's experts fused back as the source stored them), the vision tower
(transformers' module, frozen or trained) as the checkpoint holds it, every tensor under the name the source
directory gave it (``model.layers.*`` / ``visual.*`` or ``model.language_model.*`` / ``model.visual.*``), exactly
the source's set of tensors.

Checked with transformers 5.24.0 (CPU) and 5.17 (GPU host): ``AutoModelForCausalLM.from_pretrained(OUT_DIR)``;
for VL runs, on CPU with 5.24.0, ``AutoModelForImageTextToText.from_pretrained(OUT_DIR)`` with no missing or
unexpected keys.
"""

from __future__ import annotations

import argparse
import functools
import warnings
from pathlib import Path

from thdpack.hf.checkpoint import HFCheckpoint
from thdpack.hf.directory import DEFAULT_SHARD_BYTES, resolve_checkpoint, write_hf_directory

from .registry import family_of

__all__ = ["export_checkpoint", "load_checkpoint_model", "main", "start_one_process_group"]


def export_checkpoint(
    checkpoint: str | Path,
    out_dir: str | Path,
    iteration: int | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    adapter: bool = False,
    base: str | Path | None = None,
) -> Path:
    """Export ``checkpoint`` (a run's checkpoint.dir or one of its iteration directories) to ``out_dir``. A LoRA
    run's (:mod:`thdpack.models.lora`): merged into its base (``base``: the base's directory when it moved), or
    with ``adapter`` its PEFT adapter directory alone."""
    from .lora import export_adapter, export_merged, saved_peft

    iteration_dir, hf_dir = resolve_checkpoint(checkpoint, iteration)
    if saved_peft(iteration_dir) is not None:
        if adapter:
            return export_adapter(iteration_dir, hf_dir, out_dir)
        return export_merged(iteration_dir, hf_dir, out_dir, base, max_shard_bytes)
    if adapter or base is not None:
        raise ValueError(
            f"{iteration_dir} is a full fine-tune's checkpoint (no LoRA adapters): --adapter and --base are for "
            "runs with peft=lora; export it without them"
        )
    kept = HFCheckpoint.open(hf_dir)
    tensors = family_of(kept).export(iteration_dir, kept)
    return write_hf_directory(out_dir, tensors, kept.config, hf_dir, max_shard_bytes)


def load_checkpoint_model(iteration_dir: str | Path, hf_dir: str | Path):
    """The run's ``GPTModel``, built on CPU without model parallelism with the local layer spec, holding the
    checkpoint's weights (through the same HF tensors the export writes; rows past the vocabulary are zero and
    never predicted) and the imported RoPE frequencies. Starts a one-process gloo group and Megatron's parallel
    state if none is running."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from thdpack.hf.checkpoint_hf import run_config
    from thdpack.hf.directory import InMemoryTensors
    from thdpack.hf.load import load_weights, never_predict_padding, set_rotary_frequencies
    from thdpack.hf.mapping import layer_types
    from thdpack.hf.vl_checkpoint import has_vision
    from thdpack.megatron.cpu import initialize_model_parallel_cpu
    from thdpack.megatron.models import build_gpt_model

    kept = HFCheckpoint.open(hf_dir)
    if has_vision(kept.config):
        raise ValueError(
            f"{kept.path}: a vision-language run; load_checkpoint_model rebuilds text models only (export it with "
            "export_checkpoint, or load the checkpoint into the model its family builds)"
        )
    family = family_of(kept)
    tensors = family.export(Path(iteration_dir), kept)
    config, tied, model = run_config(hf_dir)
    if not dist.is_initialized():
        start_one_process_group()
    if not ps.model_parallel_is_initialized():
        initialize_model_parallel_cpu()
    build, extra = build_gpt_model, {}
    types = layer_types(config)
    if types is not None:  # layers of two kinds (Qwen3.5: gated DeltaNet and full attention)
        from thdpack.megatron.hybrid_model import build_hybrid_model

        build, extra = (
            functools.partial(build_hybrid_model, layer_types=types),
            {"rotary_percent": model["rotary_percent"]},
        )
    gpt = build(
        config,
        vocab_size=int(model["vocab_size"]),
        max_sequence_length=1,  # RoPE lengths are computed per call; no weight depends on it
        backend="torch",
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=tied,
        **extra,
    )
    _refuse_layers_of_their_own(gpt, family, tied, kept)
    vocab = int(kept.config["vocab_size"])
    load_weights(gpt, InMemoryTensors(tensors, Path(iteration_dir)), family.mapping, vocab)
    # what the weights do not carry, as at import
    set_rotary_frequencies(gpt, model["rotary_base"], model.get("rope_scaling"))
    never_predict_padding(gpt, vocab)
    return gpt


def _refuse_layers_of_their_own(gpt, family, tied: bool, kept: HFCheckpoint) -> None:
    """Stop where the family's layers hold tensors the plain ``GPTModel`` lacks (Gemma 3's post-norms, gpt-oss's
    sinks): the rebuilt model would compute something else."""
    from thdpack.hf.mapping import active_rules, match_name

    rules = [r for r in active_rules(family.mapping, tied) if "{layer}" in r.megatron[0]]
    matched = {m.rule for name in gpt.state_dict() if (m := match_name(name, rules)) is not None}
    missing = [r.megatron[0] for r in rules if r not in matched]
    if missing:
        raise ValueError(
            f"{kept.path}: the '{family.name}' family's layers hold {missing[:3]}, which the plain GPTModel that "
            "load_checkpoint_model rebuilds lacks: export the checkpoint (export_checkpoint) and load it with "
            "transformers, or build the family's own model"
        )


def start_one_process_group() -> None:
    """A one-process gloo group whose store lives in memory: nothing left on disk (a file store's directory
    outlived every export)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m thdpack.export",
        description="Write a thdpack checkpoint of a run that imported a Hugging Face model as a Hugging Face "
        "directory (config.json, safetensors shards with index, tokenizer and processor files).",
    )
    parser.add_argument(
        "checkpoint", help="the run's checkpoint.dir (its latest checkpoint) or an iter_XXXXXXX dir"
    )
    parser.add_argument("out_dir", help="a new or empty directory")
    parser.add_argument(
        "--iteration", type=int, default=None, help="export this iteration instead of the latest"
    )
    parser.add_argument("--max-shard-gib", type=float, default=5.0, help="largest safetensors shard (GiB)")
    parser.add_argument(
        "--adapter",
        action="store_true",
        help="a LoRA run (peft=lora): write its PEFT adapter directory (adapter_config.json, "
        "adapter_model.safetensors) instead of the model merged with it",
    )
    parser.add_argument(
        "--base",
        default=None,
        help="a LoRA run: its base model's directory, where it is no longer at the run's model.pretrained",
    )
    args = parser.parse_args(argv)
    # megatron-core without Apex/TE on CPU, and torch's renamed collectives: expected, not news
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    warnings.filterwarnings("ignore", category=FutureWarning)
    max_shard_bytes = int(args.max_shard_gib * 2**30)
    try:  # no such checkpoint, an occupied out_dir, a run without a Hugging Face model, ...
        out = export_checkpoint(
            args.checkpoint, args.out_dir, args.iteration, max_shard_bytes, args.adapter, args.base
        )
    except (OSError, ValueError) as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    print(f"exported {args.checkpoint} to {out}")
