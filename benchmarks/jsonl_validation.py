"""How long the start-up pass over a JSONL file takes (thdpack.data.jsonl_index): parse-only, tokenized, and the
cached second start, on a generated file of chat-like rows.

    python benchmarks/jsonl_validation.py --lines 1000000                        # byte tokenizer
    python benchmarks/jsonl_validation.py --lines 20000 --tokenizer DIR          # a Hugging Face model directory
    python benchmarks/jsonl_validation.py --lines 20000 --tokenizer DIR --modes tokenize

The file: 70% ``messages`` rows (a system message in one of five, one or two user/assistant exchanges), 15%
``prompt``/``response``, 10% ``text``, 5% ``input_ids``; texts of lognormal length (median 300 characters) cut
from the Python standard library's sources (real, varied text; no download). Generated with a fixed seed into a
temporary directory (or ``--file``), and removed afterwards.
"""

from __future__ import annotations

import argparse
import json
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np


def source_text() -> str:
    root = Path(sysconfig.get_paths()["stdlib"])
    return "".join(p.read_text(encoding="utf-8", errors="replace") for p in sorted(root.glob("*.py"))[:40])


def generate(path: Path, lines: int, vocab_size: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    text = source_text()
    cut = np.minimum(rng.lognormal(np.log(300), 0.8, size=4 * lines).astype(np.int64) + 1, 8000)
    where = rng.integers(0, len(text) - 8000, size=4 * lines)
    pieces = iter(text[w : w + c] for w, c in zip(where.tolist(), cut.tolist(), strict=True))
    kinds = rng.random(lines)
    with open(path, "w") as f:
        for i in range(lines):
            k = kinds[i]
            if k < 0.70:
                messages = (
                    [{"role": "system", "content": "You are a careful assistant."}] if i % 5 == 0 else []
                )
                for _ in range(1 + (i % 3 == 0)):
                    messages += [
                        {"role": "user", "content": next(pieces)},
                        {"role": "assistant", "content": next(pieces)},
                    ]
                row = {"messages": messages}
            elif k < 0.85:
                row = {"prompt": next(pieces), "response": next(pieces)}
            elif k < 0.95:
                row = {"text": next(pieces)}
            else:
                row = {"input_ids": rng.integers(0, vocab_size, size=int(cut[i % len(cut)])).tolist()}
            f.write(json.dumps(row) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--tokenizer", default="byte", help="byte, or a Hugging Face model directory")
    parser.add_argument("--modes", default="parse,tokenize", help="comma-separated: parse, tokenize")
    parser.add_argument("--file", type=Path, default=None, help="use (or create) this file")
    args = parser.parse_args()

    from thdpack.data.jsonl_index import index_jsonl
    from thdpack.hf.tokenizer import resolve_tokenizer

    tokenizer = resolve_tokenizer(args.tokenizer)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.file or Path(tmp) / "rows.jsonl"
        if not path.exists():
            start = time.perf_counter()
            generate(path, args.lines, tokenizer.vocab_size)
            print(
                f"generated {args.lines:,} lines ({path.stat().st_size / 2**20:.0f} MiB) in "
                f"{time.perf_counter() - start:.1f} s"
            )
        size = path.stat().st_size / 2**20
        for mode in args.modes.split(","):
            cache = Path(tmp) / f"cache-{mode}"
            first = index_jsonl(path, tokenizer, validate=mode, cache_dir=cache)
            again = index_jsonl(path, tokenizer, validate=mode, cache_dir=cache)
            n = len(first.starts)
            print(
                f"{tokenizer.name} {mode:>8}: {n:,} lines, {size:.0f} MiB: first pass {first.seconds:.2f} s "
                f"({n / first.seconds:,.0f} lines/s), cached start {again.seconds * 1000:.0f} ms"
                + (f", mean length {first.lengths.mean():.0f} tokens" if first.tokenized else "")
            )


if __name__ == "__main__":
    main()
