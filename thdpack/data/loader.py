"""``TrainData``: deterministic, data-parallel sharded, resumable micro-batches for the training loop.

The stream: sample indices in epoch-wise permutations (``np.random.default_rng([seed, epoch])``; identity
order with ``shuffle=False``), epoch after epoch without a break. Step ``g`` takes the next
``global_batch_size`` samples of the stream (after the ``overlong`` rule) and cuts them into micro-batches:

* fixed (``micro_batch_tokens`` None): ``micro_batch_size`` samples each, ``num_microbatches =
  global_batch_size // (micro_batch_size * dp_size)`` on every step. As in Megatron's pretraining sampler,
  micro-batch ``m`` of rank ``r`` is the ``(m * dp_size + r)``-th run of ``micro_batch_size`` samples.
* token budget (``micro_batch_tokens`` set, for packed training): micro-batches of at most
  ``micro_batch_tokens`` tokens, balanced over ranks by cost (:mod:`thdpack.data.budget`). The count varies
  from step to step but is the same on every rank, so pass ``len(next_step())`` as ``num_microbatches`` to
  Megatron's ``forward_backward_func`` each step (it takes the count per call). Use ``pad_to="longest"``
  here: a budget micro-batch may hold many short rows, and padding each to ``seq_length`` only to have the
  packer drop the pad again costs host memory and time.

Every rank reads the step's whole global batch (on the host; cheap next to a step) so the overlong rule, the
budget plan and the counters agree on every rank without communication; it collates only its own share.

``overlong`` (samples longer than ``seq_length``, or than ``micro_batch_tokens`` when smaller):
``truncate`` (default) keeps the first tokens (a sample left without any target is dropped instead),
``drop`` skips the sample (the stream refills the batch), ``error`` raises naming the sample's source.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from .budget import DEFAULT_COST_WEIGHTS, plan_microbatches
from .collate import PAD_TO, collate
from .samples import Sample, SampleDataset, known_lengths, known_min_lengths

__all__ = [
    "OVERLONG",
    "TrainData",
    "build_dataset",
    "build_train_data",
    "micro_batch_tokens",
    "startup_report",
]

OVERLONG = ("truncate", "drop", "error")
DATASETS = ("embedded", "embedded_sft", "jsonl", "megatron_indexed", "synthetic", "embedded_vlm", "jsonl_vlm")
VISION_DATASETS = ("embedded_vlm", "jsonl_vlm")  # need a vision-language checkpoint's processor as tokenizer
_STATE_KEYS = ("consumed", "epoch", "steps", "samples_seen", "truncated", "dropped", "fillers", "real_tokens")


class TrainData:
    """This data-parallel rank's micro-batches, one global step at a time.

    Args:
        dataset: a :class:`~thdpack.data.samples.SampleDataset`.
        seq_length: longest sample a micro-batch row holds (``S`` with ``pad_to="seq_length"``).
        global_batch_size: samples per step, all ranks together.
        micro_batch_size: samples per micro-batch (fixed mode; unused with ``micro_batch_tokens``).
        micro_batch_tokens: token budget per micro-batch; None = fixed micro-batches.
        dp_rank, dp_size: this rank's data-parallel coordinates.
        seed: the order's seed (the same on every rank).
        shuffle: False = dataset order, epoch after epoch.
        overlong: ``"truncate"``, ``"drop"`` or ``"error"``; see the module docstring.
        pad_to, pad_id, mrope: passed to :func:`~thdpack.data.collate`.
        cost_weights: ``(a, b)`` of the budget's cost ``a * L + b * L**2``.

    Counters (global over all ranks, the same on every rank, kept in :meth:`state_dict`): ``consumed``
    (stream position: samples read, dropped ones included), ``steps``, ``samples_seen`` (samples delivered),
    ``truncated``, ``dropped``, ``fillers`` (empty budget micro-batches), ``real_tokens`` (tokens delivered).
    Per step: ``num_microbatches_last``, ``rank_tokens_last`` (this rank's real tokens), ``step_lengths``
    (``[rank][micro-batch]`` -> int64 array of the sample lengths, every rank's: what the step computes on).
    """

    def __init__(
        self,
        dataset: SampleDataset,
        *,
        seq_length: int,
        global_batch_size: int,
        micro_batch_size: int | None = None,
        micro_batch_tokens: int | None = None,
        dp_rank: int,
        dp_size: int,
        seed: int,
        shuffle: bool = True,
        overlong: str = "truncate",
        pad_to: str = "seq_length",
        pad_id: int,
        mrope: bool = False,
        cost_weights: Sequence[float] = DEFAULT_COST_WEIGHTS,
    ):
        if len(dataset) == 0:
            raise ValueError("the dataset is empty: nothing to train on")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, dp_size={dp_size})")
        if overlong not in OVERLONG:
            raise ValueError(f"overlong is '{overlong}': it must be one of {list(OVERLONG)}")
        if pad_to not in PAD_TO:
            raise ValueError(f"pad_to is '{pad_to}': it must be one of {list(PAD_TO)}")
        if seq_length < 1 or global_batch_size < 1:
            raise ValueError(
                f"seq_length ({seq_length}) and global_batch_size ({global_batch_size}) must be >= 1"
            )
        if micro_batch_tokens is None:
            if micro_batch_size is None or micro_batch_size < 1:
                raise ValueError(f"micro_batch_size is {micro_batch_size}: fixed micro-batches need it >= 1")
            if global_batch_size % (micro_batch_size * dp_size):
                raise ValueError(
                    f"global_batch_size ({global_batch_size}) is not divisible by micro_batch_size "
                    f"({micro_batch_size}) x dp_size ({dp_size}): every rank needs a whole number of micro-batches"
                )
        else:
            if micro_batch_tokens < 1:
                raise ValueError(f"micro_batch_tokens is {micro_batch_tokens}: it must be >= 1 (or null)")
            if global_batch_size < dp_size:
                raise ValueError(
                    f"global_batch_size ({global_batch_size}) < dp_size ({dp_size}): every data-parallel rank "
                    "needs at least one sample per step"
                )
        self.dataset = dataset
        self.seq_length, self.global_batch_size = seq_length, global_batch_size
        self.micro_batch_size, self.micro_batch_tokens = micro_batch_size, micro_batch_tokens
        self.dp_rank, self.dp_size, self.seed, self.shuffle = dp_rank, dp_size, seed, shuffle
        self.overlong, self.pad_to, self.pad_id, self.mrope = overlong, pad_to, pad_id, mrope
        self.cost_weights = tuple(cost_weights)
        self.max_length = seq_length if micro_batch_tokens is None else min(seq_length, micro_batch_tokens)
        self._limit_name = "seq_length" if self.max_length == seq_length else "micro_batch_tokens"
        self.consumed = self.steps = self.samples_seen = 0
        self.truncated = self.dropped = self.fillers = self.real_tokens = 0
        self.num_microbatches_last = self.rank_tokens_last = 0
        self.step_lengths: list[list[np.ndarray]] = []
        self._perm: tuple[int, np.ndarray | None] = (-1, None)

    @property
    def epoch(self) -> int:
        """Epoch of the next sample of the stream."""
        return self.consumed // len(self.dataset)

    def next_step(self) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches of the next global step, collated (see :func:`~thdpack.data.collate`)."""
        samples, consumed, truncated, dropped = self._read(self.global_batch_size)
        lengths = np.array([len(s) for s in samples], dtype=np.int64)
        if self.micro_batch_tokens is None:
            mbs, dp = self.micro_batch_size, self.dp_size
            count = self.global_batch_size // (mbs * dp)
            plan = [
                [list(range((m * dp + r) * mbs, (m * dp + r + 1) * mbs)) for m in range(count)]
                for r in range(dp)
            ]
        else:
            plan = plan_microbatches(lengths, self.dp_size, self.micro_batch_tokens, self.cost_weights)
        mine = plan[self.dp_rank]
        fillers = sum(not mb for rank in plan for mb in rank)
        # A filler micro-batch holds one pad token that is no target: every rank runs the same number of
        # passes, and the filler adds nothing to the loss or its token count.
        filler = Sample(np.array([self.pad_id], np.int64), np.zeros(1, bool), "<filler>")
        batches = [
            collate(
                [samples[i] for i in mb] or [filler], self.seq_length, self.pad_id, self.pad_to, self.mrope
            )
            for mb in mine
        ]
        # Commit only after the whole step succeeded: a step that raised leaves the state where it was.
        self.consumed = consumed
        self.steps += 1
        self.samples_seen += len(samples)
        self.truncated += truncated
        self.dropped += dropped
        self.fillers += fillers
        self.real_tokens += int(lengths.sum())
        self.num_microbatches_last = len(batches)
        self.rank_tokens_last = int(sum(lengths[i] for mb in mine for i in mb))
        self.step_lengths = [[lengths[mb] for mb in rank] for rank in plan]
        return batches

    def _read(self, count: int) -> tuple[list[Sample], int, int, int]:
        """The next ``count`` samples that pass the overlong rule, and the new stream position and counts."""
        position, truncated, dropped, dropped_in_a_row = self.consumed, 0, 0, 0
        samples: list[Sample] = []
        while len(samples) < count:
            sample = self.dataset[self._index(position)]
            position += 1
            if len(sample) > self.max_length:
                if self.overlong == "error":
                    raise ValueError(
                        f"{sample.source}: sample of {len(sample)} tokens is longer than {self._limit_name} "
                        f"({self.max_length}): overlong='error' (use 'truncate' or 'drop' to go on)"
                    )
                if self.overlong == "truncate":
                    sample = sample.truncated(self.max_length)
                if self.overlong == "drop" or sample.num_targets == 0:
                    dropped += 1
                    dropped_in_a_row += 1
                    if dropped_in_a_row >= len(self.dataset):
                        raise ValueError(
                            f"{dropped_in_a_row} samples in a row dropped by overlong='{self.overlong}' "
                            f"({self._limit_name} = {self.max_length}): no sample of the dataset fits"
                        )
                    continue
                truncated += 1
            dropped_in_a_row = 0
            samples.append(sample)
        return samples, position, truncated, dropped

    def _index(self, position: int) -> int:
        epoch, offset = divmod(position, len(self.dataset))
        if not self.shuffle:
            return offset
        if self._perm[0] != epoch:
            self._perm = (epoch, np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset)))
        return int(self._perm[1][offset])

    def check_overlong(self) -> str:
        """A line for the start-up log: how many samples are longer than the limit and what ``overlong`` does
        with them, from the lengths the dataset knows up front (e.g. a tokenizing JSONL pass); without them, the
        rule and where the counts appear. With ``overlong="error"`` and overlong samples known, raises naming the
        first few (before step 1 rather than when reached)."""
        limit = f"{self._limit_name} ({self.max_length})"
        rule = {
            "truncate": f"truncated to their first {self.max_length} tokens (one left without a target is dropped)",
            "drop": "dropped (the stream refills the batch)",
            "error": "refused (an error)",
        }[self.overlong]
        uncut = self._check_images_fit(limit)
        lengths = known_lengths(self.dataset)
        if lengths is None:
            return uncut + (
                f"sample lengths are not known before training: samples longer than {limit} will be {rule} "
                f"(dataset.overlong={self.overlong}); the step log counts them"
            )
        over = np.flatnonzero(lengths > self.max_length)
        if not over.size:
            return (
                f"all {len(lengths)} samples fit {limit}: dataset.overlong={self.overlong} has nothing to do"
            )
        if self.overlong == "error":
            sources = ", ".join(f"{self.dataset[int(i)].source} ({lengths[i]} tokens)" for i in over[:5])
            raise ValueError(
                f"{over.size} of {len(lengths)} samples are longer than {limit}: dataset.overlong=error refuses "
                f"them (use truncate or drop, or raise dataset.seq_length); the first: {sources}"
            )
        return (
            f"{over.size} of {len(lengths)} samples ({over.size / len(lengths):.1%}) are longer than {limit}: "
            f"dataset.overlong={self.overlong}, they are {rule}"
        )

    def largest_micro_batch_tokens(self, packed: bool) -> int | None:
        """The most tokens one micro-batch can hold with this dataset (its lengths known up front; else None). A
        micro-batch the step packs (``packed``) holds at most its token budget and at most the longest samples (cut
        to the limit) of one global batch, or of ``micro_batch_size`` samples; a padded one is ``micro_batch_size``
        rows of ``seq_length`` (``pad_to="longest"``: of the longest sample)."""
        lengths = known_lengths(self.dataset)
        if lengths is None or not len(lengths):
            return None
        longest = np.sort(np.minimum(lengths, self.max_length))[::-1]
        if self.micro_batch_tokens is not None:
            return int(min(self.micro_batch_tokens, longest[: self.global_batch_size].sum()))
        if packed:
            return int(longest[: self.micro_batch_size].sum())
        width = int(longest[0]) if self.pad_to == "longest" else self.seq_length
        return self.micro_batch_size * width

    def _check_images_fit(self, limit: str) -> str:
        """Raise for samples whose image tokens run past the limit (known up front, :func:`known_min_lengths`):
        ``truncate`` would crop an image and ``error`` refuses them; with ``drop``, the words that count them."""
        keep = known_min_lengths(self.dataset)
        if keep is None:
            return ""
        over = np.flatnonzero(keep > self.max_length)
        if not over.size:
            return ""
        if self.overlong == "drop":
            return f"{over.size} samples hold more image tokens than {limit} and will be dropped; "
        sources = ", ".join(f"{self.dataset[int(i)].source} (images to token {keep[i]})" for i in over[:5])
        rule = {
            "truncate": "dataset.overlong=truncate would crop an image, which is never done",
            "error": "dataset.overlong=error refuses them",
        }[self.overlong]
        raise ValueError(
            f"{over.size} of {len(keep)} samples hold image tokens past {limit}: {rule}. Use dataset.overlong=drop, "
            f"raise dataset.seq_length to at least {int(keep[over].max())}, or shrink the images (max_pixels in "
            f"the model's preprocessor_config.json); the first: {sources}"
        )

    def state_dict(self) -> dict[str, int]:
        """Python ints, the same on every rank: enough to continue the exact stream after a restart."""
        state = {key: int(getattr(self, key)) for key in _STATE_KEYS}
        return {**state, "seed": int(self.seed), "dataset_size": len(self.dataset)}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        for key, mine in (("seed", self.seed), ("dataset_size", len(self.dataset))):
            if state.get(key) != mine:
                raise ValueError(
                    f"data state has {key}={state.get(key)} but this run has {key}={mine}: resuming would not "
                    "continue the same sample order"
                )
        for key in _STATE_KEYS:
            if key not in state:
                raise ValueError(f"data state lacks '{key}' (keys: {sorted(state)})")
            if key != "epoch":  # derived from consumed
                setattr(self, key, int(state[key]))


