"""``embedded_vlm``: image chat samples drawn at run time with PIL, each image with its description. No download.

Every sample is a deterministic function of ``(seed, index)`` (``np.random.default_rng([seed, index])``):

* an image sample (most): one picture of 1 to 3 shapes (circle, square, triangle, in eight colours) on a
  plain background, each shape in one cell of a 3x3 grid; the user asks for a description, the colour of a
  shape, or how many shapes there are, and the assistant answers from what was drawn ("A red circle at the
  top left and a blue square in the center, on a white background.");
* a two-image sample: two such pictures; the assistant describes both ("The first image shows ...; the second
  shows ...");
* a text-only sample: a question about the shapes' names answered in words.

Picture sides are multiples of 28 (a patch of 14 merged 2x2) between ``min_side`` and ``max_side``, so one
sample holds from a few to a few hundred image tokens: the lengths vary as real vision-language data does.
The answer is a function of the pixels, so a model that learns lowers its loss (a real learning signal).

Samples are processed by the checkpoint's own processor (:class:`thdpack.hf.processor.VLProcessor`, passed in):
its chat template, image processor and MRoPE rule.
"""

from __future__ import annotations

import numpy as np

from .vlm import encoded_sample

__all__ = ["COLOURS", "SHAPES", "EmbeddedVLDataset", "draw_picture", "phrases"]

COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 210, 40),
    "purple": (140, 60, 180),
    "orange": (245, 140, 30),
    "black": (20, 20, 20),
    "white": (250, 250, 250),
}
BACKGROUNDS = ("white", "black", "yellow", "blue")
SHAPES = ("circle", "square", "triangle")
CELLS = (
    "at the top left",
    "at the top",
    "at the top right",
    "on the left",
    "in the center",
    "on the right",
    "at the bottom left",
    "at the bottom",
    "at the bottom right",
)
NUMBERS = ("no", "one", "two", "three")
SIDES = {"circle": "no corners", "square": "four sides", "triangle": "three sides"}
KINDS = ("describe", "colour", "count", "two_images", "text")
KIND_WEIGHTS = (0.4, 0.15, 0.15, 0.15, 0.15)


def draw_picture(rng: np.random.Generator, min_side: int, max_side: int):
    """``(PIL image, description, shapes)``: a picture drawn from ``rng`` and what it shows.

    ``shapes`` is a list of ``(colour, shape, cell)``; the description names them in drawing order.
    """
    from PIL import Image, ImageDraw

    sides = np.arange(min_side, max_side + 1, 28)
    width, height = int(rng.choice(sides)), int(rng.choice(sides))
    background = str(rng.choice(BACKGROUNDS))
    image = Image.new("RGB", (width, height), COLOURS[background])
    draw = ImageDraw.Draw(image)
    count = int(rng.integers(1, 4))
    cells = rng.choice(len(CELLS), size=count, replace=False)
    shapes = []
    for cell in sorted(cells.tolist()):
        colour = str(rng.choice([c for c in COLOURS if c != background]))
        shape = str(rng.choice(SHAPES))
        row, col = divmod(cell, 3)
        x0, y0 = col * width / 3, row * height / 3
        x1, y1 = x0 + width / 3, y0 + height / 3
        margin = min(width, height) / 24
        box = (x0 + margin, y0 + margin, x1 - margin, y1 - margin)
        if shape == "circle":
            draw.ellipse(box, fill=COLOURS[colour])
        elif shape == "square":
            draw.rectangle(box, fill=COLOURS[colour])
        else:
            draw.polygon(
                [(box[0], box[3]), (box[2], box[3]), ((box[0] + box[2]) / 2, box[1])], fill=COLOURS[colour]
            )
        shapes.append((colour, shape, CELLS[cell]))
    parts = [f"a {colour} {shape} {cell}" for colour, shape, cell in shapes]
    listed = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    description = f"{listed[0].upper()}{listed[1:]}, on a {background} background."
    return image, description, shapes


