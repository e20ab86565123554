"""A thdpack checkpoint's language model as Hugging Face tensors: the run's Megatron config from its ``hf/``
directory, and the checkpoint's ``GPTModel`` tensors mapped to HF names by the family's mapping
(:mod:`thdpack.hf.mapping`), as saved (dtype, bits). Used by the text families' export
(:mod:`thdpack.models.decoder`) and the VL one (:mod:`thdpack.hf.vl_export`)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from .dist_checkpoint import checkpoint_tensors
from .mapping import (
    VOCAB,
    Dims,
    Rule,
    active_rules,
    expected_hf_names,
    layer_types,
    match_name,
    megatron_to_hf,
    to_hf,
)

__all__ = ["checkpoint_hf_tensors", "gpt_hf_tensors", "hf_state", "run_config"]


def run_config(hf_dir: str | Path):
    """``(Megatron TransformerConfig, tied embeddings, model group)`` of the run that kept ``hf_dir``, for one CPU
    process without model parallelism. Needs no process group."""
    from thdpack.megatron.config import transformer_config
    from thdpack.megatron.runtime import Runtime

    record = json.loads((Path(hf_dir) / "thdpack.json").read_text())
    model = dict(record["model"])
    # Sequential experts on CPU; the checkpoint stores grouped-GEMM experts the same way (dist_checkpoint).
    model["config"] = {**model.get("config", {}), "moe_grouped_gemm": False}
    ones = dict.fromkeys(
        (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "expert_model_parallel_size",
        ),
        1,
    )
    runtime = Runtime("cpu", record.get("precision", "fp32"), "torch")
    config = transformer_config(model, ones, runtime)
    return config, bool(model.get("share_embeddings_and_output_weights")), model


def _dims(config, vocab: int) -> Dims:
    return Dims.of(config, vocab)


def hf_state(gpt, mapping: Iterable[Rule], vocab: int) -> dict[str, torch.Tensor]:
    """The HF tensors of a whole Megatron ``GPTModel`` (one rank holding every layer and expert) by the family's
    ``mapping``; ``vocab``: config.json's ``vocab_size`` (rows past it are Megatron's padding, dropped)."""
    rules = active_rules(mapping, bool(gpt.share_embeddings_and_output_weights))
    return megatron_to_hf(gpt.state_dict(), rules, _dims(gpt.config, vocab))


def checkpoint_hf_tensors(
    iteration_dir: str | Path, hf_dir: str | Path, mapping: Iterable[Rule], vocab: int
) -> dict[str, torch.Tensor]:
    """The HF tensors of the model in the distributed checkpoint ``iteration_dir``, as saved (dtype, bits),
    for the run whose ``hf/`` directory is ``hf_dir``, by the family's ``mapping`` (``vocab``: config.json's
    ``vocab_size``). A checkpoint tensor without an HF counterpart, or an HF tensor the checkpoint does not give,
    stops it, naming both."""
    iteration_dir = Path(iteration_dir)
    config, tied, _ = run_config(hf_dir)
    rules = active_rules(mapping, tied)
    out = gpt_hf_tensors(checkpoint_tensors(iteration_dir), rules, config, vocab, iteration_dir, hf_dir)
    expected = expected_hf_names(rules, config.num_layers, config.num_moe_experts or 0, layer_types(config))
    missing = sorted(expected - set(out))
    if missing:
        raise ValueError(
            f"{iteration_dir}: the checkpoint gives no tensor for {len(missing)} Hugging Face tensors of this "
            f"model, e.g. {missing[:4]}"
        )
    return out


def gpt_hf_tensors(
    tensors: Mapping[str, torch.Tensor],
    rules: tuple[Rule, ...],
    config,
    vocab: int,
    iteration_dir,
    hf_dir,
    prefix: str = "",
) -> dict[str, torch.Tensor]:
    """The HF tensors (text-model names) of a ``GPTModel``'s checkpoint ``tensors`` (names as
    :func:`~thdpack.hf.dist_checkpoint.checkpoint_tensors` gives them; ``prefix``: the GPTModel's, as written in
    errors) by ``rules`` (the family's mapping for its tied or untied embeddings: :func:`~thdpack.hf.mapping.
    active_rules`). A tensor without an HF counterpart, or two giving one HF tensor, stops it, naming them."""
    dims = _dims(config, vocab)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        m = match_name(name, rules)
        if m is None:
            raise ValueError(
                f"{iteration_dir}: the checkpoint's tensor '{prefix}{name}' has no Hugging Face counterpart in "
                f"the family's mapping for this model ({Path(hf_dir) / 'thdpack.json'})"
            )
        if m.rule.kind == VOCAB and tensor.shape[0] < dims.vocab:
            raise ValueError(
                f"{iteration_dir}: '{prefix}{name}' has {tensor.shape[0]} rows but config.json's vocab_size is "
                f"{dims.vocab}: the checkpoint is not of this model"
            )
        for hf_name, part in zip(m.hf_names, to_hf(m.rule.kind, tensor, dims), strict=True):
            if hf_name in out:
                raise ValueError(
                    f"{iteration_dir}: two checkpoint tensors give '{hf_name}' (one is '{prefix}{name}')"
                )
            out[hf_name] = part
    return out
