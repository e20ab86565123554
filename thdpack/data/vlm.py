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
does not match the processor's, no assistant turn. A sample whose image tokens would be cut by ``seq_length`` is
refused by :meth:`thdpack.data.samples.Sample.truncated`, never cropped.
"""

from __future__ import annotations

import json
from pathlib import Path

from .jsonl import JsonlDataset
from .samples import Sample

__all__ = ["VisionJsonlDataset", "encoded_sample", "load_image"]


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


class VisionJsonlDataset(JsonlDataset):
    """A JSONL file of image chat rows (see module docstring) as a sequence of :class:`Sample`.

    Args:
        path: the file; relative image paths are resolved against its folder.
        processor: the checkpoint's :class:`~thdpack.hf.processor.VLProcessor`.
    """

    def __init__(self, path: str | Path, processor):
        super().__init__(path, processor)
        self.processor = processor

    def __getitem__(self, index: int) -> Sample:
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample {index} of {self.path} ({len(self)} samples)")
        index %= len(self)
        where = f"{self.path}:{self._line[index]}"
        if self._file is None:
            self._file = open(self.path, "rb")  # noqa: SIM115 - kept open across reads, closed with the object
        self._file.seek(int(self._start[index]))
        raw = self._file.read(int(self._end[index] - self._start[index]))
        try:
            record = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{where}: malformed JSON ({e}): each line must be one JSON object") from None
        messages, images = self.parse(record, where)
        return encoded_sample(self.processor.encode_chat(messages, images, where), where)

    def parse(self, record, where: str):
        """``(messages, images)`` of one decoded line: the messages as the chat template takes them, and the PIL
        images of their image parts, in order."""
        if (
            not isinstance(record, dict)
            or not isinstance(record.get("messages"), list)
            or not record["messages"]
        ):
            raise ValueError(
                f"{where}: each line must be an object with a non-empty 'messages' list (image chat rows)"
            )
        messages, images = [], []
        for turn, message in enumerate(record["messages"]):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise ValueError(f"{where}: messages[{turn}] must be an object with a string 'role'")
            content = message.get("content")
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
                    images.append(load_image(self._image_path(part, where, name), f"{where}: {name}"))
                    parts.append({"type": "image"})
                else:
                    raise ValueError(
                        f"{where}: {name} must be {{'type': 'text', 'text': str}} or {{'type': 'image', "
                        f"'path': str}}, got {part!r:.80}"
                    )
            messages.append({"role": message["role"], "content": parts})
        return messages, images

    def _image_path(self, part: dict, where: str, name: str) -> Path:
        value = part.get("path", part.get("image"))
        if not isinstance(value, str) or not value:
            hint = " (URLs are not fetched: download the image and give its path)" if "url" in part else ""
            raise ValueError(f"{where}: {name} is an image part without a 'path' string{hint}")
        if value.startswith(("http://", "https://")):
            raise ValueError(f"{where}: {name} names a URL ({value}): images are read from local files only")
        path = Path(value.removeprefix("file://"))
        return path if path.is_absolute() else self.path.parent / path
