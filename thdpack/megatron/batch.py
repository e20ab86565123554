"""``get_batch``: read a padded micro-batch once per TP group, pack it, shard it for CP, move it to the device.

Only the first rank of each tensor-parallel group reads the data iterator. It packs on the host and sends the
host :class:`~thdpack.PackedBatch` to the other TP ranks over a gloo group, so neither side ever reads a
device tensor back: the only device work is ``non_blocking`` copies. Every pipeline stage reads and packs
its own micro-batch (the data loader is replicated over PP, as in Megatron): middle stages need the boundary
arrays for attention, the MoE padding mask and the MRoPE ids, first stages the tokens, last stages the labels.

The batch hook (``BatchConfig.transform`` and ``carry_keys``) is where a VLM or a custom dataset adapts a batch:
the transform runs on the reader's host batch before packing, and the entries that are not token-aligned
(images, grids) travel beside the packed row to ``ModelInputs.extra``, where the model family's forward
(:mod:`thdpack.models`) takes them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from thdpack import Alignment, PackedBatch, pack_bshd
from thdpack.packing.labels import IGNORE_INDEX, no_target
from thdpack.packing.validate import check_bshd_batch

__all__ = [
    "BatchConfig",
    "BatchTransform",
    "ModelInputs",
    "allgather_dispatch_rule",
    "alignment_for",
    "get_batch",
    "model_alignment",
]

BatchTransform = Callable[[dict[str, torch.Tensor]], Mapping[str, torch.Tensor]]


@dataclass(frozen=True)
class BatchConfig:
    """What ``get_batch`` needs besides the model's ``TransformerConfig``.

    Attributes:
        pack_sequences_in_batch: pack each micro-batch into one THD row (else: the padded BSHD baseline).
        alignment: the packed row's :class:`~thdpack.Alignment`, built once from the model config
            (:func:`model_alignment`); None derives the default one (mode ``auto``, no bucket) at every call.
        pad_token_id: token written on alignment pad.
        ignore_index: label value that marks "no target" in the data (-100, HF's and Megatron-Bridge's).
        transform: the batch hook, run on the first rank of each TP group on the loader's host batch before
            anything else reads it: returns the batch the step packs (e.g. MRoPE ids computed from image grids,
            or keys renamed for a custom dataset). None: the batch as the loader gave it.
        carry_keys: batch entries that are not token-aligned (``pixel_values [P, C]``, ``image_grid_thw
            [I, 3]``): taken out before packing, sent to the TP peers with the packed batch, copied to the device
            and handed to the model call in ``ModelInputs.extra``.
    """

    pack_sequences_in_batch: bool = True
    alignment: Alignment | None = None
    pad_token_id: int = 0
    ignore_index: int = IGNORE_INDEX
    transform: BatchTransform | None = None
    carry_keys: tuple[str, ...] = ()


def alignment_for(
    model_config, cp_size: int, tp_size: int, mode: str = "auto", pad_total_to: int | None = None
) -> Alignment:
    """The :class:`~thdpack.Alignment` a model of ``model_config`` (sequence parallelism, fp8) needs on
    ``cp_size`` x ``tp_size`` ranks.

    ``mode``: ``"distinct"``, ``"fold"``, or ``"auto"``: fold under context parallelism, distinct otherwise
    (without CP no pad lies between samples, so both give the same row). Fold under CP because Transformer Engine
    2.20.2's context-parallel THD attention returned wrong gradients with distinct boundaries (pad between
    samples) while its forward matched; fold matched the reference (README, GPU check). Fold is valid for causal
    attention only. ``pad_total_to``: a fixed token bucket.
    """
    if mode == "auto":
        mode = "fold" if cp_size > 1 else "distinct"
    return Alignment(
        cp_size=cp_size,
        tp_size=tp_size,
        sequence_parallel=bool(model_config.sequence_parallel),
        fp8=bool(getattr(model_config, "fp8", None)),
        fp8_multiple=32 if getattr(model_config, "fp8_recipe", None) == "mxfp8" else 16,
        mode=mode,
        pad_total_to=pad_total_to,
    )


def model_alignment(model_config, mode: str = "auto", pad_total_to: int | None = None) -> Alignment:
    """:func:`alignment_for` this process's CP and TP sizes, as ``megatron.core.parallel_state`` holds them."""
    from megatron.core import parallel_state as ps

    return alignment_for(
        model_config,
        ps.get_context_parallel_world_size(),
        ps.get_tensor_model_parallel_world_size(),
        mode,
        pad_total_to,
    )


