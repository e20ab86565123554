"""Entrance checks of every input the packer takes: one place for the rules and the messages.

Used by :func:`thdpack.pack_bshd` (and ``get_batch``'s padded baseline), :func:`thdpack.find_segments`,
:func:`thdpack.plan_layout` and :func:`thdpack.from_packed_batch`. These checks read attributes (type, dtype,
shape, device), never a device tensor's values: they cost no sync. Value checks that need a pass over the data
(holes in a mask, negative token ids) are made where the data is read anyway, on the host.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import numpy as np
import torch

__all__ = [
    "INTEGER_DTYPES",
    "MASK_DTYPES",
    "BshdFields",
    "check_bshd_batch",
    "check_fill_values",
    "check_lengths",
    "check_position_ids",
    "check_segment_inputs",
    "check_tensor",
]

# What each input may hold. Integer dtypes are the ones numpy reads as they are (thdpack reads host tensors with
# numpy); a mask may also be bool or floating (HF additive masks, bfloat16 collators).
INTEGER_DTYPES = frozenset({torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8})
MASK_DTYPES = INTEGER_DTYPES | {torch.bool, torch.float16, torch.bfloat16, torch.float32, torch.float64}

# Keys of a batch that is already packed (Megatron-Bridge / NeMo), in their two conventions (Bridge's
# get_packed_seq_params and gpt_step read both): from_packed_batch takes those.
LEGACY_PACKED_KEYS = (
    "cu_seqlens",
    "cu_seqlens_unpadded",
    "cu_seqlens_argmin",
    "cu_seqlens_unpadded_argmin",
    "max_seqlen",
)
CURRENT_PACKED_KEYS = (
    "cu_seqlens_q",
    "cu_seqlens_kv",
    "cu_seqlens_q_padded",
    "cu_seqlens_kv_padded",
    "max_seqlen_q",
    "max_seqlen_kv",
)
PACKED_KEYS = frozenset(LEGACY_PACKED_KEYS + CURRENT_PACKED_KEYS)

_WHAT = {
    INTEGER_DTYPES: "it must be an integer tensor (token ids, labels and position ids are integers)",
    MASK_DTYPES: "it holds bool, integer or floating values",
}


def check_tensor(name: str, t, dtypes: frozenset, what: str) -> None:
    """Raise ``TypeError`` unless ``t`` is a tensor of one of ``dtypes`` (``what`` says which, for the message)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} is a {type(t).__name__}: pass a torch.Tensor ({what})")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} is {t.dtype}: {what}")


def check_fill_values(pad_token_id: int, ignore_index: int) -> None:
    """``pad_token_id`` an int >= 0 (pad goes through the embedding too), ``ignore_index`` an int."""
    if not isinstance(pad_token_id, int) or isinstance(pad_token_id, bool):
        raise TypeError(f"pad_token_id={pad_token_id!r}: it must be an int")
    if pad_token_id < 0:
        raise ValueError(f"pad_token_id={pad_token_id}: pad is embedded like any token, so it must be >= 0")
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise TypeError(f"ignore_index={ignore_index!r}: it must be an int")


# ----------------------------------------------------------------------------------------------------------
# A padded [B, S] batch (pack_bshd, get_batch)


class BshdFields(NamedTuple):
    """A ``[B, S]`` batch split by role, every tensor checked for type, dtype, shape and device."""

    tokens: torch.Tensor
    tokens_key: str
    labels: torch.Tensor | None
    loss_mask: torch.Tensor | None
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor | None
    mrope: torch.Tensor | None
    extra: dict[str, torch.Tensor]
    seq_lengths: torch.Tensor | None = None


def pop_tokens(fields: dict, shape: str) -> tuple[torch.Tensor, str]:
    """Take the token ids out of ``fields`` (``tokens`` or ``input_ids``; the same tensor under both names is
    accepted, as Megatron-Bridge's collators send it): ``(tokens, key)``, checked to be an integer tensor.
    ``shape`` is the expected shape, for the message when neither key is there."""
    tokens = fields.pop("tokens", None)
    input_ids = fields.pop("input_ids", None)
    key = "tokens"
    if input_ids is not None:
        if tokens is not None and tokens is not input_ids:
            raise ValueError(
                "batch has both 'tokens' and 'input_ids' as different tensors: pass one (the same tensor under both "
                "names is accepted, as Megatron-Bridge's collators send it)"
            )
        tokens, key = input_ids, "input_ids" if tokens is None else "tokens"
    if tokens is None:
        raise ValueError(f"batch needs 'tokens' (or 'input_ids') of shape {shape}")
    check_tensor(f"batch key '{key}'", tokens, INTEGER_DTYPES, "token ids must be an integer tensor")
    return tokens, key


