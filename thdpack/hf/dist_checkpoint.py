"""The model tensors of a Megatron distributed checkpoint (``torch_dist`` format), read with
``torch.distributed.checkpoint`` alone, whatever layer spec and parallel layout the run saved with.

    tensors = checkpoint_tensors("ckpt/iter_0000100")
    tensors["decoder.layers.3.self_attention.linear_qkv.weight"]              # one layer's whole tensor
    tensors["decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight"] # one expert's

What the checkpoint holds, from megatron-core 0.16.1's ``sharded_state_dict`` code:

- each tensor once, at its global shape (tensor-, expert- and pipeline-parallel shards put together by DCP);
- layers stacked on a leading axis under ``decoder.layers.<name>`` (``TransformerBlock.sharded_state_dict``), or
  one key per layer, ``decoder.layers.<i>.<name>``, where the layers differ (``non_homogeneous_layers``);
- experts stacked on the next axis under ``...mlp.experts.experts.<name>``, the same for ``SequentialMLP`` and
  Transformer Engine's grouped GEMM (``TEGroupedMLP.sharded_state_dict``, ``SequentialMLP.sharded_state_dict``
  in ``transformer/moe/experts.py``); a gated ``linear_fc1`` as ``[gate; up]`` whatever the TP size
  (``apply_swiglu_sharded_factory``);
- the names of the layer spec the run used: the local spec saves its norms under Transformer Engine's fused
  names (``self_attention.linear_qkv.layer_norm_weight``; ``mlp.linear_fc1.layer_norm_weight`` even for MoE
  layers), Transformer Engine's MoE spec keeps a separate ``pre_mlp_layernorm.weight``;
- beside the model: ``_extra_state`` objects of Transformer Engine modules and ``rng_state`` (stored as bytes),
  the optimizer's tensors (``optimizer.*``; ``chained_<i>.optimizer.*`` where megatron-core chains one optimizer
  per parameter group, as for expert-parallel MoE runs: dense and expert parameters reduce over different data
  parallel groups); scheduler and thdpack's own entries live in ``common.pt``.

Only model tensors are read (the optimizer's are about three times their size). Names are returned as one model
holding every layer and expert would have them; :mod:`thdpack.hf.mapping` takes either spec's names. A model that
wraps the ``GPTModel`` (:class:`thdpack.megatron.vlm.VisionLanguageModel`) saves it under ``language_model.``:
its layers are stacked the same way behind that prefix; the wrapper's other modules (the vision tower, a plain
``torch.nn.Module``) save one whole tensor per parameter under their own names (``visual.blocks.0.attn.qkv.weight``).
"""

from __future__ import annotations

import re
import warnings
from math import prod
from pathlib import Path

import torch

__all__ = ["checkpoint_tensors", "model_tensor_keys", "unstacked_name", "whole_entries"]

_LAYERS = "decoder.layers."
_STACKED_EXPERTS = "mlp.experts.experts."
# Where a GPTModel's own names start: the model itself, or the language model of a vision-language wrapper.
_GPT_PREFIXES = ("", "language_model.")
_PER_LAYER = re.compile(r"(?:language_model\.)?decoder\.layers\.(\d+)\.")
# ChainedOptimizer.sharded_state_dict prefixes each optimizer's keys with chained_<i>.
_OPTIMIZER = re.compile(r"(?:chained_\d+\.)?optimizer\.")


def _layers_prefix(key: str) -> str | None:
    """``decoder.layers.`` behind the GPTModel prefix ``key`` starts with, None for a key outside any decoder."""
    for prefix in _GPT_PREFIXES:
        if key.startswith(prefix + _LAYERS):
            return prefix + _LAYERS
    return None


def _is_model_tensor(key: str) -> bool:
    # Transformer Engine's _extra_state and the RNG states are ShardedObjects (bytes, not tensors): skipped by
    # kind in model_tensor_keys, and by name here should a writer ever store one as a tensor.
    return not (_OPTIMIZER.match(key) or key.startswith("rng_state") or "_extra_state" in key)


def _stacked_axes(key: str) -> tuple[str, ...]:
    """The leading axes of a checkpoint tensor that stack layers and experts, outermost first."""
    axes = []
    layers = _layers_prefix(key)
    if layers and not _PER_LAYER.match(key):
        axes.append("layer")
    if layers and _STACKED_EXPERTS in key:
        axes.append("expert")
    return tuple(axes)