def allgather_dispatch_rule(
    packed: bool, num_experts: int | None, ep_size: int, dispatcher: str, pad_total_to: int | None
) -> str | None:
    """Why this MoE layout cannot run packed, or None when it can: the ``allgather`` dispatcher all-gathers
    equal-sized token tensors over the expert-parallel group, but packed rows differ in length from rank to
    rank unless a token bucket fixes it."""
    if packed and num_experts and ep_size > 1 and dispatcher == "allgather" and pad_total_to is None:
        return (
            "moe_token_dispatcher_type=allgather all-gathers equal-sized token tensors over the expert-parallel "
            "group, but packed rows differ in length from rank to rank"
        )
    return None


@dataclass
class ModelInputs:
    """One micro-batch as the model family's forward takes it, on this rank's device (None where this stage
    does not need it).

    ``labels`` hold a valid token id (0) wherever there is no target: Megatron's vocab-parallel cross entropy
    has no ``ignore_index``, and ``loss_mask`` (float, 0 there) keeps those positions out of the loss.
    ``extra``: the batch's other entries on the device: token-aligned ones packed and CP-sharded like the
    tokens (``[1, T]``), and the ``BatchConfig.carry_keys`` entries as the batch hook left them.
    """

    tokens: torch.Tensor | None
    position_ids: torch.Tensor | None
    labels: torch.Tensor | None
    loss_mask: torch.Tensor | None
    attention_mask: torch.Tensor | None = None
    padding_mask: torch.Tensor | None = None
    packed_seq_params: object | None = None
    packed: PackedBatch | None = None  # the host-side packed batch of this rank (CP shard), for debugging
    extra: dict[str, torch.Tensor] = field(default_factory=dict)


def get_batch(
    data_iterator: Iterator[Mapping[str, torch.Tensor]] | None, model_config, config: BatchConfig
) -> ModelInputs:
    """Next micro-batch for this rank.

    Args:
        data_iterator: yields padded BSHD batches (host tensors: ``tokens`` ``[B, S]``, ``attention_mask``,
            optional ``seq_lengths``, ``labels``, ``loss_mask``, ``position_ids``, ``mrope_position_ids``, and
            the ``carry_keys`` entries); read on the first rank of each TP group only (others may pass None).
        model_config: the model's ``TransformerConfig`` (sequence parallelism, fp8, the MoE dispatcher).
        config: :class:`BatchConfig`.
    """
    from megatron.core import parallel_state as ps

    alignment = config.alignment
    if config.pack_sequences_in_batch and alignment is None:
        alignment = model_alignment(model_config)
    experts = getattr(model_config, "num_moe_experts", None)
    if config.pack_sequences_in_batch and experts:
        rule = allgather_dispatch_rule(
            True,
            experts,
            ps.get_expert_model_parallel_world_size(),
            model_config.moe_token_dispatcher_type,
            alignment.pad_total_to,
        )
        if rule:
            raise ValueError(
                f"{rule}: give BatchConfig.alignment a pad_total_to (a fixed token bucket) or use "
                "moe_token_dispatcher_type='alltoall'"
            )
    message = None
    if ps.get_tensor_model_parallel_rank() == 0:
        message = _read(data_iterator, config, alignment)
    batch, carried = _broadcast_over_tp(message)
    device = _device()
    carried = {k: _to_device(v, device) for k, v in carried.items()}
    first = ps.is_pipeline_first_stage(ignore_virtual=True)
    last = ps.is_pipeline_last_stage(ignore_virtual=True)
    if isinstance(batch, PackedBatch):
        inputs = _packed_inputs(
            batch,
            ps.get_context_parallel_world_size(),
            ps.get_context_parallel_rank(),
            first,
            last,
            device,
            config,
        )
    else:
        if ps.get_context_parallel_world_size() > 1:
            raise NotImplementedError(
                "the padded BSHD baseline does not shard for context parallelism: set pack_sequences_in_batch=True"
            )
        inputs = _bshd_inputs(batch, first, last, device, config)
    inputs.extra.update(carried)
    return inputs


