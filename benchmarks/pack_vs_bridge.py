"""thdpack's packer against Megatron-Bridge's, ms per batch: ``python benchmarks/pack_vs_bridge.py [options]``.

Turns a right-padded BSHD batch into one THD row with thdpack's ``pack_bshd`` and with Megatron-Bridge's
in-batch packer (``pack_right_padded_sequence_batch_to_mcore_thd`` in ``megatron/bridge/data/packing/in_batch.py``),
the packer users would otherwise use. Both get the same padded batch and the same per-sample CP alignment, and
the benchmark checks once per case that they produce the same THD row, so the times compare like for like.

Bridge is not a dependency and this script downloads nothing. Give it Bridge's code one of three ways:

- ``--bridge PATH``: a Megatron-Bridge source tree (``git clone https://github.com/NVIDIA-NeMo/Megatron-Bridge``),
  a wheel, or an unzipped wheel. To get the wheel the numbers in ``benchmarks/results`` used:
  ``pip download --no-deps --only-binary=:all: --python-version 3.12 megatron-bridge==0.6.2 -d DIR``
  (then pass ``DIR/megatron_bridge-0.6.2-*.whl``, or ``unzip`` it and pass the directory). Only the packer's
  module is read, and executed in memory with its one non-torch import (the constant ``IGNORE_INDEX``)
  replaced by its value;
- an installed ``megatron.bridge`` (``pip install megatron-bridge``), imported when no ``--bridge`` is given;
- neither: the Bridge column is skipped with a one-line reason (``--no-peer`` skips it outright).

    python benchmarks/pack_vs_bridge.py --bridge DIR/megatron_bridge-0.6.2-py3-none-any.whl   # CPU
    python benchmarks/pack_vs_bridge.py --device cuda --sync-check                            # GPU batch
    python benchmarks/pack_vs_bridge.py --cases 8x8192,64x8192-cp2 --repeats 50 --json results.json
"""

from __future__ import annotations

import argparse
import ast
import datetime
import importlib
import json
import math
import os
import platform
import re
import statistics
import sys
import time
import types
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

IGNORE_INDEX = -100

BRIDGE_MODULE = "megatron/bridge/data/packing/in_batch.py"
BRIDGE_FUNCTION = "pack_right_padded_sequence_batch_to_mcore_thd"
# The module's only non-torch import; replaced by the constant it brings in.
BRIDGE_STUBBED_IMPORT = "from megatron.bridge.data.datasets.utils import IGNORE_INDEX"
BRIDGE_ALLOWED_IMPORTS = {"__future__", "collections.abc", "typing", "torch"}


# ----------------------------------------------------------------------------------------------------------
# Workloads


@dataclass(frozen=True)
class Case:
    batch_size: int
    seq_len: int
    cp_size: int = 1

    @property
    def name(self) -> str:
        return f"{self.batch_size}x{self.seq_len}" + (f"-cp{self.cp_size}" if self.cp_size > 1 else "")


DEFAULT_CASES = "8x8192,64x8192,64x8192-cp2,256x2048"
_CASE_RE = re.compile(r"^(\d+)x(\d+)(?:-cp(\d+))?$")


def parse_cases(text: str) -> list[Case]:
    """``"8x8192,64x8192-cp2"`` -> ``[Case(8, 8192, 1), Case(64, 8192, 2)]``."""
    cases = []
    for item in text.split(","):
        m = _CASE_RE.match(item.strip())
        if not m:
            raise argparse.ArgumentTypeError(f"case {item!r}: expected BxS or BxS-cpN, e.g. 64x8192-cp2")
        cases.append(Case(int(m[1]), int(m[2]), int(m[3] or 1)))
    return cases


