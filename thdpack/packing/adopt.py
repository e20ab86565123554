"""Batches that arrive already packed: the packed-SFT forms of Megatron-Bridge and NeMo.

Every form is one THD row (``[1, T]`` token tensors) with two boundary arrays in TE's sense: *physical* (where
each sample's slot starts in the row, pad included) and *logical* (cumulative real tokens per slot). The forms
differ in key names, in how short arrays are filled to a batch width (``-1`` sentinels with an ``argmin``, or
the last boundary repeated), in whether the logical array is there at all, and in how the row's trailing fill is
marked. :func:`from_packed_batch` reads them all on the host and says which is which in its docstring.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from .adopt_rows import rows_as_one
from .assemble import assemble
from .labels import IGNORE_INDEX
from .layout import INT32_MAX, PackLayout
from .packed_batch import PackedBatch
from .segments import Segments
from .validate import (
    CURRENT_PACKED_KEYS,
    INTEGER_DTYPES,
    LEGACY_PACKED_KEYS,
    MASK_DTYPES,
    check_fill_values,
    check_position_ids,
    check_tensor,
    pop_tokens,
)

__all__ = ["from_packed_batch"]

# Keys that are not token-aligned and that a form carries as metadata: read for their checks or not at all.
_METADATA = ("token_count", "metadata", "total_tokens", "attention_mask")


def from_packed_batch(
    batch: Mapping[str, torch.Tensor], *, pad_token_id: int = 0, ignore_index: int = IGNORE_INDEX
) -> PackedBatch:
    """Adopt an already-packed Megatron-Bridge / NeMo batch (one THD row) as a :class:`PackedBatch`.

    The forms adopted, as their collate functions write them (``B = 1``: these batches train with micro-batch
    size 1; a ``[1, K]`` or ``[1, 1, K]`` array is read as ``[K]``, as Bridge's ``get_packed_seq_params``
    squeezes it):

    ============  ==========================================================================================
    NeMo          ``nemo/collections/nlp/data/language_modeling/megatron/gpt_sft_dataset.py`` and
                  ``nemo/collections/llm/gpt/data/core.py`` (``GPTSFTPackedDataset.collate_fn``):
                  ``cu_seqlens`` physical and ``cu_seqlens_unpadded`` logical, int32 ``[1, K]`` filled with
                  ``-1`` sentinels, ``cu_seqlens_argmin`` / ``cu_seqlens_unpadded_argmin`` ``[1, 1]`` (index
                  of the first sentinel), ``max_seqlen`` ``[1, 1]``, ``attention_mask`` a ``[1]`` tensor of
                  ones (a placeholder), ``token_count`` a list. The row's trailing fill is a last physical slot
                  with a zero-length logical slot; ``pad_cu_seqlens`` adds zero-length physical slots (repeats
                  of the width) that the logical array does not have.
    Bridge,       ``src/megatron/bridge/data/datasets/sft.py`` (``GPTSFTPackedDataset.collate_fn``, until
    legacy        July 2026): as NeMo, ``attention_mask`` None, and ``cu_seqlens_unpadded`` only when
                  ``pad_seq_to_mult > 1``. Without it the trailing fill is a slot of ``cu_seqlens`` like any
                  sample; ``token_count`` (one entry: the row's tokens before the fill) tells it apart.
    Bridge,       ``src/megatron/bridge/data/packing/gpt_sft.py`` (``GPTSFTPackedDataset.collate_fn``):
    offline       ``cu_seqlens_q`` logical (= ``cu_seqlens_kv``), ``cu_seqlens_q_padded`` physical (=
                  ``cu_seqlens_kv_padded``) only when ``pad_seq_to_mult > 1``, ``max_seqlen_q`` /
                  ``max_seqlen_kv`` ``[1, 1]``, ``padding_mask`` bool ``[1, T]`` (True on the fill and on
                  alignment gaps), no sentinels: rows are filled by repeating their last boundary. Without the
                  padded array the trailing fill is a slot of ``cu_seqlens_q``, all pad in ``padding_mask``;
                  without ``padding_mask`` (collated before Bridge added it, or dropped on the way),
                  ``token_count`` (the row's tokens before the fill) tells the fill slot apart.
                  Over a global batch (``B`` rows, ``cu_seqlens_q`` ``[B, K]``, each row filled by repeating
                  its last boundary) the rows are adopted side by side (:mod:`thdpack.packing.adopt_rows`): a
                  row's fill joins its last sample as pad, marked in ``padding_mask``.
    Bridge,       ``src/megatron/bridge/data/packing/in_batch.py`` (``build_mcore_thd_sequence_batch_from_rows``,
    in-batch      used by ``data/collators/sft.py``): 1-D ``cu_seqlens_q`` / ``_kv``, ``cu_seqlens_q_padded`` /
                  ``_kv_padded`` only when some sample is padded, 0-d ``max_seqlen_q`` / ``_kv``,
                  ``total_tokens`` (an int, ``T``), ``padding_mask`` when ``pad_to_multiple_of > 1``,
                  ``input_ids`` and ``tokens`` one tensor, ``metadata`` and ``token_count`` (one per sample).
                  ``pad_to_max_length`` widens the last sample's physical slot.
    ============  ==========================================================================================

    In every form the labels are built inside each sample (``labels[i]`` = the sample's next token), so the
    last token of a sample carries a real target (its end-of-sequence, in the offline forms; ``ignore_index``
    in the in-batch form): labels are kept as given on every real token, never masked at a sample's end.

    Args:
        batch: ``tokens`` (or ``input_ids``) integer ``[1, T]``; optional ``labels`` (integer), ``loss_mask``,
            ``position_ids``, ``padding_mask`` (bool, True = pad) and other ``[1, T]`` tensors (gathered into
            ``extra``); the boundary keys of one convention above, as **host** tensors (as the loader delivers
            them: that is what makes this sync-free, where Bridge's ``get_packed_seq_params`` calls ``.item()``
            every micro-batch); the metadata keys ``token_count``, ``metadata``, ``total_tokens``,
            ``attention_mask`` (None or NeMo's placeholder). A key whose value is None is absent.
        pad_token_id: token written on every pad position (the batch's own pad tokens, EOS in the offline
            forms, are replaced); an int >= 0.
        ignore_index: label written on pad.

    Returns:
        :class:`PackedBatch` with the batch's physical layout: each sample keeps its slot (``cu_seqlens_padded``
        the physical boundaries of the samples, ``cu_seqlens`` the logical ones), and the trailing fill slots
        and any tokens after the last boundary form one trailing pad segment. ``position_ids`` are rebuilt
        (restart at every slot); given ones must restart at 0 at each sample (host). Tokens between a sample's
        logical and physical end are pad. ``padding_mask`` is thdpack's, equal to a given host one. A loss mask
        that counts a position the boundaries declare pad is zeroed there, as Megatron-LM's sequence-packing
        scheduler does (``megatron/core/datasets/data_schedule.py``, ``_sanitize_thd_padding_values`` in
        ``get_batch_on_this_rank_for_sequence_packing``): the boundaries, not the loss mask, say what is pad.
        ``max_seqlen`` is the longest physical segment (a given ``max_seqlen`` may be larger: a static bound
        for CUDA graphs; smaller is an error).

    Raises:
        TypeError: a batch that is not a mapping, a value that is not a tensor where one is needed, a dtype a
            key may not have.
        ValueError: naming the key and the rule: boundary keys of both conventions, or on a device; boundaries
            that do not start at 0, decrease, pass ``T`` or hold a value after a sentinel; an ``argmin`` that is
            not the first sentinel; logical and physical arrays that disagree in count (beyond zero-length
            entries) or where a sample outgrows its slot; a slot without a real token before a sample (fill is
            trailing); ``kv`` arrays other than ``q``; ``max_seqlen`` below a sample's slot; ``total_tokens`` other
            than ``T``; a batch of several rows; and, for host tensors, a ``padding_mask`` that disagrees with
            the boundaries, a negative token id, position ids that do not restart at a sample. On a GPU, token tensors are not read back for the
            value checks (that would cost a sync); the boundary keys always are on the host.
    """
    if not isinstance(batch, Mapping):
        raise TypeError(
            f"from_packed_batch takes a mapping of tensors (a dict), got a {type(batch).__name__}"
        )
    check_fill_values(pad_token_id, ignore_index)
    rows = batch.get("tokens", batch.get("input_ids"))
    if (
        isinstance(rows, torch.Tensor)
        and rows.dim() == 2
        and rows.shape[0] > 1
        and batch.get("cu_seqlens_q") is not None
        and batch.get("cu_seqlens_q_padded") is None
    ):  # Bridge's offline form over a global batch: its rows side by side (thdpack.packing.adopt_rows)
        batch = rows_as_one(batch)
    fields = {k: v for k, v in batch.items() if v is not None}
    tokens, tokens_key = _pop_tokens(fields)
    T = tokens.shape[1]
    on_host = tokens.is_cpu
    physical, logical, max_seqlen = _pop_boundaries(fields, T)
    padding_mask = _pop_padding_mask(fields, tokens, tokens_key)
    token_count = _pop_metadata(fields, T)
    labels = _pop_token_key(
        fields, "labels", INTEGER_DTYPES, "labels are token ids, an integer tensor", tokens
    )
    loss_mask = _pop_token_key(
        fields, "loss_mask", MASK_DTYPES, "it holds bool, integer or floating values", tokens
    )
    position_ids = _pop_token_key(fields, "position_ids", INTEGER_DTYPES, "position ids are integers", tokens)
    for name, t in fields.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"batch key '{name}' is a {type(t).__name__}: from_packed_batch gathers every other key as a [1, T] "
                "tensor (drop the key or make it one)"
            )
        _check_token_key(name, t, tokens, tokens_key)

    slots = physical[1:] - physical[:-1]
    if logical is not None:
        lengths = logical[1:] - logical[:-1]
        over = lengths > slots
        if over.any():
            i = int(np.argmax(over))
            raise ValueError(
                f"sample {i} has {int(lengths[i])} real tokens (logical boundaries) in a physical slot of "
                f"{int(slots[i])}: a sample never outgrows its slot"
            )
    elif padding_mask is not None and padding_mask.is_cpu:
        # No logical array (Bridge's offline form with pad_seq_to_mult = 1): the mask says which slot is fill.
        real = np.zeros(T + 1, dtype=np.int64)
        np.cumsum(~padding_mask.numpy().reshape(-1), out=real[1:])
        lengths = real[physical[1:]] - real[physical[:-1]]
    elif padding_mask is not None:
        raise ValueError(
            f"batch key 'padding_mask' is on {padding_mask.device}: without logical boundaries it says which slot is "
            "fill, and from_packed_batch reads it on the host (keep it there, as the loader delivers it)"
        )
    elif token_count is not None:
        # One boundary array and no padding mask: the slots from token_count on are the row's fill. Bridge's
        # legacy form (datasets/sft.py) and its offline form (data/packing/gpt_sft.py, GPTSFTPackedDataset.collate_fn
        # with pad_seq_to_mult = 1) both write token_count = len(input_ids) per row and append the fill
        # [token_count, max_length) as one more slot of cu_seqlens / cu_seqlens_q; the offline form's padding_mask,
        # when the batch still carries it, is True exactly on [token_count, max_length).
        # The fill may also be the tail of the last declared sequence: that slot's real tokens end at token_count.
        if not 0 < token_count <= T:
            raise ValueError(f"batch key 'token_count' is {token_count}: the row's real tokens, in (0, {T}]")
        lengths = np.clip(token_count - physical[:-1], 0, slots)
    else:
        lengths = slots  # every slot a sample (the form says no more)

    is_real = lengths > 0
    if not is_real.any():
        raise ValueError("the packed batch has no real token: every slot is empty or fill")
    n_real_slots = int(np.flatnonzero(is_real)[-1]) + 1
    fill = ~is_real[:n_real_slots] & (slots[:n_real_slots] > 0)
    if fill.any():
        i = int(np.argmax(fill))
        raise ValueError(
            f"slot {i} ({int(slots[i])} tokens from position {int(physical[i])}) has no real token but a later slot "
            "has: fill slots must be trailing (Bridge and NeMo append them to reach the batch width)"
        )
    keep = is_real[:n_real_slots]
    starts = physical[:n_real_slots][keep]
    lengths, padded = lengths[:n_real_slots][keep], slots[:n_real_slots][keep]
    if max_seqlen is not None and max_seqlen < int(padded.max()):
        i = int(np.argmax(padded > max_seqlen))
        raise ValueError(
            f"max_seqlen is {max_seqlen} but sample {i} spans {int(padded[i])} tokens: the batch's max_seqlen and "
            "boundaries disagree"
        )
    body = int(physical[n_real_slots])
    if body < T:  # fill slots and tokens after the last boundary: one trailing pad segment
        padded = np.append(padded, T - body)
        attn = np.append(lengths, T - body)
    else:
        attn = lengths
    segments = Segments.from_numpy(np.zeros(lengths.size, dtype=np.int64), starts, lengths)
    layout = PackLayout.from_lengths(segments.length, torch.from_numpy(padded), torch.from_numpy(attn))
    packed = assemble(
        tokens,
        labels,
        loss_mask,
        None,
        fields,
        segments,
        layout,
        pad_token_id=pad_token_id,
        ignore_index=ignore_index,
        labels_cross_samples=False,
        tokens_key=tokens_key,
    )
    if on_host:
        _check_padding_mask(packed, padding_mask)
        if position_ids is not None and position_ids.is_cpu:
            check_position_ids(position_ids, *segments.arrays[:2])
    return packed


def _pop_tokens(fields: dict) -> tuple[torch.Tensor, str]:
    tokens, key = pop_tokens(fields, "[1, T]")
    if tokens.dim() != 2 or tokens.shape[0] != 1 or tokens.shape[1] == 0:
        raise ValueError(
            f"batch key '{key}' is {list(tokens.shape)}: a packed batch is one row [1, T] with T >= 1 (Bridge and "
            "NeMo train packed batches with micro-batch size 1: split a global batch row by row)"
        )
    if tokens.shape[1] > INT32_MAX:
        raise ValueError(
            f"batch key '{key}' holds {tokens.shape[1]} tokens: cu_seqlens are int32, so a packed row holds at most "
            f"{INT32_MAX} tokens"
        )
    return tokens, key


def _pop_boundaries(fields: dict, T: int) -> tuple[np.ndarray, np.ndarray | None, int | None]:
    """``(physical, logical or None, max_seqlen or None)``, int64 numpy boundaries trimmed and aligned."""
    legacy = [k for k in LEGACY_PACKED_KEYS if k in fields]
    current = [k for k in CURRENT_PACKED_KEYS if k in fields]
    if legacy and current:
        raise ValueError(
            f"batch has '{legacy[0]}' (NeMo / legacy Bridge names) and '{current[0]}' (Bridge's current names): a "
            "packed batch uses one convention"
        )
    if "cu_seqlens_padded" in fields:
        raise ValueError(
            "batch key 'cu_seqlens_padded' is Megatron-core's naming (with 'cu_seqlens' logical), not a form "
            "from_packed_batch adopts: name them 'cu_seqlens_q' and 'cu_seqlens_q_padded' (Bridge's)"
        )
    values = {k: fields.pop(k) for k in (*legacy, *current)}
    for key, value in values.items():
        if isinstance(value, torch.Tensor) and value.device.type != "cpu":
            raise ValueError(
                f"batch key '{key}' is on {value.device}: from_packed_batch reads the boundary arrays on the host so "
                "that it needs no device sync; keep them on the host (token tensors may be on the GPU)"
            )
    if current:
        if "cu_seqlens_q" not in values:
            raise ValueError(
                f"batch has '{current[0]}' but no 'cu_seqlens_q': Bridge's packed batches carry it"
            )
        logical = _trim("cu_seqlens_q", values["cu_seqlens_q"], None, None, T)
        physical = None
        if "cu_seqlens_q_padded" in values:
            physical = _trim("cu_seqlens_q_padded", values["cu_seqlens_q_padded"], None, None, T)
        for kv, q in (("cu_seqlens_kv", "cu_seqlens_q"), ("cu_seqlens_kv_padded", "cu_seqlens_q_padded")):
            if kv in values and (q not in values or not _same(values[kv], values[q])):
                raise ValueError(
                    f"batch key '{kv}' differs from '{q}': from_packed_batch adopts self-attention batches (kv = q)"
                )
        max_seqlen = _max_seqlen(values, "max_seqlen_q", "max_seqlen_kv")
        if physical is None:
            return logical, None, max_seqlen  # one array: physical = logical
        return (*_align(physical, logical, "cu_seqlens_q_padded", "cu_seqlens_q"), max_seqlen)
    if "cu_seqlens" not in values:
        raise ValueError(
            "a packed batch needs its boundaries: 'cu_seqlens_q' (Megatron-Bridge) or 'cu_seqlens' (NeMo, legacy "
            "Bridge)" + (f"; it has '{legacy[0]}' only" if legacy else "")
        )
    physical = _trim(
        "cu_seqlens", values["cu_seqlens"], "cu_seqlens_argmin", values.get("cu_seqlens_argmin"), T
    )
    max_seqlen = _max_seqlen(values, "max_seqlen", None)
    if "cu_seqlens_unpadded" not in values:
        if "cu_seqlens_unpadded_argmin" in values:
            raise ValueError("batch has 'cu_seqlens_unpadded_argmin' but no 'cu_seqlens_unpadded'")
        return physical, None, max_seqlen
    logical = _trim(
        "cu_seqlens_unpadded",
        values["cu_seqlens_unpadded"],
        "cu_seqlens_unpadded_argmin",
        values.get("cu_seqlens_unpadded_argmin"),
        T,
    )
    return (*_align(physical, logical, "cu_seqlens", "cu_seqlens_unpadded"), max_seqlen)


def _host_array(key: str, value) -> np.ndarray:
    """A boundary-like key as a 1-D int64 numpy array: ``[K]``, or ``[K]`` under leading size-1 dimensions
    (``[1, K]``, ``[1, 1, K]``). Megatron-Bridge's ``get_packed_seq_params``
    (``src/megatron/bridge/training/utils/packed_seq_utils.py``, ``_squeeze_metadata``) squeezes them away, and its
    test ``test_packed_seq_params_batch_dimension_removal`` (``tests/unit_tests/training/test_gpt_step.py``) feeds
    ``[1, 1, K]``."""
    check_tensor(f"batch key '{key}'", value, INTEGER_DTYPES, "boundaries are integers (int32 in every form)")
    if value.dim() == 0 or any(size != 1 for size in value.shape[:-1]):
        raise ValueError(
            f"batch key '{key}' is {list(value.shape)}: one packed row's boundaries are [K], or [K] under leading "
            "dimensions of size 1 ([1, K], [1, 1, K]); split a global batch row by row"
        )
    return value.reshape(-1).numpy().astype(np.int64)


def _host_int(key: str, value) -> int:
    """An int, or a one-element integer host tensor (``[]``, ``[1]``, ``[1, 1]``), as an int."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, torch.Tensor):
        check_tensor(f"batch key '{key}'", value, INTEGER_DTYPES, "it is an integer")
        if value.numel() == 1:
            return int(value.reshape(-1)[0])
        raise ValueError(f"batch key '{key}' is {list(value.shape)}: one packed row has one {key}")
    raise TypeError(f"batch key '{key}' is a {type(value).__name__}: pass an int or a one-element tensor")


def _trim(key: str, value, argmin_key: str | None, argmin, T: int) -> np.ndarray:
    """The valid prefix of a boundary array: cut at the first negative entry (a sentinel: -1 in every form)."""
    cu = _host_array(key, value)
    negative = cu < 0
    end = int(np.argmax(negative)) if negative.any() else cu.size
    if not negative[end:].all():
        i = end + int(np.argmax(~negative[end:]))
        raise ValueError(
            f"batch key '{key}' has {int(cu[i])} at index {i}, after a sentinel at index {end}: sentinels (-1) only "
            "follow the last boundary"
        )
    if argmin is not None:
        at = _host_int(argmin_key, argmin)
        if at != end:
            raise ValueError(
                f"batch key '{argmin_key}' is {at} but '{key}' has its first sentinel at index {end}: the argmin is "
                f"the index of the first -1 ('{key}'[:{end}] are the boundaries)"
            )
    cu = cu[:end]
    if cu.size < 2 or cu[0] != 0:
        raise ValueError(
            f"batch key '{key}' = {cu.tolist()[:8]}{'...' if cu.size > 8 else ''} before its sentinels: boundaries "
            "start at 0 and hold at least one sample ([0, end, ...])"
        )
    down = cu[1:] < cu[:-1]
    if down.any():
        i = int(np.argmax(down)) + 1
        raise ValueError(
            f"batch key '{key}' decreases at index {i} ({int(cu[i - 1])} then {int(cu[i])}): boundaries never decrease"
        )
    if cu[-1] > T:
        raise ValueError(
            f"batch key '{key}' ends at {int(cu[-1])} but the row holds {T} tokens: boundaries end at most at T"
        )
    return cu


def _align(
    physical: np.ndarray, logical: np.ndarray, physical_key: str, logical_key: str
) -> tuple[np.ndarray, np.ndarray]:
    """One entry per slot in both arrays: extra trailing entries of the longer one must be zero-length slots
    (NeMo's ``pad_cu_seqlens`` repeats the width in the physical array only)."""
    n = min(physical.size, logical.size)
    for key, cu in ((physical_key, physical), (logical_key, logical)):
        if cu.size > n and (cu[n:] != cu[n - 1]).any():
            raise ValueError(
                f"batch key '{key}' has {cu.size - 1} slots and the other boundary array {n - 1}: the extra "
                "trailing boundaries must repeat the last one (zero-length slots)"
            )
    return physical[:n], logical[:n]


def _same(a, b) -> bool:
    return a is b or (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and a.shape == b.shape
        and bool(torch.equal(a, b))
    )


def _max_seqlen(values: dict, key: str, kv_key: str | None) -> int | None:
    if (
        kv_key is not None
        and kv_key in values
        and (key not in values or _host_int(kv_key, values[kv_key]) != _host_int(key, values[key]))
    ):
        raise ValueError(
            f"batch key '{kv_key}' differs from '{key}': from_packed_batch adopts q = kv batches"
        )
    return _host_int(key, values[key]) if key in values else None


def _pop_padding_mask(fields: dict, tokens: torch.Tensor, tokens_key: str) -> torch.Tensor | None:
    mask = fields.pop("padding_mask", None)
    if mask is None:
        return None
    check_tensor("batch key 'padding_mask'", mask, MASK_DTYPES, "it holds True (or 1) on pad")
    if mask.shape != tokens.shape:
        raise ValueError(
            f"batch key 'padding_mask' is {list(mask.shape)} but '{tokens_key}' is {list(tokens.shape)}: every [1, T] "
            f"key must match {tokens_key}"
        )
    if mask.dtype != torch.bool and mask.is_cpu:
        m = mask.numpy()
        if ((m != 0) & (m != 1)).any():
            raise ValueError(
                "batch key 'padding_mask' holds values other than 0 and 1: it is True (1) on pad"
            )
    return mask if mask.dtype == torch.bool else mask != 0


def _pop_metadata(fields: dict, T: int) -> int | None:
    """Check the metadata keys and drop them; return the one-row ``token_count`` (None if absent or not one)."""
    total = fields.pop("total_tokens", None)
    if total is not None and _host_int("total_tokens", total) != T:
        raise ValueError(
            f"batch key 'total_tokens' is {_host_int('total_tokens', total)} but the row holds {T} tokens"
        )
    mask = fields.pop("attention_mask", None)
    # NeMo's placeholder: LongTensor([1] * B), "no attention mask is needed for packed seq".
    if mask is not None and (
        not isinstance(mask, torch.Tensor)
        or mask.numel() != 1
        or (mask.is_cpu and int(mask.reshape(-1)[0]) != 1)
    ):
        shape = list(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(
            f"batch key 'attention_mask' is {shape}: a packed batch's samples are its boundaries; the mask must be "
            "None (Bridge) or NeMo's placeholder tensor([1])"
        )
    fields.pop("metadata", None)
    count = fields.pop("token_count", None)
    if count is None:
        return None
    if isinstance(count, torch.Tensor):
        if not count.is_cpu:
            raise ValueError(
                f"batch key 'token_count' is on {count.device}: keep it on the host, as the loader does"
            )
        count = count.reshape(-1).tolist()
    if isinstance(count, int) and not isinstance(count, bool):
        count = [count]
    if not isinstance(count, list | tuple) or not all(isinstance(c, int) for c in count):
        raise TypeError(f"batch key 'token_count' is a {type(count).__name__}: a list of ints (one per row)")
    return (
        int(count[0]) if len(count) == 1 else None
    )  # several: per sample (in-batch) or per row of a global batch


def _pop_token_key(fields: dict, name: str, dtypes: frozenset, what: str, tokens: torch.Tensor):
    t = fields.pop(name, None)
    if t is not None:
        check_tensor(f"batch key '{name}'", t, dtypes, what)
        _check_token_key(name, t, tokens, "tokens")
    return t


def _check_token_key(name: str, t: torch.Tensor, tokens: torch.Tensor, tokens_key: str) -> None:
    if t.shape != tokens.shape:
        raise ValueError(
            f"batch key '{name}' is {list(t.shape)} but '{tokens_key}' is {list(tokens.shape)}: every [1, T] key must "
            f"match {tokens_key}"
        )
    if t.device != tokens.device and name != "position_ids":
        raise ValueError(
            f"batch key '{name}' is on {t.device} but '{tokens_key}' on {tokens.device}: token-aligned tensors must be "
            "on one device"
        )


def _check_padding_mask(packed: PackedBatch, padding_mask: torch.Tensor | None) -> None:
    """On a host row: a given padding mask equals the boundaries' pad."""
    pad = packed.padding_mask.numpy().reshape(-1)
    if padding_mask is not None and padding_mask.is_cpu:
        given = padding_mask.numpy().reshape(-1)
        if not np.array_equal(given, pad):
            p = int(np.argmax(given != pad))
            what = "pad" if given[p] else "a real token"
            real = "a real token" if not pad[p] else "pad"
            raise ValueError(
                f"batch key 'padding_mask' marks position {p} as {what} but the boundaries make it {real} "
                f"({_slot_of(packed, p)}): padding_mask is True exactly on the tokens no sample holds"
            )


def _slot_of(packed: PackedBatch, p: int) -> str:
    cu_padded = packed.layout.arrays[1]
    i = int(np.searchsorted(cu_padded, p, side="right")) - 1
    if i >= len(packed.segments):
        return f"the trailing pad from position {int(cu_padded[i])}"
    _, start, length = packed.segments.arrays
    return f"sample {i} holds real tokens {int(start[i])}..{int(start[i] + length[i]) - 1}"