def _read(data_iterator, config: BatchConfig, alignment: Alignment | None):
    """The first TP rank's work: the next batch, through the hook, split into what is packed and what is carried."""
    if data_iterator is None:
        raise ValueError("the first rank of each tensor-parallel group needs a data_iterator")
    batch = next(data_iterator)
    if not isinstance(batch, Mapping):
        raise TypeError(
            f"the data iterator yielded a {type(batch).__name__}: get_batch takes a mapping of [B, S] tensors "
            "(tokens, attention_mask, labels, ...)"
        )
    if config.transform is not None:
        batch = config.transform(dict(batch))
        if not isinstance(batch, Mapping):
            raise TypeError(
                f"BatchConfig.transform returned a {type(batch).__name__}: it must return the batch, a mapping "
                "of tensors"
            )
    batch = dict(batch)
    missing = [k for k in config.carry_keys if k not in batch]
    if missing:
        raise ValueError(f"batch lacks the key(s) {missing} of BatchConfig.carry_keys (has: {sorted(batch)})")
    carried = {k: batch.pop(k) for k in config.carry_keys}
    for key, value in carried.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"batch key '{key}' (in BatchConfig.carry_keys) is a {type(value).__name__}: pass a tensor"
            )
    if config.pack_sequences_in_batch:
        batch = pack_bshd(
            batch, alignment=alignment, pad_token_id=config.pad_token_id, ignore_index=config.ignore_index
        )
    return batch, carried


def _packed_inputs(
    packed: PackedBatch, cp_size: int, cp_rank: int, first: bool, last: bool, device, config
) -> ModelInputs:
    from .packed_seq_params import thd_packed_seq_params

    shard = packed.shard_for_cp(cp_size, cp_rank)
    # Boundaries, padding mask (MoE router, every stage) and position ids (RoPE/MRoPE are computed on every
    # stage) go everywhere; tokens only to the first stage, labels and loss mask only to the last.
    keep = dataclasses.replace(
        shard,
        tokens=shard.tokens if first else shard.tokens[:, :0],
        labels=_labels_for_model(shard.labels, config.ignore_index) if last else shard.labels[:, :0],
        loss_mask=shard.loss_mask if last else shard.loss_mask[:, :0],
    ).to(device, non_blocking=True)
    position_ids = keep.mrope_position_ids if keep.mrope_position_ids is not None else keep.position_ids
    return ModelInputs(
        tokens=keep.tokens if first else None,
        position_ids=position_ids,
        labels=keep.labels if last else None,
        loss_mask=keep.loss_mask if last else None,
        attention_mask=None,
        padding_mask=keep.padding_mask,
        packed_seq_params=thd_packed_seq_params(keep),
        packed=shard,
        extra=dict(keep.extra),
    )