def build_dataset(
    name: str,
    path: str | None,
    tokenizer,
    *,
    max_files: int | None = None,
    synthetic: Mapping | None = None,
    validate: str = "auto",
    vlm: Mapping | None = None,
    bad_lines: str = "error",
) -> SampleDataset:
    """The dataset ``name`` (``embedded``, ``embedded_sft``, ``jsonl``, ``megatron_indexed``, ``synthetic``, or the
    image chat datasets ``embedded_vlm`` and ``jsonl_vlm``); ``path`` is the JSONL file or the indexed prefix
    (unused by the embedded ones; ``max_files`` is their subset option); ``synthetic``: the keyword arguments of
    :class:`~thdpack.data.synthetic.SyntheticDataset` but the vocabulary; ``validate``: the JSONL start-up pass
    (:mod:`thdpack.data.jsonl_index`; ``jsonl`` and ``jsonl_vlm``, and ``bad_lines``: ``error`` or ``skip``); ``vlm``: the keyword arguments of
    :class:`~thdpack.data.embedded_vlm.EmbeddedVLDataset` but the processor. The image chat datasets take the
    checkpoint's processor (:class:`thdpack.hf.processor.VLProcessor`) as ``tokenizer``."""
    if name == "embedded":
        from .embedded import EmbeddedDataset

        return EmbeddedDataset(tokenizer, max_files=max_files)
    if name == "embedded_sft":
        from .embedded_sft import EmbeddedSFTDataset

        return EmbeddedSFTDataset(tokenizer, max_files=max_files)
    if name in VISION_DATASETS:
        return _vision_dataset(name, path, tokenizer, vlm or {}, validate, bad_lines)
    if name == "synthetic":
        from .synthetic import SyntheticDataset

        if not synthetic:
            raise ValueError(
                "dataset.name=synthetic needs dataset.synthetic (num_samples, median or mean, sigma, ...)"
            )
        return SyntheticDataset(**synthetic, vocab_size=tokenizer.vocab_size, bos_id=tokenizer.bos_id)
    if name not in DATASETS:
        raise ValueError(f"dataset.name is '{name}': it must be one of {list(DATASETS)}")
    if not path:
        raise ValueError(f"dataset.path is required for dataset.name={name}")
    if name == "jsonl":
        from .jsonl import JsonlDataset

        return JsonlDataset(path, tokenizer, validate=validate, bad_lines=bad_lines)
    from .indexed import MegatronIndexedDataset

    return MegatronIndexedDataset(path, tokenizer.vocab_size)


