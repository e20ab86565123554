"""Image chat data: JSONL rows whose messages hold images, as samples with their image patches and MRoPE ids.

A line is ``{"messages": [...]}`` in transformers' chat format, content either a string or a list of parts::

    {"messages": [
        {"role": "user", "content": [{"type": "image", "path": "cat.png"}, {"type": "text", "text": "What is it?"}]},
        {"role": "assistant", "content": "A cat."}]}

An image part names a local file with ``"path"`` (or ``"image"``), relative to the JSONL file's folder or
absolute; nothing is downloaded (``"url"`` parts are refused). The row goes through the checkpoint's own processor
(:class:`thdpack.hf.processor.VLProcessor`, passed in: this layer does not import ``thdpack.hf``): chat template,
image processor, image-token expansion and the model's MRoPE rule. The loss is on the assistant turns only; image
tokens are never targets. A sample's length counts its image tokens, so token budgets do too.

Bad input raises ``ValueError("<file>:<line>: <what>: <rule>")``: malformed JSON, a row without ``messages``, a
part that is neither text nor image, a missing or unreadable image (the path is named), an image-token count that
does not match the processor's, no assistant turn. Every line is checked when the dataset is built (one pass, every
bad line named; see :class:`VisionJsonlDataset`). A sample whose image tokens would be cut by ``seq_length`` is
refused by :meth:`thdpack.data.samples.Sample.truncated`, never cropped.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .jsonl import JsonlDataset
from .jsonl_index import LineRules
from .jsonl_records import check_role, require_assistant
from .samples import Sample

__all__ = ["AUTO_TOKENIZE_LINES", "VisionJsonlDataset", "encoded_sample", "load_image", "shortest_cut"]

# validate="auto" reads every image and runs the processor at start-up for files of at most this many lines.
# Measured (python benchmarks/jsonl_vlm_validation.py, the tests' processor, on this repository's shared 2-core CPU
# machine at load average 5.5-8): 37-39 rows/s with pictures of 56 to 448 pixels a side, 15 rows/s up to 896
# (the parse pass: 5-7 K rows/s). 2,000 rows: under a minute to a bit over two, about what the text chat limit
# (thdpack.data.jsonl_index.AUTO_TOKENIZE_CHAT_LINES) costs; larger files are parsed, their images read when used.
AUTO_TOKENIZE_LINES = 2_000


def encoded_sample(encoded, where: str) -> Sample:
    """A :class:`Sample` of a processed chat (:class:`thdpack.hf.processor.EncodedChat`)."""
    return Sample(
        tokens=encoded.tokens,
        target_mask=encoded.target_mask,
        source=where,
        mrope_position_ids=encoded.mrope_position_ids,
        mm_token_type_ids=encoded.mm_token_type_ids,
        media={"pixel_values": encoded.pixel_values, "image_grid_thw": encoded.image_grid_thw},
    )


def shortest_cut(sample: Sample) -> int:
    """The shortest prefix of ``sample`` a truncation may keep: through its last image token (0 without)."""
    types = sample.mm_token_type_ids
    image = np.flatnonzero(types) if types is not None else np.zeros(0, np.int64)
    return int(image[-1]) + 1 if image.size else 0


def load_image(path: Path, where: str):
    """The RGB PIL image at ``path``, read now (a missing or unreadable file raises naming it and ``where``)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except FileNotFoundError:
        raise ValueError(f"{where}: image '{path}' does not exist") from None
    except (UnidentifiedImageError, OSError) as e:
        raise ValueError(f"{where}: image '{path}' cannot be read as an image ({e})") from None


def _text_of(content) -> str:
    if isinstance(content, str):
        return content
    parts = content if isinstance(content, list) else []
    return "".join(p.get("text", "") for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))


