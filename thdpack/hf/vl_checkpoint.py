"""What the Qwen vision-language checkpoints share: their ``config.json``'s text and vision parts, the MRoPE id rule
of still images, their safetensors read as a text model's and a vision tower's.

The families (:mod:`thdpack.models.qwen2_5_vl`, :mod:`thdpack.models.qwen3_vl`, :mod:`thdpack.models.qwen3_vl_moe`,
built by :mod:`thdpack.models.vl`) add what is their own: the vision tower class, the text family their language
model imports as, DeepStack, the MRoPE frequency layout. The processor (:mod:`thdpack.hf.processor`) reads the
facts of :func:`vl_facts` and the ids of :func:`rope_index`.

Checkpoint layout (both seen in the wild; transformers 5.x saves the first, 4.5x the second):

* ``model.embed_tokens``, ``model.layers.*``, ``model.norm``, ``lm_head``, ``visual.*``
* ``model.language_model.*``, ``lm_head``, ``model.visual.*``

``config.json`` holds the text model either nested (``text_config``) or flat at the top level, its MRoPE
sections under ``rope_scaling`` or ``rope_parameters`` (``mrope_section``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .checkpoint import HFConfigError, safetensors_files

__all__ = [
    "LanguageModelReader",
    "VLFacts",
    "has_vision",
    "language_model_name",
    "load_vision_state",
    "rope_index",
    "text_config",
    "text_import_config",
    "vision_tensor_names",
    "vl_facts",
]

VISION_PREFIXES = ("visual.", "model.visual.")


def has_vision(config: Mapping) -> bool:
    """Whether a ``config.json`` describes a model with a vision tower (a ``vision_config``)."""
    return isinstance(config.get("vision_config"), Mapping)


@dataclass(frozen=True)
class VLFacts:
    """What the data and the model call need to know of a vision-language checkpoint.

    Attributes:
        image_token_id: the placeholder each image expands to, one per merged patch block.
        video_token_id: videos are not supported; a sample holding this id is refused.
        vision_start_token_id, vision_end_token_id: the tokens around an image's placeholders.
        spatial_merge_size: patches merged per side into one image token (2: 2x2 patches per token).
        patch_size, temporal_patch_size: the vision tower's patch (pixels per side, frames).
        hidden_size: the language model's width (= the merger's output, ``out_hidden_size``).
        mrope_section: rotary frequencies per axis (temporal, height, width); sums to ``head_dim // 2``.
    """

    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    spatial_merge_size: int
    patch_size: int
    temporal_patch_size: int
    hidden_size: int
    mrope_section: tuple[int, int, int]

    def image_tokens(self, grid_thw) -> int:
        """Image tokens of one image of patch grid ``(t, h, w)``: one per ``merge x merge`` block."""
        t, h, w = (int(v) for v in grid_thw)
        return t * h * w // self.spatial_merge_size**2


def text_config(config: Mapping) -> dict:
    """The language model's config.json keys, whether nested under ``text_config`` (transformers 5.x) or flat
    at the top level (the released Qwen2.5-VL checkpoints); the rope settings under ``rope_parameters``, with
    ``rope_theta`` inside, either way."""
    nested = config.get("text_config")
    text = (
        dict(nested)
        if isinstance(nested, Mapping)
        else {k: v for k, v in config.items() if k != "vision_config"}
    )
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    if "rope_theta" in text:
        rope.setdefault("rope_theta", text["rope_theta"])
    text["rope_parameters"] = rope
    return text


def vl_facts(config: Mapping, where: str = "config.json") -> VLFacts:
    """:class:`VLFacts` of a vision-language ``config.json`` (``where``: its path); raises
    :class:`~thdpack.hf.checkpoint.HFConfigError` naming ``where`` for a config the model cannot run."""
    vision = config.get("vision_config")
    if not isinstance(vision, Mapping):
        raise HFConfigError(f"{where}: no 'vision_config': not a vision-language checkpoint")
    text = text_config(config)
    section = text["rope_parameters"].get("mrope_section")
    heads = int(text["num_attention_heads"])
    head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
    if section is None or len(section) != 3 or sum(section) != head_dim // 2:
        raise HFConfigError(
            f"{where}: rope 'mrope_section' is {section}: multimodal RoPE needs 3 sections (temporal, height, "
            f"width) summing to head_dim // 2 = {head_dim // 2}"
        )
    out = int(vision.get("out_hidden_size", text["hidden_size"]))
    if out != int(text["hidden_size"]):
        raise HFConfigError(
            f"{where}: vision_config.out_hidden_size {out} differs from the language model's hidden_size "
            f"{text['hidden_size']}: the merger's output cannot replace token embeddings"
        )

    def token(key: str, default: int) -> int:
        return int(config.get(key, text.get(key, default)))

    return VLFacts(
        image_token_id=token("image_token_id", 151655),
        video_token_id=token("video_token_id", 151656),
        vision_start_token_id=token("vision_start_token_id", 151652),
        vision_end_token_id=token("vision_end_token_id", 151653),
        spatial_merge_size=int(vision.get("spatial_merge_size", 2)),
        patch_size=int(vision.get("patch_size", 14)),
        temporal_patch_size=int(vision.get("temporal_patch_size", 2)),
        hidden_size=int(text["hidden_size"]),
        mrope_section=tuple(int(s) for s in section),
    )


def rope_index(
    tokens: np.ndarray, image_grid_thw: np.ndarray, facts: VLFacts, where: str = "?"
) -> np.ndarray:
    """MRoPE position ids ``[3, L]`` (temporal, height, width) of one sample with still images.

    The rule of transformers' ``get_rope_index`` of both ``Qwen2_5_VLModel`` (transformers/models/qwen2_5_vl/
    modeling_qwen2_5_vl.py) and ``Qwen3VLModel`` (models/qwen3_vl/modeling_qwen3_vl.py: ``get_vision_position_ids``
    with ``time_interval`` 1) for images; tests/unit/test_vlm_rope.py checks equality with both per sample. A text
    token advances all three ids together by 1; the ``t*h*w / merge**2`` tokens of an image (its patch grid
    merged ``merge x merge``) take ids ``start + (ti, hi, wi)`` over the merged grid in row-major order, where
    ``start`` is the next text position; the text after the image continues at ``start + max(h, w) / merge``
    (the image's largest id + 1 for a still image, whose ``t`` is 1). The two families differ on videos only
    (Qwen3-VL splits a video into frames separated by timestamps), and videos are refused.

    Args:
        tokens: int ``[L]``, one sample (no pad).
        image_grid_thw: int ``[I, 3]``, the patch grid of each of the sample's images, in order.
        facts: the checkpoint's :class:`VLFacts` (image token id, merge size).
        where: the sample's source for errors (``file:line``).

    Returns:
        int64 ``[3, L]``. Ids restart at 0: the packer keeps them per sample, so a packed row restarts them at
        every sample.

    Raises:
        ValueError: naming ``where``: a run of image tokens whose length is not its image's token count, more
        or fewer images than runs, a video token.
    """
    tokens = np.asarray(tokens)
    grids = np.asarray(image_grid_thw, dtype=np.int64).reshape(-1, 3)
    merge = facts.spatial_merge_size
    if np.any(tokens == facts.video_token_id):
        raise ValueError(
            f"{where}: the sample holds video tokens (video_token_id {facts.video_token_id}): videos are not "
            "supported, images only"
        )
    is_image = tokens == facts.image_token_id
    # Runs of image tokens: where the mask changes value, and the ends of the row.
    edges = np.flatnonzero(np.diff(np.concatenate([[False], is_image, [False]]).astype(np.int8)))
    runs = edges.reshape(-1, 2)  # [start, end) of each run
    if len(runs) != len(grids):
        raise ValueError(
            f"{where}: {len(runs)} run(s) of image tokens but {len(grids)} image(s): every image needs exactly "
            "one run of image tokens, as the processor expands it"
        )
    ids = np.empty((3, len(tokens)), dtype=np.int64)
    text_start, position = 0, 0
    for image, ((start, end), (t, h, w)) in enumerate(zip(runs.tolist(), grids.tolist(), strict=True)):
        count = facts.image_tokens((t, h, w))
        if end - start != count or h % merge or w % merge:
            raise ValueError(
                f"{where}: image {image} has {end - start} image tokens but its grid {[t, h, w]} gives "
                f"t*h*w / {merge}**2 = {count}: the image-token count does not match the processor's"
            )
        ids[:, text_start:start] = position + np.arange(start - text_start)
        position += start - text_start
        gh, gw = h // merge, w // merge
        ti, hi, wi = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        ids[:, start:end] = position + np.stack([ti.ravel(), hi.ravel(), wi.ravel()])
        position += max(gh, gw)
        text_start = end
    ids[:, text_start:] = position + np.arange(len(tokens) - text_start)
    return ids


def language_model_name(name: str) -> str | None:
    """The text-model (``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM``) name of a VL checkpoint's language-model
    tensor, None for the vision tower's: ``model.language_model.X`` -> ``model.X``; ``model.X`` and
    ``lm_head.weight`` as they are."""
    if name.startswith(VISION_PREFIXES):
        return None
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model.") :]
    return name


def vision_tensor_names(names) -> dict[str, str]:
    """``{vision-module name: checkpoint name}`` of the vision tower's tensors among ``names``."""
    out = {}
    for name in names:
        for prefix in VISION_PREFIXES:
            if name.startswith(prefix):
                out[name[len(prefix) :]] = name
    return out


def load_vision_state(module, directory: str | Path, device=None):
    """Load every tensor of ``module`` (a family's vision tower, built from ``vision_config``) from the directory's
    safetensors (memory-mapped; only the vision tensors are read). Returns ``module``.

    Raises ``ValueError`` naming the tensor when the checkpoint lacks one the module has, holds a vision tensor
    the module does not know, or a shape differs.
    """
    from safetensors import safe_open

    directory = Path(directory)
    files = safetensors_files(directory)
    located = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for local, name in vision_tensor_names(f.keys()).items():
                located[local] = (file, name)
    expected = module.state_dict()
    missing = sorted(set(expected) - set(located))
    unexpected = sorted(set(located) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"{directory}: the vision tower's tensors do not match transformers' {type(module).__name__}: "
            f"missing {[VISION_PREFIXES[0] + k for k in missing][:8]}, unexpected "
            f"{[located[k][1] for k in unexpected][:8]}"
        )
    state = {}
    by_file: dict[Path, list[str]] = {}
    for local, (file, _) in located.items():
        by_file.setdefault(file, []).append(local)
    for file, locals_ in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            for local in locals_:
                tensor = f.get_tensor(located[local][1])
                if tuple(tensor.shape) != tuple(expected[local].shape):
                    raise ValueError(
                        f"{file}: tensor '{located[local][1]}' has shape {list(tensor.shape)} but the vision "
                        f"module's '{local}' is {list(expected[local].shape)} (vision_config of config.json)"
                    )
                state[local] = tensor.to(expected[local].dtype)
    module.load_state_dict(state, strict=True)
    if device is not None:
        module.to(device)
    return module


# Keys of a VL config.json that belong to the vision side or name the VL wrapper (the language model is read by
# the text import, which refuses keys it does not know).
_VL_KEYS = frozenset(
    {
        "architectures",
        "model_type",
        "text_config",
        "vision_config",
        "image_token_id",
        "video_token_id",
        "vision_start_token_id",
        "vision_end_token_id",
        "vision_token_id",
        "rope_scaling",
        "rope_parameters",
        "rope_theta",
        "tie_word_embeddings",
    }  # fmt: skip
)


def text_import_config(config: Mapping, architecture: str, model_type: str) -> dict:
    """The language model of a VL ``config.json`` as the ``config.json`` of the text ``architecture`` (what the
    text import reads): the text keys, plain RoPE with the checkpoint's theta (the MRoPE sections are the VL
    family's), ``tie_word_embeddings`` from the top level."""
    text = text_config(config)
    rope = dict(text.pop("rope_parameters"))
    out = {k: v for k, v in text.items() if k not in _VL_KEYS}
    out.update(
        architectures=[architecture],
        model_type=model_type,
        rope_parameters={"rope_type": "default", "rope_theta": float(rope.get("rope_theta", 1000000.0))},
        tie_word_embeddings=bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
    )
    return out


class LanguageModelReader:
    """A VL checkpoint's tensors as the text import reads them: the language model's only, under text-model
    names (:func:`language_model_name`); the vision tower's are hidden (loaded by :func:`load_vision_state`).
    ``reader``: :class:`thdpack.hf.checkpoint.SafetensorsReader` of the directory."""

    def __init__(self, reader):
        self.reader = reader
        self.directory = reader.directory
        self._names = {}
        for name in reader.names():
            text_name = language_model_name(name)
            if text_name is not None:
                self._names[text_name] = name

    def names(self) -> set[str]:
        return set(self._names)

    def shape(self, name: str):
        return self.reader.shape(self._names[name])

    def read(self, name: str, rows=slice(None), cols=slice(None)):
        return self.reader.read(self._names[name], rows, cols)

    def where(self, name: str) -> str:
        return f"{self.reader.where(self._names[name])} ('{self._names[name]}')"
