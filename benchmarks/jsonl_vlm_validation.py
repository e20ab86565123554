"""How long the start-up pass over an image chat JSONL file takes (thdpack.data.vlm.VisionJsonlDataset): the parse
pass (structure, image files exist) and the tokenizing pass (every image read and processed, the chat template
rendered), on generated rows with PNG pictures.

    python benchmarks/jsonl_vlm_validation.py --lines 500                        # tests' processor, up to 448 px
    python benchmarks/jsonl_vlm_validation.py --lines 500 --directory DIR        # a Qwen2.5-VL directory's

The rows: embedded_vlm's pictures (``thdpack.data.embedded_vlm.draw_picture``, sides ``--min-side`` to
``--max-side``, saved as PNG), one picture per row, two in every fourth, none in every tenth; the question and the
picture's description as the answer. Without ``--directory`` the processor is the tests' (tests/vlm_models.py:
patch 14, merge 2, up to ``--max-side`` pixels a side; config.json, tokenizer and image processor only, no weights).
Generated into a temporary directory and removed afterwards.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def processor_directory(directory: Path, max_side: int) -> Path:
    """The tests' Qwen2.5-VL processor files (no weights) in ``directory``."""
    from tests.vlm_models import IMAGE_PROCESSOR, build_tokenizer, tiny_config

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(tiny_config(build_tokenizer(directory))))
    size = {"shortest_edge": 56 * 56, "longest_edge": max_side * max_side}
    processor = {**IMAGE_PROCESSOR, "size": size, "max_pixels": max_side * max_side}
    (directory / "preprocessor_config.json").write_text(json.dumps(processor))
    return directory


def generate(folder: Path, lines: int, min_side: int, max_side: int, seed: int = 0) -> Path:
    from thdpack.data.embedded_vlm import draw_picture

    rng = np.random.default_rng(seed)
    path = folder / "rows.jsonl"
    with open(path, "w") as f:
        for i in range(lines):
            count = 0 if i % 10 == 9 else 2 if i % 4 == 3 else 1
            parts, answers = [], []
            for k in range(count):
                image, description, _ = draw_picture(rng, min_side, max_side)
                name = f"{i}_{k}.png"
                image.save(folder / name)
                parts.append({"type": "image", "path": name})
                answers.append(description)
            question = "Describe the picture." if count else "Which shape has three sides?"
            parts.append({"type": "text", "text": question})
            answer = " ".join(answers) or "The triangle has three sides."
            row = {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": answer}]}
            f.write(json.dumps(row) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lines", type=int, default=500)
    parser.add_argument("--directory", type=Path, default=None, help="a Qwen2.5-VL directory")
    parser.add_argument("--min-side", type=int, default=56)
    parser.add_argument("--max-side", type=int, default=448)
    parser.add_argument("--modes", default="parse,tokenize", help="comma-separated: parse, tokenize")
    args = parser.parse_args()

    from thdpack.data.vlm import VisionJsonlDataset
    from thdpack.hf.processor import VLProcessor

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        directory = args.directory or processor_directory(tmp / "processor", args.max_side)
        processor = VLProcessor(directory)
        start = time.perf_counter()
        path = generate(tmp, args.lines, args.min_side, args.max_side)
        print(f"generated {args.lines:,} rows and their pictures in {time.perf_counter() - start:.1f} s")
        for mode in args.modes.split(","):
            data = VisionJsonlDataset(path, processor, validate=mode, cache_dir=False)
            seconds = data.index.seconds
            print(
                f"{processor.name} {mode:>8}: {len(data):,} rows: {seconds:.2f} s ({len(data) / seconds:,.0f} rows/s)"
                + (f", mean length {data.lengths.mean():.0f} tokens" if data.index.tokenized else "")
            )


if __name__ == "__main__":
    main()