def _bshd_inputs(batch: Mapping[str, torch.Tensor], first: bool, last: bool, device, config) -> ModelInputs:
    """The padded baseline: causal attention that never looks at a pad key; per-token loss on real targets."""
    # pack_bshd's entrance checks (types, dtypes, shapes, devices), then what this baseline needs of the mask.
    fields = check_bshd_batch(batch, "get_batch")
    tokens, mask = fields.tokens, fields.attention_mask
    B, S = tokens.shape
    if mask is not None and mask.dim() != 2:
        raise ValueError(
            f"batch key 'attention_mask' is {list(mask.shape)}: the padded BSHD baseline takes a 2D 0/1 mask "
            "(4D masks need pack_sequences_in_batch=True)"
        )
    if mask is not None and mask.dtype != torch.bool:
        lo, hi = torch.aminmax(mask.cpu())  # the baseline is a reference, not a fast path
        if lo < 0 or hi > 1:
            raise ValueError(
                f"batch key 'attention_mask' holds values in [{lo.item()}, {hi.item()}]: the padded BSHD "
                "baseline takes a 0/1 mask (segment ids, several samples per row, need "
                "pack_sequences_in_batch=True)"
            )
    real = mask.bool() if mask is not None else torch.ones(B, S, dtype=torch.bool)
    if fields.seq_lengths is not None:  # the loader's lengths, as pack_bshd takes them
        real = torch.arange(S) < fields.seq_lengths[:, None]
    labels = fields.labels
    if labels is None:
        labels = torch.full_like(tokens, config.ignore_index)
        labels[:, :-1] = torch.where(real[:, 1:], tokens[:, 1:], config.ignore_index)
    loss_mask = fields.loss_mask
    loss_mask = (~no_target(labels, config.ignore_index)).float() * (
        1.0 if loss_mask is None else loss_mask.float()
    )
    loss_mask = loss_mask * real
    position_ids = fields.mrope if fields.mrope is not None else fields.position_ids
    if position_ids is None:
        position_ids = torch.arange(S).expand(B, S)

    def move(t):
        return _to_device(t, device)

    # Megatron's mask convention: True = masked out. [B, 1, 1, S] masks pad keys; attention adds causality.
    attention_mask = move(~real[:, None, None, :])
    return ModelInputs(
        tokens=move(tokens) if first else None,
        position_ids=move(position_ids),
        labels=move(_labels_for_model(labels, config.ignore_index)) if last else None,
        loss_mask=move(loss_mask) if last else None,
        attention_mask=attention_mask,
        padding_mask=move(~real),
        extra={k: move(v) for k, v in fields.extra.items()},
    )


def _labels_for_model(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    return labels.masked_fill(no_target(labels, ignore_index), 0)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    # From pageable memory a CUDA copy waits for the stream to drain (a hidden sync): pin first.
    if device.type == "cuda" and t.device.type == "cpu":
        t = t.contiguous().pin_memory()  # contiguous: an expanded view cannot be pinned
    return t.to(device, non_blocking=True)


def _device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


_TP_GLOO_GROUP: dict[tuple[int, ...], object] = {}


def _broadcast_over_tp(obj):
    """Send the first TP rank's host object to the others of its TP group, over gloo (host memory only); the
    other ranks pass None and receive it."""
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_world_size() == 1:
        return obj
    group = _tp_gloo_group()
    box = [obj]
    dist.broadcast_object_list(box, src=ps.get_tensor_model_parallel_src_rank(), group=group)
    return box[0]


def _tp_gloo_group():
    """A gloo group with this rank's TP peers: the TP group itself when it already is gloo (CPU runs), else a
    gloo group over the same ranks, created once, lazily. Only its members take part
    (``use_local_synchronization``): pipeline stages reach their first ``get_batch`` at different times, so a
    group creation that involves every rank of the world does not belong here."""
    from megatron.core import parallel_state as ps

    tp_group = ps.get_tensor_model_parallel_group()
    if _is_gloo(tp_group):
        return tp_group
    ranks = tuple(dist.get_process_group_ranks(tp_group))
    if ranks not in _TP_GLOO_GROUP:
        _TP_GLOO_GROUP[ranks] = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True)
    return _TP_GLOO_GROUP[ranks]


def _is_gloo(group) -> bool:
    return dist.get_backend(group) == "gloo"
