"""The fused kernels' launches without the JIT's dispatch (thdpack._triton_launch): which kernels qualify (on
CPU) and what a direct launch does (on a GPU)."""

import os
import subprocess
import sys

import pytest
import torch

from thdpack import Alignment, find_segments, pack_bshd

triton = pytest.importorskip("triton", reason="the fused path needs Triton")

from thdpack import _triton_launch, fused  # noqa: E402
from thdpack.fused import _kernel, _row_stats_kernel  # noqa: E402

from .test_pack_gpu import assert_same_token_tensors  # noqa: E402


def gpu(test):
    """A GPU test of direct launches: it needs CUDA (the ``gpu`` mark) and a Triton that launches directly (the
    CPU tests of the rule below run whatever the version)."""
    direct = pytest.mark.skipif(
        not _triton_launch.supported(_kernel()),
        reason=f"direct launches are off with Triton {triton.__version__}",
    )
    return pytest.mark.gpu(direct(test))


@pytest.mark.parametrize(
    "version, expected",
    [
        ("3.3.1", False),
        ("3.4.0", True),
        ("3.5.1", True),
        ("3.6.0", True),
        ("3.7.1", True),
        ("3.9.0", True),
        ("3.10.0", False),
        ("4.0.0", False),
    ],
)
def test_direct_launches_are_for_jit_kernels_of_the_triton_versions_whose_launcher_call_was_read(
    monkeypatch, version, expected
):
    monkeypatch.setattr(triton, "__version__", version)
    _triton_launch._supported_version.cache_clear()
    _triton_launch.supported.cache_clear()
    try:
        assert _triton_launch.supported(_kernel()) is expected
        assert _triton_launch.supported(_row_stats_kernel()) is expected
        assert _triton_launch.supported(lambda: None) is False  # not a Triton kernel
    finally:
        _triton_launch._supported_version.cache_clear()
        _triton_launch.supported.cache_clear()


