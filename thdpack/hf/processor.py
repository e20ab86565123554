"""A vision-language checkpoint's own processor, as thdpack's data layer uses it: chat rows with images to
tokens, the assistant-only target mask, the image patches and grids, and the MRoPE ids of the model's rule.

The pieces are the checkpoint's: its tokenizer and chat template (``AutoTokenizer``), its image processor
(``AutoImageProcessor`` with the PIL backend, ``use_fast=False`` before transformers had backends: the same
pixels on every host, and no torchvision needed), loaded from the directory only (``local_files_only``, no
remote code). ``AutoProcessor`` itself is not used: transformers 5.24's Qwen2.5-VL processor builds a video
processor that needs torchvision. What it does with the pieces is what :meth:`VLProcessor.encode` does: render
the template, replace each image placeholder by ``t*h*w / merge**2`` image tokens (its
``replace_image_token``), tokenize.

Target mask (the loss is on the assistant turns only): the conversation is rendered prefix by prefix. For
assistant message ``k``, its span starts where ``messages[:k]`` rendered with the generation prompt ends and
stops where ``messages[:k+1]`` rendered ends, both checked to be prefixes of the whole rendering (else the row
is refused: the template is not prefix-stable for it). Trailing whitespace after the span's last token (Qwen:
the newline after ``<|im_end|>``) is not a target; the assistant's content and its end-of-turn token are. A
token is a target when its characters lie inside such a span (``return_offsets_mapping``); image tokens never
are.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .checkpoint import HFCheckpoint, HFConfigError
from .tokenizer import check_rendered, template_roles
from .vl_checkpoint import VLFacts, has_vision, rope_index, vl_facts

__all__ = ["EncodedChat", "VLProcessor", "dataset_processor", "load_image_processor", "processor_for"]


@dataclass
class EncodedChat:
    """One chat sample, processed.

    Attributes:
        tokens: int64 ``[L]``.
        target_mask: bool ``[L]``, True on the assistant tokens the loss predicts (never an image token).
        mm_token_type_ids: int8 ``[L]``, 1 on image tokens, 0 on text (transformers' processor output name).
        mrope_position_ids: int64 ``[3, L]`` (:func:`thdpack.hf.vl_checkpoint.rope_index`).
        pixel_values: float32 ``[P, C * temporal_patch * patch**2]``, the patches of every image in order.
        image_grid_thw: int64 ``[I, 3]``, each image's patch grid.
    """

    tokens: np.ndarray
    target_mask: np.ndarray
    mm_token_type_ids: np.ndarray
    mrope_position_ids: np.ndarray
    pixel_values: np.ndarray
    image_grid_thw: np.ndarray


def load_image_processor(directory: str | Path):
    """The directory's image processor on the PIL backend (transformers >= 5 with backends: ``backend="pil"``;
    before: ``use_fast=False``)."""
    import importlib.util

    # The module's class, not the top-level name: transformers 5.17 exports a stand-in there that asks for
    # torchvision (5.18 and later export the class itself).
    from transformers.models.auto.image_processing_auto import AutoImageProcessor

    if importlib.util.find_spec("transformers.image_processing_backends") is not None:
        return AutoImageProcessor.from_pretrained(str(directory), local_files_only=True, backend="pil")
    return AutoImageProcessor.from_pretrained(str(directory), local_files_only=True, use_fast=False)


class VLProcessor:
    """Chat samples with images to :class:`EncodedChat`, with the processor pieces of ``directory``.

    Also the tokenizer interface of :mod:`thdpack.data` (``encode``, ``decode``, ``vocab_size``, ``bos_id``,
    ``eos_id``, ``pad_id``, ``name``), so a vision-language dataset and the loader share one object.
    """

    def __init__(self, directory: str | Path):
        from transformers import AutoTokenizer

        self.directory = Path(directory)
        checkpoint = HFCheckpoint.open(self.directory)
        self.facts: VLFacts = vl_facts(checkpoint.config, str(checkpoint.path))
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.directory), local_files_only=True)
        self.image_processor = load_image_processor(self.directory)
        self.merge_size = int(getattr(self.image_processor, "merge_size", self.facts.spatial_merge_size))
        if self.merge_size != self.facts.spatial_merge_size:
            raise ValueError(
                f"{self.directory}: the image processor merges {self.merge_size} patches per side but the vision "
                f"tower {self.facts.spatial_merge_size}: the image-token counts would not match"
            )
        if not self.tokenizer.chat_template:
            raise ValueError(f"{self.directory}: the tokenizer has no chat template (chat_template.jinja)")
        self.chat_roles = template_roles(self.render, self.tokenizer.chat_template)
        self.image_token = self.tokenizer.convert_ids_to_tokens(self.facts.image_token_id)
        vocab = len(self.tokenizer)
        self.vocab_size = vocab
        self.name = f"hf:{self.directory.name}"
        eos = self.tokenizer.eos_token_id
        pad = self.tokenizer.pad_token_id
        self.eos_id = int(eos) if eos is not None else 0
        self.pad_id = int(pad) if pad is not None else self.eos_id
        bos = self.tokenizer.bos_token_id
        self.bos_id = int(bos) if bos is not None else self.pad_id

    def image_tokens_of_size(self, height: int, width: int) -> int | None:
        """The image tokens of an image of ``height`` x ``width`` pixels, by the image processor's resize rule
        (its ``get_number_of_image_patches``; None where it has none)."""
        patches = getattr(self.image_processor, "get_number_of_image_patches", None)
        if patches is None:
            return None
        return int(patches(height, width, {})) // self.merge_size**2

    # -- the tokenizer interface of thdpack.data -------------------------------------------------------
    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False), dtype=np.int64)

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(np.asarray(ids).tolist()))

    # -- chat samples --------------------------------------------------------------------------------
    def render(self, messages: Sequence[Mapping], add_generation_prompt: bool = False) -> str:
        """The chat template's text of ``messages`` (one image placeholder per image part)."""
        return self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def encode_chat(self, messages: Sequence[Mapping], images: Sequence, where: str = "?") -> EncodedChat:
        """Process one chat sample.

        Args:
            messages: ``[{"role": str, "content": str | [part, ...]}]``, parts ``{"type": "text", "text": str}``
                or ``{"type": "image", ...}`` (the image itself is given in ``images``).
            images: PIL images, one per image part, in order.
            where: the sample's source for errors (``file:line``).

        Raises:
            ValueError: naming ``where``: no assistant turn, a template that is not prefix-stable, a rendering
            whose image placeholders are not one per image, an image-token count that does not match the grids.
        """
        text = self.render(messages)
        check_rendered(messages, text, where, self.directory)
        spans = self._assistant_spans(messages, text, where)
        pieces = text.split(self.image_token)
        if len(pieces) - 1 != len(images):
            raise ValueError(
                f"{where}: the chat template rendered {len(pieces) - 1} image placeholder(s) "
                f"('{self.image_token}') for {len(images)} image(s): text may not contain the image token itself"
            )
        if images:
            processed = self.image_processor(images=list(images), return_tensors="np")
            pixel_values = np.asarray(processed["pixel_values"], dtype=np.float32)
            grids = np.asarray(processed["image_grid_thw"], dtype=np.int64).reshape(-1, 3)
        else:
            pixel_values = np.zeros((0, 0), np.float32)
            grids = np.zeros((0, 3), np.int64)
        counts = [self.facts.image_tokens(g) for g in grids]
        # The processor's expansion: placeholder i becomes counts[i] image tokens. Character offsets after it
        # shift by (counts[i] - 1) * len(image_token): map the spans through the shifts.
        expanded, shifts, shift = [pieces[0]], [], 0
        placeholder_ends = []
        offset = len(pieces[0])
        for count, piece in zip(counts, pieces[1:], strict=True):
            offset += len(self.image_token)
            placeholder_ends.append(offset)
            shift += (count - 1) * len(self.image_token)
            shifts.append(shift)
            expanded += [self.image_token * count, piece]
            offset += len(piece)

        def moved(x: int) -> int:
            k = bisect.bisect_right(placeholder_ends, x)
            return x + (shifts[k - 1] if k else 0)

        spans = [(moved(a), moved(b)) for a, b in spans]
        encoding = self.tokenizer("".join(expanded), add_special_tokens=False, return_offsets_mapping=True)
        tokens = np.asarray(encoding["input_ids"], dtype=np.int64)
        offsets = np.asarray(encoding["offset_mapping"], dtype=np.int64).reshape(-1, 2)
        is_image = tokens == self.facts.image_token_id
        if int(is_image.sum()) != sum(counts):
            raise ValueError(
                f"{where}: {int(is_image.sum())} image tokens after tokenization but the images' grids give "
                f"{sum(counts)}: the image-token count does not match the processor's"
            )
        target = np.zeros(len(tokens), dtype=bool)
        for a, b in spans:
            target |= (offsets[:, 0] >= a) & (offsets[:, 1] <= b) & (offsets[:, 1] > offsets[:, 0])
        target &= ~is_image
        if not target.any():
            raise ValueError(f"{where}: no assistant token: the loss is on the assistant turns only")
        return EncodedChat(
            tokens=tokens,
            target_mask=target,
            mm_token_type_ids=is_image.astype(np.int8),
            mrope_position_ids=rope_index(tokens, grids, self.facts, where),
            pixel_values=pixel_values,
            image_grid_thw=grids,
        )

    def _assistant_spans(self, messages, text: str, where: str) -> list[tuple[int, int]]:
        spans = []
        for k, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            before = self.render(messages[:k], add_generation_prompt=True)
            through = self.render(messages[: k + 1])
            if not (text.startswith(before) and text.startswith(through) and through.startswith(before)):
                raise ValueError(
                    f"{where}: the chat template does not render messages[:{k}] as a prefix of the whole "
                    "conversation: the assistant span cannot be found (a template that rewrites earlier turns)"
                )
            stop = len(before) + len(through[len(before) :].rstrip())
            spans.append((len(before), stop))
        if not spans:
            raise ValueError(f"{where}: no assistant message: the loss is on the assistant turns only")
        return spans