class VisionJsonlDataset(JsonlDataset):
    """A JSONL file of image chat rows (see module docstring) as a sequence of :class:`Sample`.

    Every line is checked when the dataset is built, as :class:`~thdpack.data.jsonl.JsonlDataset` checks its rows
    (one pass, every bad line named ``file:line``, the index cached; :mod:`thdpack.data.jsonl_index`): the parse
    pass checks each row's structure and that its image files exist; the tokenizing pass (``validate="tokenize"``,
    or ``"auto"`` for files of at most :data:`AUTO_TOKENIZE_LINES` lines) also reads every image and runs the
    processor, so unreadable images and image-token mismatches are found before training and every sample's
    length (image tokens included) is known up front. The cached index is keyed on the JSONL file, not on its
    images: an image changed or removed after a cached start is checked when its sample is read (the error names
    the file and line), and the start-up count of overlong samples may be off for it.

    Args:
        path: the file; relative image paths are resolved against its folder.
        processor: the checkpoint's :class:`~thdpack.hf.processor.VLProcessor`.
        validate, max_errors, cache_dir, bad_lines: as :class:`~thdpack.data.jsonl.JsonlDataset`'s.
    """

    def __init__(
        self,
        path: str | Path,
        processor,
        *,
        validate: str = "auto",
        max_errors: int = 20,
        cache_dir=None,
        bad_lines: str = "error",
    ):
        self.processor = processor
        super().__init__(
            path,
            processor,
            validate=validate,
            max_errors=max_errors,
            cache_dir=cache_dir,
            bad_lines=bad_lines,
        )

    def line_rules(self) -> LineRules:
        def measure(record, kind, where):
            sample = self.sample(record, where)
            return len(sample), shortest_cut(sample)

        return LineRules(
            name="image_chat",
            check=self.check,
            length=measure,
            auto_tokenize_lines=AUTO_TOKENIZE_LINES,
            keep=self.image_tokens,
            files=lambda record, where: [path for _, path in self.structure(record, where)[1]],
        )

    @property
    def min_lengths(self):
        """int64 ``[N]``: per sample, the shortest prefix a truncation may keep (its image tokens whole): exact
        after the tokenizing pass, a lower bound (the image tokens alone) after the parse pass."""
        return self.index.keep

    def image_tokens(self, record, where: str) -> int:
        """The image tokens of a row from its images' sizes (each file's header read, not its pixels): what the
        parse pass knows of a sample's length. An unreadable header raises naming the image."""
        from PIL import Image, UnidentifiedImageError

        total = 0
        for name, path in self.structure(record, where)[1]:
            try:
                with Image.open(path) as image:
                    width, height = image.size
            except (UnidentifiedImageError, OSError) as e:
                raise ValueError(
                    f"{where}: {name}: image '{path}' cannot be read as an image ({e})"
                ) from None
            total += self.processor.image_tokens_of_size(height, width) or 0
        return total

    def check(self, record, where: str) -> str:
        """The row's kind (``"messages"``) after checking its structure and that its image files exist (not read:
        the tokenizing pass and :meth:`sample` read them)."""
        _, paths = self.structure(record, where)
        for name, path in paths:
            if not path.is_file():
                raise ValueError(f"{where}: {name}: image '{path}' does not exist")
        return "messages"

    def sample(self, record, where: str) -> Sample:
        messages, images = self.parse(record, where)
        return encoded_sample(self.processor.encode_chat(messages, images, where), where)

    def parse(self, record, where: str):
        """``(messages, images)`` of one decoded line: the messages as the chat template takes them, and the PIL
        images of their image parts, in order."""
        messages, paths = self.structure(record, where)
        return messages, [load_image(path, f"{where}: {name}") for name, path in paths]

    def structure(self, record, where: str) -> tuple[list[dict], list[tuple[str, Path]]]:
        """``(messages, [(part name, image path)])`` of one decoded line, its images not opened; raises
        ``ValueError`` naming ``where`` and the rule."""
        if (
            not isinstance(record, dict)
            or not isinstance(record.get("messages"), list)
            or not record["messages"]
        ):
            raise ValueError(
                f"{where}: each line must be an object with a non-empty 'messages' list (image chat rows)"
            )
        messages, paths = [], []
        roles = getattr(self.processor, "chat_roles", None)
        for turn, message in enumerate(record["messages"]):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise ValueError(f"{where}: messages[{turn}] must be an object with a string 'role'")
            check_role(message["role"], turn, where, roles)
            content = message.get("content")
            if message["role"] == "assistant" and not _text_of(content).strip():
                raise ValueError(
                    f"{where}: messages[{turn}] is an assistant turn with no text: it would train on its "
                    "end-of-turn token alone"
                )
            if isinstance(content, str):
                messages.append({"role": message["role"], "content": content})
                continue
            if not isinstance(content, list):
                raise ValueError(
                    f"{where}: messages[{turn}].content must be a string or a list of parts "
                    '({"type": "text", "text": ...} or {"type": "image", "path": ...})'
                )
            parts = []
            for p, part in enumerate(content):
                name = f"messages[{turn}].content[{p}]"
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text" and isinstance(part.get("text"), str):
                    parts.append({"type": "text", "text": part["text"]})
                elif kind == "image":
                    paths.append((name, self._image_path(part, where, name)))
                    parts.append({"type": "image"})
                else:
                    raise ValueError(
                        f"{where}: {name} must be {{'type': 'text', 'text': str}} or {{'type': 'image', "
                        f"'path': str}}, got {part!r:.80}"
                    )
            messages.append({"role": message["role"], "content": parts})
        require_assistant([m["role"] for m in messages], where)
        return messages, paths

    def _image_path(self, part: dict, where: str, name: str) -> Path:
        value = part.get("path", part.get("image"))
        if not isinstance(value, str) or not value:
            hint = " (URLs are not fetched: download the image and give its path)" if "url" in part else ""
            raise ValueError(f"{where}: {name} is an image part without a 'path' string{hint}")
        if value.startswith(("http://", "https://")):
            raise ValueError(f"{where}: {name} names a URL ({value}): images are read from local files only")
        path = Path(value.removeprefix("file://"))
        return path if path.is_absolute() else self.path.parent / path