def phrases() -> list[str]:
    """Every phrase the samples are built from (a tokenizer trained on them covers the data)."""
    words = [f"a {c} {s} {cell}" for c in COLOURS for s in SHAPES for cell in CELLS]
    words += [f"on a {b} background." for b in BACKGROUNDS]
    words += [question for question, _ in _TEXT_QA] + [answer for _, answer in _TEXT_QA]
    words += list(_PROMPTS.values()) + [f"There are {n} shapes." for n in NUMBERS]
    words += ["The first image shows", "the second shows", "What colour is the", "It is"]
    return words


_PROMPTS = {
    "describe": "Describe the image.",
    "count": "How many shapes are in the image?",
    "two_images": "Describe the two images.",
}
_TEXT_QA = [(f"Which shape has {SIDES[s]}?", f"The {s} has {SIDES[s]}.") for s in SHAPES] + [
    (f"How many sides does a {s} have?", f"A {s} has {SIDES[s]}.") for s in SHAPES
]


class EmbeddedVLDataset:
    """The drawn image chat samples as a sequence of samples with images (see module docstring).

    Args:
        processor: the checkpoint's :class:`~thdpack.hf.processor.VLProcessor` (or an object with its
            ``encode_chat``).
        num_samples: how many samples.
        seed: the samples are a function of ``(seed, index)``.
        min_side, max_side: picture sides in pixels, multiples of 28.
    """

    def __init__(
        self, processor, num_samples: int = 2000, seed: int = 0, min_side: int = 56, max_side: int = 224
    ):
        if min_side % 28 or max_side % 28 or not 28 <= min_side <= max_side:
            raise ValueError(
                f"embedded_vlm: min_side {min_side} and max_side {max_side} must be multiples of 28 with "
                "28 <= min_side <= max_side (a patch of 14 merged 2x2)"
            )
        if num_samples < 1:
            raise ValueError(f"embedded_vlm: num_samples is {num_samples}: it must be >= 1")
        self.processor = processor
        self.num_samples, self.seed = int(num_samples), int(seed)
        self.min_side, self.max_side = int(min_side), int(max_side)

    def __len__(self) -> int:
        return self.num_samples

    def conversation(self, index: int):
        """``(messages, images)`` of sample ``index``: the chat in transformers' format and its PIL images."""
        rng = np.random.default_rng([self.seed, index])
        kind = str(rng.choice(KINDS, p=KIND_WEIGHTS))
        if kind == "text":
            question, answer = _TEXT_QA[int(rng.integers(len(_TEXT_QA)))]
            return _chat([{"type": "text", "text": question}], answer), []
        image, description, shapes = draw_picture(rng, self.min_side, self.max_side)
        if kind == "two_images":
            second, description2, _ = draw_picture(rng, self.min_side, self.max_side)
            answer = (
                f"The first image shows {_lower(description)[:-1]}; the second shows {_lower(description2)}"
            )
            parts = [{"type": "image"}, {"type": "image"}, {"type": "text", "text": _PROMPTS[kind]}]
            return _chat(parts, answer), [image, second]
        if kind == "colour":
            colour, shape, cell = shapes[int(rng.integers(len(shapes)))]
            question, answer = f"What colour is the {shape} {cell}?", f"It is {colour}."
        elif kind == "count":
            question, answer = _PROMPTS[kind], f"There are {NUMBERS[len(shapes)]} shapes."
            if len(shapes) == 1:
                answer = "There is one shape."
        else:
            question, answer = _PROMPTS[kind], description
        return _chat([{"type": "image"}, {"type": "text", "text": question}], answer), [image]

    def __getitem__(self, index: int):
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample {index} of embedded_vlm ({len(self)} samples)")
        index %= len(self)
        messages, images = self.conversation(index)
        where = f"embedded_vlm:{index}"
        return encoded_sample(self.processor.encode_chat(messages, images, where), where)


def _chat(user_parts, answer: str):
    return [
        {"role": "user", "content": user_parts},
        {"role": "assistant", "content": [{"type": "text", "text": answer}]},
    ]


def _lower(text: str) -> str:
    return text[0].lower() + text[1:]