def unstacked_name(key: str, index: tuple[int, ...]) -> str:
    """The model's name of entry ``index`` (along :func:`_stacked_axes`) of the checkpoint tensor ``key``:
    ``decoder.layers.mlp.experts.experts.linear_fc1.weight`` at ``(3, 5)`` is
    ``decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight``; ``language_model.decoder.layers.X`` at
    ``(1,)`` is ``language_model.decoder.layers.1.X``."""
    axes = dict(zip(_stacked_axes(key), index, strict=True))
    name = key
    if "layer" in axes:
        layers = _layers_prefix(key)
        name = f"{layers}{axes['layer']}.{name.removeprefix(layers)}"
    if "expert" in axes:
        name = name.replace(_STACKED_EXPERTS, f"mlp.experts.local_experts.{axes['expert']}.", 1)
    return name


def model_tensor_keys(directory: str | Path) -> dict[str, object]:
    """``{key: DCP TensorStorageMetadata}`` of the checkpoint's model tensors (global shapes, dtype, chunks). The
    checkpoint is read without running code from it (:mod:`thdpack.megatron.checkpoint_reader`): its byte objects
    are read as plain data too, and a checkpoint that holds anything else is refused."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from thdpack.megatron.checkpoint_reader import check_byte_objects, check_format, read_dcp_metadata

    directory = Path(directory)
    check_format(directory)
    metadata = read_dcp_metadata(directory / ".metadata")
    check_byte_objects(directory, metadata)
    meta = metadata.state_dict_metadata
    return {
        k: m for k, m in sorted(meta.items()) if isinstance(m, TensorStorageMetadata) and _is_model_tensor(k)
    }


def whole_entries(key: str, meta, depth: int, directory: str | Path) -> list[tuple[int, ...]]:
    """The entries along the ``depth`` stacked axes that the checkpoint holds whole (layers of another kind are
    absent from a stacked key); one held in part is an error."""
    inner = prod(meta.size[depth:])
    covered: dict[tuple[int, ...], int] = {}
    for chunk in meta.chunks:
        ranges = [range(o, o + s) for o, s in zip(chunk.offsets[:depth], chunk.sizes[:depth], strict=True)]
        for index in _product(ranges):
            covered[index] = covered.get(index, 0) + prod(chunk.sizes[depth:])
    partial = sorted(i for i, n in covered.items() if n != inner)
    if partial:
        raise ValueError(
            f"{directory}: '{key}' holds only part of entry {partial[0]} (of shape {list(meta.size)}, "
            f"{covered[partial[0]]} of {inner} elements): the checkpoint is incomplete"
        )
    return sorted(covered)


def _first_failure(error) -> str:
    failures = getattr(error, "failures", None) or {}
    for failure in failures.values():
        cause = getattr(failure, "exc", failure)
        return f"{type(cause).__name__}: {cause}"
    return str(error)


def _product(ranges: list[range]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for r in ranges:
        out = [(*prefix, i) for prefix in out for i in r]
    return out


def checkpoint_tensors(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every model tensor of the distributed checkpoint in ``directory`` (an ``iter_XXXXXXX`` directory), whole,
    in the dtype it was saved in, one per layer and expert (names: module docstring). Reads in this process
    only; no process group is needed."""
    import torch.distributed.checkpoint as dcp

    from thdpack.megatron.checkpoint_reader import SafeFileSystemReader

    directory = Path(directory)
    keys = model_tensor_keys(directory)
    if not keys:
        raise ValueError(f"{directory}: the checkpoint holds no model tensors")
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in keys.items()}
    with warnings.catch_warnings():
        # no_dist=True is the point: one process reads what every rank wrote
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load(state, storage_reader=SafeFileSystemReader(str(directory)), no_dist=True)
        except dcp.api.CheckpointException as error:  # a shard that ends early or cannot be read
            raise ValueError(f"{directory}: its tensors cannot be read ({_first_failure(error)})") from None
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        axes = _stacked_axes(key)
        for index in whole_entries(key, keys[key], len(axes), directory):
            out[unstacked_name(key, index)] = tensor[index] if index else tensor
    return out
