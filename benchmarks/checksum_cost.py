"""What a checkpoint's manifest costs (thdpack.megatron.checkpoint_manifest: every file's CRC-32, summed by the rank
that wrote it right after the save, checked again at a resume), against SHA-256, and what that makes for an 8B model:

    python benchmarks/checksum_cost.py                        # 1 GiB in the page cache, this machine's cores
    python benchmarks/checksum_cost.py --checkpoint ckpt/iter_0000002   # also: the manifest of a real checkpoint

Prints each checksum's throughput on one thread and on ``--threads`` files at once (as ``checksums`` sums a rank's
files), the time ``checksums`` takes on ``--checkpoint``, and the estimate for ``recipes/model/llama3_8b.yaml``
(bf16 weights, fp32 main copy and Adam moments: ``thdpack.training.checkpointing.checkpoint_bytes``) written by one
rank, or shared by 8 and 16 writing ranks.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from omegaconf import OmegaConf

from thdpack.megatron.checkpoint_manifest import checksums, crc32, my_files
from thdpack.training.checkpointing import checkpoint_bytes
from thdpack.training.recipe_keys import recipes_dir


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def rate(function, paths: list[Path], threads: int) -> float:
    """GiB/s of ``function`` over ``paths`` (each read once before: from the page cache, as right after a save)."""
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(function, paths))
    return sum(p.stat().st_size for p in paths) / 2**30 / (time.perf_counter() - start)


def group_option(group: str, name: str):
    """A recipe group's option with the options its ``defaults`` list before it merged in (as Hydra does)."""
    option = OmegaConf.load(recipes_dir() / group / f"{name}.yaml")
    parents = [d for d in option.pop("defaults", []) if d != "_self_"]
    return OmegaConf.merge(*(group_option(group, parent) for parent in parents), option)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gib", type=float, default=1.0, help="bytes to sum, split over --threads files")
    parser.add_argument("--threads", type=int, default=min(8, os.cpu_count() or 1))
    parser.add_argument("--checkpoint", type=Path, help="an iter_XXXXXXX directory to time the manifest of")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        paths = [Path(tmp) / f"part{i}" for i in range(args.threads)]
        for path in paths:
            path.write_bytes(os.urandom(int(args.gib * 2**30 / args.threads)))
        for path in paths:
            crc32(path)  # in the page cache
        results = {
            (name, threads): rate(function, paths if threads > 1 else paths[:1], threads)
            for name, function in (("crc32", crc32), ("sha256", sha256))
            for threads in (1, args.threads)
        }
    for (name, threads), gibs in results.items():
        print(f"{name:7s} {threads:2d} thread(s): {gibs:6.2f} GiB/s")
    if args.checkpoint:
        files = my_files(args.checkpoint, 0)
        size = sum((args.checkpoint / f).stat().st_size for f in files)
        start = time.perf_counter()
        checksums(args.checkpoint, files)
        print(f"manifest of {args.checkpoint}: {size / 2**20:.1f} MiB in {time.perf_counter() - start:.3f} s")
    model = group_option("model", "llama3_8b")
    size = checkpoint_bytes(model, 128256, "bf16")
    print(f"llama3_8b checkpoint: about {size / 2**30:.0f} GiB")
    for name in ("crc32", "sha256"):
        one, many = results[name, 1], results[name, args.threads]
        line = ", ".join(f"{ranks} writing ranks {size / ranks / 2**30 / many:.0f} s" for ranks in (8, 16))
        print(f"  {name}: one thread {size / 2**30 / one:.0f} s; {args.threads} threads a rank: {line}")


if __name__ == "__main__":
    main()