def _vision_dataset(
    name: str, path: str | None, processor, options: Mapping, validate: str, bad_lines: str
) -> SampleDataset:
    if not hasattr(processor, "encode_chat"):
        raise ValueError(
            f"dataset.name={name} needs a vision-language checkpoint's processor: set model.pretrained to a "
            f"Qwen2.5-VL directory (its processor replaces the {getattr(processor, 'name', 'given')} tokenizer)"
        )
    if name == "embedded_vlm":
        from .embedded_vlm import EmbeddedVLDataset

        return EmbeddedVLDataset(processor, **dict(options))
    if not path:
        raise ValueError("dataset.path is required for dataset.name=jsonl_vlm")
    from .vlm import VisionJsonlDataset

    return VisionJsonlDataset(path, processor, validate=validate, bad_lines=bad_lines)


_MISSING = object()


def micro_batch_tokens(dataset_cfg: Mapping) -> int | None:
    """The token budget of a micro-batch from a recipe's ``dataset`` mapping: ``micro_batch_tokens``, where
    ``auto`` (the default) means the tokens the padded micro-batch would hold (``micro_batch_size x
    seq_length``) when packing and fixed micro-batches of ``micro_batch_size`` samples when not; None =
    ``micro_batch_size`` samples."""
    budget = dataset_cfg.get("micro_batch_tokens", "auto")
    if not dataset_cfg.get("pack_sequences_in_batch", True):
        if budget not in (None, "auto"):
            raise ValueError(
                f"dataset.micro_batch_tokens={budget} needs dataset.pack_sequences_in_batch=true: the padded "
                "baseline batches micro_batch_size samples (set micro_batch_tokens=null)"
            )
        return None
    if budget == "auto":
        return int(dataset_cfg["micro_batch_size"]) * int(dataset_cfg["seq_length"])
    return None if budget is None else int(budget)


