"""The recipe resolved once: every ``auto`` made concrete before anything reads it.

``python -m thdpack.train`` composes a recipe with Hydra, resolves it here, checks it
(:func:`thdpack.training.checks.check_recipe`) and builds the run from it; nothing after this step decides what
``auto`` means again. ``--cfg job`` shows the recipe as written; the start-up log line shows the resolved values.
"""

from __future__ import annotations

import copy

from omegaconf import DictConfig, OmegaConf, open_dict

from thdpack.data.loader import micro_batch_tokens
from thdpack.megatron.fused_mlp import resolve_te_op_fuser
from thdpack.megatron.output_loss import resolve_output_loss
from thdpack.megatron.runtime import resolve_runtime
from thdpack.models.lora import lora_enabled, resolve_peft

from .config_error import ConfigError
from .recipe_keys import check_keys, recipes_dir
from .recipe_values import check_types
from .token_budget import fit_micro_batch_tokens

__all__ = ["check_required", "resolve_recipe"]

# What a required value (``???`` in a recipe file) takes, for the message that asks for it.
REQUIRED = {
    "model.pretrained": "DIR, a local Hugging Face model directory (config.json, safetensors weights, tokenizer "
    "files; python tests/make_tiny_hf.py DIR writes a tiny one)",
    "dataset.path": "FILE (dataset=jsonl, jsonl_vlm: a JSONL file; megatron_indexed: the .bin/.idx prefix)",
}


def resolve_recipe(cfg: DictConfig, device: str | None = None) -> DictConfig:
    """A copy of ``cfg`` with its ``auto`` settings made concrete for ``device`` (default: CUDA when a GPU is
    visible, else CPU):

    - ``trainer.precision``: bf16 on CUDA, fp32 on CPU;
    - ``model.attention_backend``: ``te`` on CUDA, ``torch`` on CPU;
    - ``model.te_op_fuser``: :func:`thdpack.megatron.fused_mlp.resolve_te_op_fuser` (true with the ``te`` backend,
      a dense MLP and no FP8 delayed scaling);
    - ``model.family``: ``gpt`` when absent;
    - with ``model.pretrained`` (``model=hf``): the model group from that directory's config.json
      (:func:`thdpack.models.pretrained_model_group`), built by the family of its architecture
      (:mod:`thdpack.models`), expanded first: every setting below reads it;
    - ``dataset.micro_batch_tokens``: an int or null (:func:`thdpack.data.loader.micro_batch_tokens`; ``fit``:
      :func:`thdpack.training.token_budget.fit_micro_batch_tokens` for this GPU);
    - ``dataset.mrope``: whether the collator emits MRoPE ids (``model.position_embedding_type == "mrope"``);
    - ``peft``: ``{"name": "none"}`` or every LoRA key set (:func:`thdpack.models.lora.resolve_peft`: nulls from
      ``peft.from_adapter``'s adapter or the defaults); ``model.te_op_fuser`` ``auto`` is false under LoRA (the
      adapters hang on the MLP's linear layers, which the fused MLP never calls).

    Raises :class:`~thdpack.training.checks.ConfigError` for a key that is not a recipe key (named with the
    closest one: :func:`thdpack.training.recipe_keys.check_keys`) and for a value that has no meaning.
    """
    check_required(cfg)
    check_keys(cfg, recipes_dir())
    check_types(cfg, recipes_dir())
    fit = cfg.dataset.get("micro_batch_tokens") == "fit"
    try:
        runtime = resolve_runtime(
            cfg.trainer.get("precision", "auto"),
            cfg.model.get("attention_backend", "auto"),
            device,
            cfg.trainer.get("fp8_recipe"),
        )
        budget = None if fit else micro_batch_tokens(cfg.dataset)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    out = copy.deepcopy(cfg)
    with open_dict(out):
        if cfg.model.get("pretrained"):  # model=hf: the checkpoint's config.json decides the architecture
            from thdpack.hf.checkpoint import HFConfigError
            from thdpack.models import pretrained_model_group

            try:
                out.model = pretrained_model_group(
                    cfg.model,
                    seq_length=int(cfg.dataset.seq_length),
                    tp=int(cfg.parallel.tensor_model_parallel_size),
                )
            except HFConfigError as e:
                raise ConfigError(str(e)) from None
        out.trainer.precision = runtime.precision
        out.model.attention_backend = runtime.backend
        out.model.family = out.model.get("family", "gpt")
        lora = lora_enabled(cfg.get("peft"))
        if lora and out.model.get("te_op_fuser") == "auto":
            out.model.te_op_fuser = False
        if "te_op_fuser" in out.model:
            out.model.te_op_fuser = resolve_te_op_fuser(out.model, out.trainer, runtime.backend)
        try:
            out.peft = resolve_peft(cfg.get("peft"), out.model)
        except (ValueError, OSError) as e:
            raise ConfigError(str(e)) from None
        if (
            fit
        ):  # the largest budget the measured memory model fits on this GPU (thdpack.training.token_budget)
            budget = fit_micro_batch_tokens(
                out, resolve_output_loss(out.model, runtime.device), _device_bytes(runtime.device)
            )
        out.dataset.micro_batch_tokens = budget
        out.dataset.mrope = out.model.get("position_embedding_type") == "mrope"
    return out


def check_required(cfg: DictConfig) -> None:
    """Raise :class:`ConfigError` naming a value the recipe leaves required (``???``) and the command line did not
    set: ``model=hf needs model.pretrained=DIR``."""
    for key in sorted(OmegaConf.missing_keys(cfg)):
        group = key.split(".")[0]
        option = cfg[group].get("name", "this recipe") if group in cfg else "the recipe"
        raise ConfigError(f"{group}={option} needs {key}={REQUIRED.get(key, 'VALUE')}")


def _device_bytes(device: str) -> int | None:
    import torch

    return torch.cuda.get_device_properties(0).total_memory if device == "cuda" else None