def processor_for(model) -> VLProcessor | None:
    """The processor of ``model.pretrained`` (the recipe's model group) when it is a vision-language checkpoint,
    else None: the image chat datasets take it as their tokenizer."""
    directory = model.get("pretrained") if hasattr(model, "get") else None
    if not directory:
        return None
    try:
        checkpoint = HFCheckpoint.open(directory)
    except (OSError, HFConfigError):
        return None  # the model import reports an unreadable directory, naming it
    if not has_vision(checkpoint.config):
        return None
    return VLProcessor(directory)


def dataset_processor(name: str, spec: str | None, model) -> VLProcessor | None:
    """The tokenizer of an image chat dataset (``dataset.name`` ``embedded_vlm`` or ``jsonl_vlm``): the processor of
    ``model.pretrained``, a vision-language checkpoint (``spec``, ``dataset.tokenizer``, left ``auto``); None for
    the other datasets (their tokenizer is :func:`thdpack.hf.tokenizer.resolve_tokenizer`'s).

    Raises ``ValueError`` naming the key: an image dataset without ``model.pretrained``, or with a
    ``dataset.tokenizer`` of its own, or whose ``model.pretrained`` is not a vision-language checkpoint.
    """
    from thdpack.data.loader import VISION_DATASETS

    if name not in VISION_DATASETS:
        return None
    directory = model.get("pretrained") if hasattr(model, "get") else None
    if spec not in (None, "auto") and str(spec) != str(directory):
        raise ValueError(
            f"dataset.tokenizer is '{spec}': dataset.name={name} is processed by model.pretrained's own processor "
            "(its tokenizer, chat template and image processor): leave dataset.tokenizer=auto"
        )
    if not directory:
        raise ValueError(
            f"dataset.name={name} needs a vision-language checkpoint: set model=hf model.pretrained=<a Qwen2.5-VL "
            "or Qwen3-VL directory> (its processor reads the images)"
        )
    processor = processor_for(model)
    if processor is None:
        raise ValueError(
            f"dataset.name={name} needs a vision-language checkpoint, but model.pretrained={directory} is not one "
            "(its config.json has no vision_config)"
        )
    return processor