def sample_lengths(batch_size: int, seq_len: int, *, seed: int, sigma: float = 1.0) -> torch.Tensor:
    """Lognormal lengths with median ``seq_len/8`` and a long tail, clipped to ``[1, seq_len]``: int64 ``[B]``."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(batch_size, generator=g, dtype=torch.float64)
    lengths = torch.exp(math.log(seq_len / 8) + sigma * z)
    return lengths.round().clamp(1, seq_len).long()


def make_batch(lengths: torch.Tensor, seq_len: int, *, seed: int, vocab_size: int = 32000) -> dict:
    """A right-padded BSHD batch on the host, as a data loader hands it over.

    Returns ``tokens`` int64 ``[B,S]`` (0 on pad), ``labels`` int64 ``[B,S]`` (next token within the row,
    -100 on the last real token and on pad), ``loss_mask`` float32 ``[B,S]`` (1 where labels count),
    ``attention_mask`` int64 ``[B,S]`` (1 = real, HF's convention) and ``position_ids`` int64 ``[B,S]``
    (``arange(S)`` per row; Bridge requires them).
    """
    g = torch.Generator().manual_seed(seed + 1)
    batch_size = lengths.numel()
    cols = torch.arange(seq_len)
    real = cols.unsqueeze(0) < lengths.unsqueeze(1)
    tokens = torch.randint(1, vocab_size, (batch_size, seq_len), generator=g) * real
    labels = torch.full_like(tokens, IGNORE_INDEX)
    has_next = cols[:-1].unsqueeze(0) < (lengths - 1).unsqueeze(1)
    labels[:, :-1] = torch.where(has_next, tokens[:, 1:], IGNORE_INDEX)
    return {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": (labels != IGNORE_INDEX).float(),
        "attention_mask": real.long(),
        "position_ids": cols.expand(batch_size, seq_len).contiguous(),
    }


# ----------------------------------------------------------------------------------------------------------
# The peer: Megatron-Bridge's in-batch packer, from a path the user gives or an installed megatron.bridge


def load_bridge_packer(path: Path | None = None) -> tuple[Callable, str]:
    """``(Bridge's pack_right_padded_sequence_batch_to_mcore_thd, where it came from)``.

    ``path``: a Megatron-Bridge source tree, a wheel, or an unzipped wheel; None: the installed
    ``megatron.bridge``. Raises ``RuntimeError`` with a one-line reason when the module is not there or no
    longer has the shape this benchmark expects (other imports than torch and the stubbed constant).
    """
    if path is None:
        try:
            module = importlib.import_module(BRIDGE_MODULE.removesuffix(".py").replace("/", "."))
        except ImportError as e:
            raise RuntimeError(
                f"no installed megatron.bridge ({e}); pass --bridge PATH (see this script's docstring)"
            ) from None
        return getattr(module, BRIDGE_FUNCTION), f"installed {module.__file__}"
    source, origin = _read_bridge_module(Path(path))
    if source.count(BRIDGE_STUBBED_IMPORT) != 1:
        raise RuntimeError(f"{origin} no longer has the import {BRIDGE_STUBBED_IMPORT!r}")
    source = source.replace(BRIDGE_STUBBED_IMPORT, f"IGNORE_INDEX = {IGNORE_INDEX}")
    for node in ast.walk(ast.parse(source)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        names += [node.module] if isinstance(node, ast.ImportFrom) else []
        if any(n not in BRIDGE_ALLOWED_IMPORTS for n in names):
            raise RuntimeError(f"{origin} imports {names}: only torch and the stdlib are expected")
    module = types.ModuleType("megatron_bridge_in_batch")
    exec(compile(source, origin, "exec"), module.__dict__)
    return getattr(module, BRIDGE_FUNCTION), origin


def _read_bridge_module(path: Path) -> tuple[str, str]:
    """The packer module's source and where it was read: from a wheel (a zip), or under a directory (a source
    tree keeps the package under ``src/``, an unzipped wheel at its top)."""
    if path.is_file() and zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as zf:
            try:
                return zf.read(BRIDGE_MODULE).decode(), f"{path}/{BRIDGE_MODULE}"
            except KeyError:
                raise RuntimeError(f"{path} has no {BRIDGE_MODULE}: is it a megatron-bridge wheel?") from None
    for candidate in (path / BRIDGE_MODULE, path / "src" / BRIDGE_MODULE):
        if candidate.is_file():
            return candidate.read_text(), str(candidate)
    raise RuntimeError(
        f"{path} holds neither {BRIDGE_MODULE} nor src/{BRIDGE_MODULE}: pass a Megatron-Bridge source tree, a "
        "wheel or an unzipped wheel"
    )


def bridge_pad_multiple(cp_size: int, tp_size: int = 1, sequence_parallel: bool = False) -> int:
    """Bridge's per-sample multiple (``training/config.py``): ``lcm(2cp if cp>1, cp*tp if SP and tp>1)``."""
    cp_multiple = 2 * cp_size if cp_size > 1 else 1
    sp_multiple = cp_size * tp_size if sequence_parallel and tp_size > 1 else 1
    return math.lcm(cp_multiple, sp_multiple)


def bridge_pack(packer: Callable, batch: dict, cp_size: int) -> dict:
    """Run Bridge's packer on a shallow copy of ``batch`` (it rewrites the dict in place) and return the copy."""
    out = dict(batch)
    packer(out, pad_token_id=0, ignore_index=IGNORE_INDEX, pad_to_multiple_of=bridge_pad_multiple(cp_size))
    return out


def compare_with_bridge(packed, bridged: dict) -> list[str]:
    """Names of the THD fields on which thdpack and Bridge disagree (empty = the same THD row)."""

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.shape == b.shape and torch.equal(a.detach().cpu().double(), b.detach().cpu().double())

    cu = bridged["cu_seqlens_q"]
    pairs = {
        "tokens": (packed.tokens, bridged["tokens"]),
        "labels": (packed.labels, bridged["labels"]),
        "loss_mask": (packed.loss_mask, bridged["loss_mask"]),
        "position_ids": (packed.position_ids, bridged["position_ids"]),
        "cu_seqlens": (packed.cu_seqlens, cu),
        "cu_seqlens_padded": (packed.cu_seqlens_padded, bridged.get("cu_seqlens_q_padded", cu)),
    }
    bad = [name for name, (a, b) in pairs.items() if not same(a, b)]
    if packed.max_seqlen != int(bridged["max_seqlen_q"]):
        bad.append("max_seqlen")
    return bad


# ----------------------------------------------------------------------------------------------------------
# Timing


def time_ms(
    fns: dict[str, Callable[[], object]], *, repeats: int, warmup: int, cuda: bool
) -> dict[str, list[float]]:
    """Wall time in ms of ``repeats`` calls of each function, after ``warmup`` untimed rounds.

    The calls are interleaved (A B A B ...), so a drift of this shared machine's speed hits every function
    alike and the paired ratios stay meaningful. On CUDA the GPU is drained before and after each timed call
    (never inside it), so a call's time includes the device work it queued.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            times[name].append((time.perf_counter() - start) * 1e3)
    return times


def count_syncs(fn: Callable[[], object]) -> int:
    """Host-device syncs that ``fn()`` makes (``thdpack.training.profiling.catch_syncs``)."""
    from thdpack.training.profiling import catch_syncs

    with catch_syncs() as sites:
        fn()
    return len(sites)


def sync_check(fn: Callable[[], object]) -> tuple[bool, str]:
    """Run ``fn()`` once under ``set_sync_debug_mode("error")``: (passed, exception text or "")."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return True, ""
    except Exception as e:  # noqa: BLE001 - the text of whatever it raised is the report
        return False, f"{type(e).__name__}: {e}".splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ----------------------------------------------------------------------------------------------------------
# pack


BRIDGE = "megatron-bridge"
VARIANT_HOST = "host batch"
VARIANT_HOST_MASK = "a: host mask -> segments, GPU batch"
VARIANT_GPU_MASK = "b: all on GPU, mask too"
VARIANT_SEGMENTS = "c: segments given, GPU batch"


def bench_case(case: Case, args, packer: Callable | None) -> list[dict]:
    """Time one case; one result row per thdpack variant (CPU: one, CUDA: a and b)."""
    import thdpack

    cuda = args.device == "cuda"
    device = torch.device(args.device)
    lengths = sample_lengths(case.batch_size, case.seq_len, seed=args.seed)
    host = make_batch(lengths, case.seq_len, seed=args.seed)
    batch = {k: v.to(device) for k, v in host.items()}
    host_mask = host["attention_mask"]
    # Variant a: the mask stays on the host where the loader made it; the GPU batch carries the rest.
    no_mask = {k: v for k, v in batch.items() if k != "attention_mask"}
    alignment = thdpack.Alignment(cp_size=case.cp_size)

    def thd_host_mask():
        return thdpack.pack_bshd(no_mask, alignment=alignment, segments=thdpack.find_segments(host_mask))

    def thd_full():
        return thdpack.pack_bshd(batch, alignment=alignment)

    # (label, what is timed, what runs under the sync check). Variant a's check is the issue's: pack_bshd
    # alone, segments made beforehand from the host mask, must not sync. Variant b may copy lengths D2H once.
    # Variant c times that checked call: pack_bshd alone, the segments found before the step (e.g. by the data
    # loader's collate function, from the mask it made), so find_segments is not in the time.
    if cuda:
        segments = thdpack.find_segments(host_mask)

        def thd_segments_given():
            return thdpack.pack_bshd(no_mask, alignment=alignment, segments=segments)

        variants = [
            (VARIANT_HOST_MASK, thd_host_mask, thd_segments_given),
            (VARIANT_GPU_MASK, thd_full, thd_full),
            (VARIANT_SEGMENTS, thd_segments_given, None),  # its sync check is variant a's
        ]
    else:
        variants = [(VARIANT_HOST, thd_full, None)]
    timing = {"repeats": args.repeats, "warmup": args.warmup, "cuda": cuda}

    real = int(lengths.sum())
    common = {
        "case": case.name,
        "batch_size": case.batch_size,
        "seq_len": case.seq_len,
        "cp_size": case.cp_size,
        "device": args.device,
        "real_tokens": real,
        "bshd_pad_overhead": case.batch_size * case.seq_len / real,
    }

    bridge = {
        "bridge_ms": None,
        "bridge_pad_overhead": None,
        "outputs_match": None,
        "mismatched_fields": None,
        "bridge_times_ms": None,
    }
    fns = {variant: fn for variant, fn, _ in variants}
    if packer is not None:
        fns[BRIDGE] = lambda: bridge_pack(packer, batch, case.cp_size)
    all_times = time_ms(fns, **timing)
    if packer is not None:
        bridged = bridge_pack(packer, batch, case.cp_size)
        bad = compare_with_bridge(thd_full(), bridged)
        times = all_times[BRIDGE]
        bridge = {
            "bridge_ms": statistics.median(times),
            "bridge_times_ms": times,
            "bridge_pad_overhead": bridged["total_tokens"] / int(bridged["cu_seqlens_q"][-1]),
            "outputs_match": not bad,
            "mismatched_fields": bad,
        }

    rows = []
    for variant, fn, sync_fn in variants:
        packed = fn()
        times = all_times[variant]
        ms = statistics.median(times)
        row = {
            **common,
            "variant": variant,
            "main": variant in (VARIANT_HOST, VARIANT_HOST_MASK),
            "thdpack_ms": ms,
            "thdpack_pad_overhead": packed.layout.pad_overhead,
            "thdpack_times_ms": times,
            **bridge,
        }
        # Median of the paired ratios (bridge call i / thdpack call i of the same round).
        row["ratio"] = (
            statistics.median(b / t for b, t in zip(bridge["bridge_times_ms"], times, strict=True))
            if bridge["bridge_times_ms"] is not None
            else None
        )
        if args.sync_check and sync_fn is not None:
            passed, error = sync_check(sync_fn)
            row["sync_check"] = {"passed": passed, "error": error, "syncs": count_syncs(sync_fn)}
            if packer is not None:
                row["sync_check"]["bridge_syncs"] = count_syncs(
                    lambda: bridge_pack(packer, batch, case.cp_size)
                )
        rows.append(row)
    return rows


def _fmt(value, spec: str, none: str = "-") -> str:
    return none if value is None else format(value, spec)


def print_table(rows: list[dict], peer_note: str) -> None:
    columns = f"{'case':<14} {'device':<6} {'thdpack variant':<36} {'thdpack ms':>10} {'bridge ms':>10} "
    columns += f"{'bridge/thd':>10} {'pad thd':>8} {'pad bridge':>10} {'pad bshd':>8}  same THD row"
    print(columns)
    print("-" * len(columns))
    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.1f}x"
        same = {True: "yes", False: "NO: " + ",".join(r["mismatched_fields"] or []), None: "-"}[
            r["outputs_match"]
        ]
        print(
            f"{r['case']:<14} {r['device']:<6} {r['variant']:<36} {r['thdpack_ms']:>10.3f} "
            f"{_fmt(r['bridge_ms'], '.3f'):>10} {ratio:>10} {r['thdpack_pad_overhead']:>8.4f} "
            f"{_fmt(r['bridge_pad_overhead'], '.4f'):>10} {r['bshd_pad_overhead']:>8.2f}  {same}"
        )
    print(
        "ms = median per batch; bridge/thd = median of paired ratios (calls interleaved); "
        f"pad = physical / real tokens (bshd: B*S / real); bridge: {peer_note}"
    )
    for r in rows:
        check = r.get("sync_check")
        if check is None:
            continue
        what = (
            "pack_bshd(gpu_batch, segments=host)"
            if r["variant"] == VARIANT_HOST_MASK
            else "pack_bshd(gpu_batch)"
        )
        verdict = "PASS" if check["passed"] else f"FAIL ({check['error']})"
        bridge = f"; bridge: {check['bridge_syncs']} syncs" if "bridge_syncs" in check else ""
        print(f"sync-check {r['case']:<14} {what:<36} {verdict}; {check['syncs']} syncs counted{bridge}")


