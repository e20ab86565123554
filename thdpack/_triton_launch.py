"""Launch a Triton kernel without the JIT's per-call dispatch (used by :mod:`thdpack.fused`).

``kernel[grid](*args)`` binds the arguments, computes their specialization, looks the compiled kernel up and
only then calls its launcher: for the packing kernel that dispatch cost 9-18 us of host time per launch on H100
and H200 hosts (Triton 3.6), the launcher itself 6-10 us, and the kernel's whole GPU time is 5-7 us
(``benchmarks/results/triton_launch_2026-11-22.md``). :func:`launch` makes the first launch of each ``key``
through the JIT, keeps the compiled kernel it returns, and later calls its launcher directly, as the JIT itself
would.

That is right only when ``key`` fixes everything Triton compiled the kernel for. The kernels launched here
are declared with ``do_not_specialize`` on every runtime argument, so Triton specializes on neither values nor
pointer alignment, only on each argument's type (a tensor's dtype; int32, int64 or uint64 for an int) and the
constexprs. Callers give ``key`` as the tensors' dtypes (:func:`compiled_key` adds the kernel's id, the device and
the constexprs) and pass ``direct=False`` when an int argument is outside int32 (then the JIT launches, every time).

The launcher's call (all arguments, constexprs included, after grid, stream, function, metadata and hooks) is
the one Triton 3.4 to 3.9 make; other versions, a kernel Triton's interpreter runs (``TRITON_INTERPRET=1`` when
it was defined), a set launch hook (profilers) and a set pipeline-stages hook (part of the JIT's compile key since
3.7) take the JIT path.
"""

from __future__ import annotations

import functools

# compiled_key -> (the kernel, the compiled kernel its JIT returned for that key)
_compiled: dict[tuple, tuple[object, object]] = {}


@functools.cache
def _supported_version() -> bool:
    import triton

    try:
        major, minor = (int(p) for p in triton.__version__.split(".")[:2])
    except ValueError:
        return False
    return (3, 4) <= (major, minor) <= (3, 9)


@functools.cache
def supported(kernel) -> bool:
    """Whether :func:`launch` may launch ``kernel`` directly: a Triton 3.4-3.9 ``JITFunction``. A kernel defined
    under ``TRITON_INTERPRET=1`` is an ``InterpretedFunction``, which Triton runs in Python, not compiled."""
    from triton.runtime.jit import JITFunction

    return _supported_version() and isinstance(kernel, JITFunction)


@functools.cache
def _triton_runtime():
    from triton import knobs
    from triton.runtime import driver

    return knobs.runtime, driver


def _is_set(hook) -> bool:
    # Triton 3.4: a callable or None; 3.5 and later: a HookChain, with no hook an empty one.
    return hook is not None and bool(getattr(hook, "calls", True))


def fits_int32(*values: int) -> bool:
    """Whether Triton types each of ``values`` as int32 (the type :func:`launch`'s keys assume)."""
    return all(-(2**31) <= v < 2**31 for v in values)


def compiled_key(kernel, device: int, key: tuple, constexprs: dict) -> tuple:
    """What a compiled kernel is kept under: the kernel's ``id``, the device, the caller's ``key`` and the
    constexprs. The id, not the kernel: a ``JITFunction`` hashes through its source hash, under a lock, about
    0.8 us a call; :func:`launch` checks that the entry is the kernel's."""
    return (id(kernel), device, key, *constexprs.values())


def launch(
    kernel, device: int, key: tuple, grid: int, args: tuple, constexprs: dict, *, direct: bool = True
) -> None:
    """``kernel[(grid,)](*args, **constexprs)`` on the current stream of ``device``, the current CUDA device.

    ``args`` are the runtime arguments in the kernel's order and ``constexprs`` the constexprs in theirs (all
    after the runtime arguments); ``key`` and the constexprs must determine the compiled kernel (see the
    module's docstring).
    """
    if not (direct and _supported_version()):
        kernel[(grid,)](*args, **constexprs)
        return
    runtime, driver = _triton_runtime()
    cache_key = compiled_key(kernel, device, key, constexprs)
    entry = _compiled.get(cache_key)
    if (
        entry is None
        or entry[0] is not kernel
        or _is_set(runtime.launch_enter_hook)
        or _is_set(runtime.launch_exit_hook)
        or getattr(runtime, "add_stages_inspection_hook", None) is not None
    ):
        compiled = kernel[(grid,)](*args, **constexprs)  # the JIT returns the kernel it compiled and launched
        # An interpreted kernel has no compiled kernel to keep, nor has a JIT that returned none.
        if compiled is not None and supported(kernel):
            _compiled[cache_key] = (kernel, compiled.result() if hasattr(compiled, "result") else compiled)
        return
    compiled = entry[1]
    stream = driver.active.get_current_stream(device)
    compiled.run(
        grid,
        1,
        1,
        stream,
        compiled.function,
        compiled.packed_metadata,
        None,
        None,
        None,
        *args,
        *constexprs.values(),
    )