def test_a_kernel_defined_under_the_interpreter_takes_the_jit():
    # TRITON_INTERPRET=1 when the kernel is defined makes it an InterpretedFunction, with no compiled launcher;
    # unsetting the variable later does not change what the kernel is.
    if not _triton_launch._supported_version():
        pytest.skip(f"direct launches are off with Triton {triton.__version__} whatever the kernel")
    code = (
        "import os, thdpack._triton_launch as L, thdpack.fused as F\n"
        "k = F._kernel()\n"
        "del os.environ['TRITON_INTERPRET']\n"
        "print(type(k).__name__, L.supported(k))"
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["InterpretedFunction", "False"]


def host_batch(B, S, seed, one_sample=False):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.full((B,), S) if one_sample else torch.randint(1, S + 1, (B,), generator=g)
    mask = torch.arange(S)[None] < lengths[:, None]
    tokens = torch.randint(2, 1000, (B, S), generator=g) * mask
    return {"tokens": tokens, "labels": tokens.roll(-1, 1), "loss_mask": mask.float(), "attention_mask": mask}


def misaligned(t):
    """A contiguous copy of ``t`` on the GPU whose data pointer is not 16-byte aligned."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device="cuda")[1:]
    return flat.copy_(t.reshape(-1).cuda()).view(t.shape)


def pack_on_gpu(host, pad_token_id=0, misalign=False, **kwargs):
    on_gpu = {k: (misaligned(v) if misalign else v.cuda()) for k, v in host.items() if k != "attention_mask"}
    packed = pack_bshd(
        on_gpu, segments=find_segments(host["attention_mask"]), pad_token_id=pad_token_id, **kwargs
    )
    assert_same_token_tensors(packed, pack_bshd(host, pad_token_id=pad_token_id, **kwargs))
    return packed


def jit_cache(kernel):
    return kernel.device_caches[torch.cuda.current_device()][0]


@gpu
def test_the_keys_determine_the_kernel_triton_compiles(monkeypatch):
    # A direct launch reuses the kernel compiled for its key, so the key must fix everything Triton compiles
    # for. Every launch here goes through the JIT and records its key: Triton compiles one kernel per key, also
    # for values it would otherwise specialize on (an int equal to 1 or a multiple of 16), for pointers that
    # are not 16-byte aligned, and for a bool mask (read as uint8) against a uint8 one.
    keys = set()

    def recording_launch(kernel, device, key, grid, args, constexprs, *, direct=True):
        keys.add(_triton_launch.compiled_key(kernel, device, key, constexprs))
        kernel[(grid,)](*args, **constexprs)

    monkeypatch.setattr(fused, "launch", recording_launch)
    jit_cache(_kernel()).clear()
    jit_cache(_row_stats_kernel()).clear()
    for case in (
        dict(B=1, S=16, seed=0, one_sample=True),  # one segment, T == 16
        dict(B=3, S=33, seed=1),  # odd T
        dict(B=2, S=64, seed=2, one_sample=True),  # two segments, T a multiple of 16
        dict(B=5, S=40, seed=3),
    ):
        for pad_token_id in (0, 1, 16, 7):
            for misalign in (False, True):
                host = host_batch(**case)
                pack_on_gpu(host, pad_token_id=pad_token_id, misalign=misalign)
                mask = host["attention_mask"]
                for m in (mask, mask.to(torch.uint8)):
                    assert torch.equal(
                        find_segments(misaligned(m) if misalign else m.cuda()).length,
                        find_segments(mask).length,
                    )
    # int32 tokens and derived labels: other keys.
    host = host_batch(3, 20, seed=4)
    pack_on_gpu({k: v.int() if k == "tokens" else v for k, v in host.items() if k != "labels"})
    for kernel in (_kernel(), _row_stats_kernel()):
        kernel_keys = [key for key in keys if key[0] == id(kernel)]
        assert len(kernel_keys) >= 2
        assert len(jit_cache(kernel)) == len(kernel_keys)


@gpu
def test_after_the_first_launch_of_a_key_the_jit_is_not_called(monkeypatch):
    host = host_batch(4, 48, seed=4)
    pack_on_gpu(host)  # compiles (or finds) the key's kernel through the JIT

    def no_jit(*args, **kwargs):
        raise AssertionError("the JIT dispatched a launch that had a compiled kernel")

    monkeypatch.setattr(_kernel(), "run", no_jit)
    pack_on_gpu(host_batch(4, 48, seed=5))
    # On another stream too: the launch goes to the current stream, as the JIT's would.
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        pack_on_gpu(host_batch(4, 48, seed=6))
    stream.synchronize()


@gpu
def test_a_launch_hook_sees_every_launch(monkeypatch):
    # Profilers (Triton's proton) set launch hooks; with one set every launch goes through the JIT.
    host = host_batch(3, 32, seed=7)
    pack_on_gpu(host)
    seen = []
    hooks = triton.knobs.runtime.launch_enter_hook
    if hasattr(hooks, "add"):  # Triton 3.5 and later: a chain of hooks
        hooks.add(seen.append)
        request_cleanup = lambda: hooks.remove(seen.append)  # noqa: E731
    else:
        monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", seen.append)
        request_cleanup = lambda: None  # noqa: E731
    try:
        pack_on_gpu(host)
        pack_on_gpu(host)
    finally:
        request_cleanup()
    assert len(seen) == 2


@gpu
def test_a_pipeline_stages_hook_sends_every_launch_through_the_jit(monkeypatch):
    # Since Triton 3.7 the hook's answer is part of the JIT's compile key, so the kernel the JIT would launch may
    # not be the one kept.
    if not hasattr(triton.knobs.runtime, "add_stages_inspection_hook"):
        pytest.skip(f"Triton {triton.__version__} has no pipeline-stages hook")
    host = host_batch(3, 32, seed=10)
    pack_on_gpu(host)
    calls = []
    jit_run = _kernel().run

    def counting_run(*args, **kwargs):
        calls.append(1)
        return jit_run(*args, **kwargs)

    def stages_hook(*args):  # the key's part without arguments; a no-op on the compiler's stages
        return None if args else ("thdpack-test", "0")

    monkeypatch.setattr(_kernel(), "run", counting_run)
    monkeypatch.setattr(triton.knobs.runtime, "add_stages_inspection_hook", stages_hook)
    pack_on_gpu(host)
    pack_on_gpu(host)
    assert len(calls) == 2


@gpu
def test_an_int_outside_int32_is_launched_by_the_jit():
    # pad_token_id 2**40 is an int64 argument to Triton; the direct launch's keys assume int32.
    before = {k for k in _triton_launch._compiled if k[0] == id(_kernel())}
    packed = pack_on_gpu(host_batch(3, 32, seed=8), pad_token_id=2**40, alignment=Alignment(pad_total_to=128))
    assert (packed.tokens == 2**40).any()
    assert {k for k in _triton_launch._compiled if k[0] == id(_kernel())} == before


@gpu
def test_the_row_statistics_kernel_is_launched_directly_after_its_first_launch(monkeypatch):
    mask = host_batch(4, 64, seed=9)["attention_mask"]
    expected = find_segments(mask)
    find_segments(mask.cuda())

    def no_jit(*args, **kwargs):
        raise AssertionError("the JIT dispatched a launch that had a compiled kernel")

    monkeypatch.setattr(_row_stats_kernel(), "run", no_jit)
    for m in (mask.cuda(), misaligned(mask)):
        got = find_segments(m)
        assert [got.row.tolist(), got.start.tolist(), got.length.tolist()] == [
            expected.row.tolist(),
            expected.start.tolist(),
            expected.length.tolist(),
        ]