def environment(device: str) -> dict:
    if device == "cuda":
        device_name = torch.cuda.get_device_name()
    else:
        model = [
            ln.split(":", 1)[1].strip()
            for ln in _read("/proc/cpuinfo").splitlines()
            if ln.startswith("model name")
        ]
        device_name = model[0] if model else platform.processor() or platform.machine()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": device,
        "device_name": device_name,
    }


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def run_pack(args) -> int:
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device is available to torch", file=sys.stderr)
        return 2
    if args.sync_check and args.device != "cuda":
        print("--sync-check needs --device cuda", file=sys.stderr)
        return 2

    if args.threads:
        torch.set_num_threads(args.threads)
    packer, peer_note = None, "disabled (--no-peer)"
    if not args.no_peer:
        try:
            packer, origin = load_bridge_packer(args.bridge)
            peer_note = f"megatron-bridge {BRIDGE_FUNCTION} from {origin}"
        except Exception as e:  # noqa: BLE001 - any failure only drops the peer column
            peer_note = f"skipped: {type(e).__name__}: {e}".splitlines()[0]
            print(f"megatron-bridge peer column {peer_note}", file=sys.stderr, flush=True)

    env = environment(args.device)
    print(
        f"thdpack pack benchmark | {env['device_name']} | torch {env['torch']} | python {env['python']} | "
        f"{env['cpu_count']} CPUs, {env['torch_threads']} torch threads | {env['date']}"
    )
    rows = [row for case in args.cases for row in bench_case(case, args, packer)]
    print_table(rows, peer_note)

    if args.json:
        meta = {
            **env,
            "peer": peer_note,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "seed": args.seed,
            "lengths": "lognormal, median S/8, sigma 1.0, clipped to [1, S], right padded",
        }
        Path(args.json).write_text(json.dumps({"benchmark": "pack", "meta": meta, "results": rows}, indent=2))
        print(f"wrote {args.json}")
    return 0


# ----------------------------------------------------------------------------------------------------------
# Command line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/pack_vs_bridge.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--bridge",
        type=Path,
        metavar="PATH",
        help="Megatron-Bridge source tree, wheel or unzipped wheel (default: the installed megatron.bridge)",
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where the batch lives (cuda: a GPU-resident batch)",
    )
    parser.add_argument(
        "--cases",
        type=parse_cases,
        default=parse_cases(DEFAULT_CASES),
        help=f"comma-separated BxS[-cpN] (default {DEFAULT_CASES})",
    )
    parser.add_argument(
        "--repeats", type=int, default=20, help="timed calls per measurement (median reported)"
    )
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls before timing")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the length mix and tokens")
    parser.add_argument("--no-peer", action="store_true", help="skip Megatron-Bridge")
    parser.add_argument(
        "--sync-check",
        action="store_true",
        help='cuda: run pack_bshd under torch.cuda.set_sync_debug_mode("error") and report',
    )
    parser.add_argument("--json", metavar="PATH", help="also write machine-readable results here")
    return parser


def main(argv: list[str] | None = None) -> int:
    return run_pack(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