def check_bshd_batch(batch: Mapping[str, torch.Tensor], caller: str) -> BshdFields:
    """The entrance checks of :func:`thdpack.pack_bshd` (also run by ``get_batch``'s padded baseline): types,
    dtypes, shapes and devices of every key, from attributes only (no pass over the data, no device sync).

    ``caller`` names the function in messages. A key whose value is None is absent.
    """
    if not isinstance(batch, Mapping):
        raise TypeError(f"{caller} takes a mapping of tensors (a dict), got a {type(batch).__name__}")
    fields = dict(batch)
    tokens, tokens_key = pop_tokens(fields, "[B, S]")
    shape = tokens.shape
    if len(shape) != 2 or not shape[0] or not shape[1]:
        raise ValueError(
            f"batch key '{tokens_key}' is {list(shape)}: it must be [B, S] with B >= 1 rows and S >= 1 columns"
        )
    if not PACKED_KEYS.isdisjoint(fields):
        raise ValueError(
            f"batch key '{min(PACKED_KEYS.intersection(fields))}' marks a batch that is already packed "
            "(Megatron-Bridge / NeMo): adopt it with thdpack.from_packed_batch"
        )
    B, S = shape
    labels = fields.pop("labels", None)
    loss_mask = fields.pop("loss_mask", None)
    position_ids = fields.pop("position_ids", None)
    mrope = fields.pop("mrope_position_ids", None)
    attention_mask = fields.pop("attention_mask", None)
    seq_lengths = fields.pop("seq_lengths", None)
    if seq_lengths is not None:
        _check_seq_lengths(seq_lengths, B, S)
    # Position ids and the mask are read where they are (host or device), like find_segments does; the other
    # token-aligned keys must be on the tokens' device.
    for name, t, dtypes, same_device in (
        ("labels", labels, INTEGER_DTYPES, True),
        ("loss_mask", loss_mask, MASK_DTYPES, True),
        ("position_ids", position_ids, INTEGER_DTYPES, False),
    ):
        if t is not None:
            _check_key(name, t, dtypes, shape, same_device, tokens, tokens_key)
    if mrope is not None:
        _check_key("mrope_position_ids", mrope, INTEGER_DTYPES, (3, B, S), True, tokens, tokens_key)
    if attention_mask is not None and not (
        isinstance(attention_mask, torch.Tensor)
        and attention_mask.dtype in MASK_DTYPES
        and (attention_mask.shape == shape or attention_mask.shape == (B, 1, S, S))
    ):
        check_tensor("batch key 'attention_mask'", attention_mask, MASK_DTYPES, _WHAT[MASK_DTYPES])
        raise ValueError(
            f"batch key 'attention_mask' is {list(attention_mask.shape)} but '{tokens_key}' is {list(shape)}: "
            f"every [B, S] key must match {tokens_key} (a 4D mask is [B, 1, S, S] = {[B, 1, S, S]})"
        )
    any_none = False
    for name, t in fields.items():
        if t is None:
            any_none = True
        elif not isinstance(t, torch.Tensor):
            raise TypeError(
                f"batch key '{name}' is a {type(t).__name__}: {caller} packs only tensors (drop the key or make it a "
                "[B, S] tensor)"
            )
        else:
            _check_key(name, t, None, shape, True, tokens, tokens_key, caller)
    if any_none:
        fields = {k: v for k, v in fields.items() if v is not None}
    return BshdFields(
        tokens, tokens_key, labels, loss_mask, attention_mask, position_ids, mrope, fields, seq_lengths
    )


def _check_seq_lengths(seq_lengths, B: int, S: int) -> None:
    """``seq_lengths``: the real tokens of each right-padded row, as the loader knows them: an integer host
    tensor ``[B]``, every entry in ``[1, S]`` (a ``B``-sized read)."""
    check_tensor("batch key 'seq_lengths'", seq_lengths, INTEGER_DTYPES, "sample lengths are integers")
    if seq_lengths.shape != (B,):
        raise ValueError(
            f"batch key 'seq_lengths' is {list(seq_lengths.shape)}: it must be [B] = [{B}], one length a row"
        )
    if not seq_lengths.is_cpu:
        raise ValueError(
            f"batch key 'seq_lengths' is on {seq_lengths.device}: the lengths are host metadata (the loader's)"
        )
    lengths = seq_lengths.numpy()
    bad = (lengths < 1) | (lengths > S)
    if bad.any():
        row = int(bad.argmax())
        raise ValueError(
            f"row {row} of seq_lengths is {int(lengths[row])}: each row holds one right-padded sample of 1 to "
            f"S = {S} tokens"
        )