def build_train_data(
    dataset_cfg: Mapping, *, dp_rank: int, dp_size: int, seed: int, tokenizer=None, dataset=None, **overrides
) -> TrainData:
    """:class:`TrainData` from a recipe's ``dataset`` mapping (a dict or an OmegaConf ``DictConfig``).

    Keys: ``name`` (required), ``path`` (required for ``jsonl`` and ``megatron_indexed``), ``seq_length``,
    ``global_batch_size`` (required), ``micro_batch_size`` (required unless ``micro_batch_tokens`` is set),
    ``micro_batch_tokens`` (``auto``, see :func:`micro_batch_tokens`), ``tokenizer`` (``"byte"``), ``shuffle`` (true), ``overlong``
    (``"truncate"``), ``pad_to`` (``"seq_length"``), ``mrope`` (false), ``cost_weights`` (``[a, b]``),
    ``max_files`` (``embedded`` only), ``validate`` (``"auto"``, ``jsonl`` only). Other keys (``pack_sequences_in_batch``, ``mode``, ...) belong to the
    training loop and are ignored here (``pack_sequences_in_batch`` decides what ``micro_batch_tokens: auto``
    means).

    ``tokenizer``: an already built tokenizer; None builds ``dataset_cfg.tokenizer``. The result carries it as
    ``.tokenizer`` (``vocab_size`` for the model). ``dataset``: an already built dataset (e.g. a split of it);
    None builds ``dataset_cfg.name``. ``overrides``: keys that replace the mapping's (e.g. ``shuffle=False``).
    """
    dataset_cfg = {**dataset_cfg, **overrides}

    def get(key, default=_MISSING):
        value = dataset_cfg.get(key, default)
        if value is _MISSING:
            raise ValueError(f"dataset config lacks the required key '{key}' (has: {sorted(dataset_cfg)})")
        return value

    if tokenizer is None:
        from .tokenizer import build_tokenizer

        tokenizer = build_tokenizer(get("tokenizer", "byte"))
    budget = micro_batch_tokens(dataset_cfg)
    if dataset is None:
        dataset = build_dataset(
            get("name"),
            get("path", None),
            tokenizer,
            max_files=get("max_files", None),
            synthetic=get("synthetic", None),
            validate=get("validate", "auto"),
            vlm=get("vlm", None),
            bad_lines=get("bad_lines", "error"),
        )
    data = TrainData(
        dataset,
        seq_length=int(get("seq_length")),
        global_batch_size=int(get("global_batch_size")),
        micro_batch_size=get("micro_batch_size") if budget is None else get("micro_batch_size", None),
        micro_batch_tokens=budget,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=seed,
        shuffle=bool(get("shuffle", True)),
        overlong=get("overlong", "truncate"),
        pad_to=get("pad_to", "seq_length"),
        pad_id=tokenizer.pad_id,
        mrope=bool(get("mrope", False)),
        cost_weights=tuple(get("cost_weights", DEFAULT_COST_WEIGHTS)),
    )
    data.tokenizer = tokenizer
    return data


def startup_report(data: TrainData) -> list[str]:
    """Lines for the start-up log: what the dataset's own start-up check found (``summary``, e.g. the JSONL
    pass), and :meth:`TrainData.check_overlong` (which raises for ``overlong="error"`` with overlong samples)."""
    dataset = data.dataset
    while not hasattr(dataset, "summary") and hasattr(dataset, "dataset"):  # through Subset
        dataset = dataset.dataset
    summary = getattr(dataset, "summary", None)
    return ([summary] if summary else []) + [data.check_overlong()]
