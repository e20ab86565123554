"""The embedded SFT pairs' lengths (``dataset=embedded_sft``) with a tokenizer of your choice:

python benchmarks/embedded_sft_stats.py                          # byte tokenizer
python benchmarks/embedded_sft_stats.py --tokenizer MODEL_DIR    # a model directory's tokenizer and template
python benchmarks/embedded_sft_stats.py --show 2                 # and the first pairs' text
"""

from __future__ import annotations

import argparse
import sys

from thdpack.data.embedded_sft import EmbeddedSFTDataset
from thdpack.data.samples import format_length_stats
from thdpack.hf.tokenizer import resolve_tokenizer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Build (or load) the embedded SFT pairs and print their lengths."
    )
    parser.add_argument("--tokenizer", default="byte", help="'byte', a tokenizer.json or a model directory")
    parser.add_argument("--max-files", type=int, default=None)
    parser.add_argument("--rebuild", action="store_true", help="build even if cached")
    parser.add_argument("--show", type=int, default=0, help="print the first SHOW pairs' text")
    args = parser.parse_args(argv)
    tokenizer = resolve_tokenizer(args.tokenizer)
    data = EmbeddedSFTDataset(tokenizer, max_files=args.max_files, rebuild=args.rebuild)
    print(
        f"Python {sys.version.split()[0]}, {len(data.files)} files, {len(data.skipped_files)} skipped, {tokenizer.name}"
    )
    print(f"cache: {data.cache_path}")
    if data.build_seconds:
        print(f"built in {data.build_seconds:.2f} s")
    print(format_length_stats(data.length_stats()))
    print(f"targets: {int(sum(s.num_targets for s in (data[i] for i in range(len(data)))))} tokens")
    for i in range(args.show):
        sample = data[i]
        print(f"--- {sample.source}\n[prompt] {tokenizer.decode(sample.tokens[~sample.target_mask])}")
        print(f"[target] {tokenizer.decode(sample.tokens[sample.target_mask])}")


if __name__ == "__main__":
    main()