def _check_key(
    name: str,
    t,
    dtypes: frozenset | None,
    expected: tuple,
    same_device: bool,
    tokens: torch.Tensor,
    tokens_key: str,
    caller: str = "pack_bshd",
) -> None:
    """Raise for batch key ``name`` of :func:`check_bshd_batch`, naming what is wrong: its type, dtype, shape, or
    device, in that order. Returns when nothing is."""
    if dtypes is not None:
        check_tensor(f"batch key '{name}'", t, dtypes, _WHAT[dtypes])
    if t.shape != expected:
        if dtypes is None:
            rule = f"{caller} gathers every other key as a [B, S] tensor, and every [B, S] key must match {tokens_key}"
        elif len(expected) == 2:
            rule = f"every [B, S] key must match {tokens_key}"
        else:
            rule = f"{name} must be {list(expected)} ([3, B, S]: temporal, height, width)"
        raise ValueError(
            f"batch key '{name}' is {list(t.shape)} but '{tokens_key}' is {list(tokens.shape)}: {rule}"
        )
    if same_device and t.device != tokens.device:
        raise ValueError(
            f"batch key '{name}' is on {t.device} but '{tokens_key}' on {tokens.device}: token-aligned tensors must "
            "be on one device (the mask and position ids may stay on the host)"
        )


def check_position_ids(position_ids: torch.Tensor, row: np.ndarray, start: np.ndarray) -> None:
    """Each sample's first token has position id 0 (host ids; ``row``/``start``: each sample's row and first
    column, as :attr:`Segments.arrays` gives them). An ``N``-sized read: ids that count on across a sample
    boundary, or start a left-padded row at its column, are caught; the ids after a sample's first are not read,
    the packed row's restart at every sample and count up by 1."""
    first = position_ids.numpy()[row, start]
    if first.any():
        i = int(np.argmax(first != 0))
        raise ValueError(
            f"row {int(row[i])} of position_ids has {int(first[i])} at column {int(start[i])}, where sample {i} "
            "starts: position ids must restart at 0 at every sample (the packed row's position_ids do)"
        )


# ----------------------------------------------------------------------------------------------------------
# find_segments and plan_layout


def check_segment_inputs(attention_mask, position_ids, input_ids, pad_token_id) -> None:
    """find_segments' entrance: types and dtypes, and a batch of at least one row and one column (a few
    attribute reads, no pass over the data)."""
    shape = None
    if attention_mask is not None:
        check_tensor(
            "attention_mask", attention_mask, MASK_DTYPES, "a mask holds bool, integer or floating values"
        )
        shape = attention_mask.shape
    if position_ids is not None:
        check_tensor("position_ids", position_ids, INTEGER_DTYPES, "position ids must be an integer tensor")
        shape = shape or position_ids.shape
    if input_ids is not None:
        check_tensor("input_ids", input_ids, INTEGER_DTYPES, "token ids must be an integer tensor")
        shape = shape or input_ids.shape
    if pad_token_id is not None and (not isinstance(pad_token_id, int) or isinstance(pad_token_id, bool)):
        raise TypeError(f"pad_token_id is {pad_token_id!r}: it must be an int")
    if shape is not None and len(shape) >= 2 and (shape[0] == 0 or shape[-1] == 0):
        name = (
            "attention_mask"
            if attention_mask is not None
            else "position_ids"
            if position_ids is not None
            else "input_ids"
        )
        raise ValueError(
            f"{name} has shape {list(shape)}: an empty batch has no sample (a batch needs B >= 1 rows and S >= 1 "
            "columns)"
        )


def check_lengths(lengths) -> np.ndarray:
    """plan_layout's ``lengths`` as an int64 numpy array, after its checks (cheap: a few attribute reads and one
    ``min`` over ``N`` entries)."""
    if not isinstance(lengths, torch.Tensor):
        raise TypeError(
            f"plan_layout's lengths is a {type(lengths).__name__}: pass an integer torch.Tensor [N]"
        )
    if lengths.dtype not in INTEGER_DTYPES:
        raise TypeError(f"plan_layout's lengths is {lengths.dtype}: sample lengths must be an integer tensor")
    if not lengths.is_cpu:
        raise ValueError(f"plan_layout's lengths is on {lengths.device}: the layout is planned on the host")
    if lengths.dim() != 1 or lengths.numel() == 0:
        raise ValueError(
            f"plan_layout's lengths is {list(lengths.shape)}: it must be [N] with N >= 1 samples"
        )
    real = lengths.numpy().astype(np.int64, copy=False)  # small arrays: numpy keeps per-call overhead low
    if real.min() < 1:
        i = int(np.argmax(real < 1))
        raise ValueError(f"sample {i} has length {int(real[i])}: every sample needs at least one real token")
    return real
