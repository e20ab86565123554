"""Run megatron-core on CPU over gloo: debug and test without a GPU.

    from thdpack.megatron.cpu import initialize_model_parallel_cpu, destroy_model_parallel_cpu
    initialize_model_parallel_cpu(tensor_model_parallel_size=2, seed=1234)   # under torchrun
    ...  # GPTModel with get_gpt_layer_local_spec(), get_forward_backward_func(), DDP, ...
    destroy_model_parallel_cpu()

`enable_cpu_support()` applies the patches below, once per process. Each one turns a call that
would raise on a CPU-only torch ("Torch not compiled with CUDA enabled", a NameError without
Transformer Engine, ...) into its CPU equivalent, so it never changes a code path that already
worked. Call it only in processes that run megatron-core on CPU.

Patches (megatron-core file: function, and why). Each was checked on megatron-core 0.16.1 (line numbers are
that release's; `check_mcore_version` refuses any other version unless THDPACK_CPU_ALLOW_UNKNOWN_MCORE=1).
megatron-core has no device setting or hook for any of them: it targets CUDA only.

1. "cuda" means the CPU inside these modules, whose functions hard-code the CUDA device inline
   (`device=torch.cuda.current_device()`, `device="cuda"`, CUDA streams, `torch.cuda.synchronize()`):
   the module's global `torch` is rebound to a stand-in that is torch except that `cuda.current_device()`
   is "cpu", factories map device "cuda" to "cpu", streams/events are no-ops (a CPU has one stream,
   always synchronised) and `cuda.synchronize()` does nothing. `torch.cuda` itself is never touched.
   See `_CUDA_PINNED_MODULES` for the module list and the function in each that needs it. The module
   attribute `torch` is what those functions read at call time; rebinding it (not torch.cuda, not the
   functions) keeps the change inside megatron-core.
2. transformer/moe/moe_utils.py: `RouterGatingLinearFunction` (moe_utils.py:1192) reads the global
   `te_general_gemm`, which is only defined when Transformer Engine imports: define it as None (plain
   torch.mm path; `thdpack.megatron.compat`, which the torch backend also applies on a GPU).
3. tensor_parallel/random.py: `CudaRNGStatesTracker` and `model_parallel_cuda_manual_seed` keep
   CUDA generator states. `model_parallel_cpu_manual_seed` installs `CpuRNGStatesTracker` (same
   seeds, CPU generator) in the private globals `_CUDA_RNG_STATE_TRACKER` /
   `_CUDA_RNG_STATE_TRACKER_INITIALIZED` (random.py:282; `initialize_rng_tracker`, random.py:286, only
   chooses between Megatron's and TE's CUDA trackers, so there is no public way in), and
   `_get_cuda_rng_state` / `_set_cuda_rng_state` (random.py:41 and 72, used by activation recompute,
   `CheckpointFunction`) read and write the CPU generator.
4. transformer/torch_norm.py: `WrappedTorchNorm` (torch_norm.py:32) refuses `sequence_parallel` because it does not mark
   its weights; the local spec's sequence-parallel norm is Apex's (CUDA-only). We build the torch norm
   and mark its weights `sequence_parallel=True` like Apex/TE norms do, so `finalize_model_grads`
   all-reduces their gradients over the tensor-parallel group (`thdpack.megatron.norm`, whose `TorchNorm`
   thdpack's own torch layer spec uses on any device; this patch covers Megatron's spec and the block's
   final norm when Transformer Engine is absent).
5. transformer/moe/token_dispatcher.py (alltoall dispatcher): `maybe_move_tensor_to_cpu(as_numpy=True)`
   (moe_utils.py:1078, imported into token_dispatcher) only converts CUDA tensors, so on CPU the all-to-all split sizes stay tensors, which
   `all_to_all_single` rejects: convert CPU tensors to numpy as well.
6. models/common/language_module/language_module.py: `setup_embeddings_and_output_layer` calls
   `weight.data.cuda()` (language_module.py:244) on the tied output embedding of the last pipeline stage. A Tensor method
   cannot be rebound per module, so `Tensor.cuda` is the identity only while that one function runs
   (once per model build).

7. optimizer/distrib_optimizer.py `DistributedOptimizer.__init__` (distrib_optimizer.py:361, 420, 582) and
   optimizer/clip_grads.py `clip_grad_by_total_norm_fp32` (clip_grads.py:167) accept parameters and gradients
   by their type names (`param.type() == "torch.cuda.FloatTensor"`): while those two functions run, `Tensor.type()` with no
   argument names a CPU tensor's type as its CUDA counterpart.

Collectives: gloo in torch 2.13 implements everything tensor_parallel, the pipeline schedules and the
MoE dispatchers call (all_reduce, all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single,
batch_isend_irecv), so TP with sequence parallelism needs no fallback.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import types
import warnings

import torch
import torch.distributed as dist

try:
    import megatron.core
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mcore_random
except ImportError as e:  # pragma: no cover
    raise ImportError("thdpack.megatron.cpu needs megatron-core: pip install megatron-core") from e

from .compat import define_te_general_gemm
from .norm import build_sequence_parallel_norm

__all__ = [
    "CHECKED_MCORE_VERSIONS",
    "ALLOW_UNKNOWN_MCORE_ENV",
    "check_mcore_version",
    "enable_cpu_support",
    "CpuRNGStatesTracker",
    "model_parallel_cpu_manual_seed",
    "initialize_model_parallel_cpu",
    "destroy_model_parallel_cpu",
]

CHECKED_MCORE_VERSIONS: tuple[str, ...] = ("0.16.1", "0.19.2")
"""megatron-core versions the patches were run against (tests/unit/test_cpu_support.py, tests/functional/test_cpu_parallel.py)."""

ALLOW_UNKNOWN_MCORE_ENV = "THDPACK_CPU_ALLOW_UNKNOWN_MCORE"

_enabled = False


# ---------------------------------------------------------------------------------------------
# 1. "cuda" means the CPU inside a few megatron-core modules
# ---------------------------------------------------------------------------------------------

_CUDA_PINNED_MODULES = {
    "megatron.core.utils": "GlobalMemoryBuffer.get_tensor (local attention and SP all-gather buffers)",
    "megatron.core.transformer.utils": 'get_default_causal_mask: torch.ones(..., device="cuda")',
    "megatron.core.models.common.embeddings.rotary_pos_embedding": "RotaryEmbedding.get_emb moves inv_freq to CUDA",
    "megatron.core.transformer.moe.router": "TopKRouter.gating moves its weight to CUDA",
    "megatron.core.transformer.moe.token_dispatcher": "MoEAlltoAllTokenDispatcher: side CUDA stream for D2H copies",
    "megatron.core.transformer.moe.moe_utils": 'track_moe_metrics: tracker values on device="cuda"',
    "megatron.core.tensor_parallel.layers": "weights on CUDA without use_cpu_initialization; SP all-gather in backward",
    "megatron.core.tensor_parallel.mappings": "SP gather / reduce-scatter / all-to-all output buffers",
    "megatron.core.pipeline_parallel.p2p_communication": "P2PCommunicator: recv buffers, shape exchange, cuda.synchronize",
    "megatron.core.pipeline_parallel.schedules": 'forward_backward_*: total_num_tokens on device="cuda"',
    "megatron.core.distributed.param_and_grad_buffer": "grad buffers on CUDA; communication stream",
    "megatron.core.distributed.distributed_data_parallel": "DDP communication stream",
    "megatron.core.optimizer.optimizer": "found_inf / overflow buffers on device='cuda'",
    "megatron.core.optimizer.distrib_optimizer": "state gather buffers on the current CUDA device",
    "megatron.core.optimizer.clip_grads": "total norm and overflow buffers on device='cuda'",
    "megatron.core.dist_checkpointing.strategies.filesystem_async": "preload_tensors: cuda.synchronize",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver": "save finalize: failure flags on CUDA",
    "megatron.core.dist_checkpointing.strategies.async_utils": "execute_sync: cuda.synchronize",
}


class _NullStream:
    """The one CPU "stream" (and the event it records): work is always done, so waits are no-ops."""

    def wait_stream(self, stream):
        pass

    def record_event(self, event=None):
        return self

    def synchronize(self):
        pass


_NULL_STREAM = _NullStream()


class _CpuCuda:
    """`torch.cuda` as a pinned module sees it; everything not defined here is the real torch.cuda."""

    @staticmethod
    def current_device():
        return "cpu"

    @staticmethod
    def synchronize(device=None):
        pass

    @staticmethod
    def stream(stream):
        return contextlib.nullcontext()

    @staticmethod
    def Stream(*args, **kwargs):  # noqa: N802 (torch's name)
        return _NULL_STREAM

    @staticmethod
    def current_stream(device=None):
        return _NULL_STREAM

    @staticmethod
    def default_stream(device=None):
        return _NULL_STREAM

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


def _on_cpu(factory):
    @functools.wraps(factory)
    def wrapper(*args, device=None, **kwargs):
        if device is not None and torch.device(device).type == "cuda":
            device = "cpu"
        return factory(*args, device=device, **kwargs)

    return wrapper


class _CpuTorch(types.ModuleType):
    """`torch` as a pinned module sees it: "cuda" is the CPU; everything else is the real torch."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CpuCuda()
        for name in ("empty", "zeros", "ones", "full", "tensor", "arange"):
            setattr(self, name, _on_cpu(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)


_CPU_TORCH = _CpuTorch()


def _pin_modules_to_cpu():
    for name in _CUDA_PINNED_MODULES:
        importlib.import_module(name).torch = _CPU_TORCH


# ---------------------------------------------------------------------------------------------
# 2.-7. one function per patch
# ---------------------------------------------------------------------------------------------


def _rng_state_on_cpu():
    # random.py _get/_set_cuda_rng_state (activation recompute saves and replays the device RNG)
    # call torch.cuda.random: on CPU the device generator is the CPU default generator.
    def _get_cuda_rng_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def _set_cuda_rng_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    mcore_random._get_cuda_rng_state = _get_cuda_rng_state
    mcore_random._set_cuda_rng_state = _set_cuda_rng_state


def _allow_sequence_parallel_torch_norm():
    # torch_norm.py WrappedTorchNorm.__new__ asserts `not config.sequence_parallel` because it does
    # not mark its weights; mark them as Apex's FusedLayerNorm and TENorm do (thdpack.megatron.norm; our
    # own layer spec uses its TorchNorm on any device, this covers Megatron's spec and final norm on CPU).
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    original = WrappedTorchNorm.__new__

    def __new__(cls, config, *args, **kwargs):
        return build_sequence_parallel_norm(functools.partial(original, cls), config, *args, **kwargs)

    WrappedTorchNorm.__new__ = __new__


def _split_sizes_as_numpy():
    # token_dispatcher.py MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize turns split sizes
    # into numpy via moe_utils.maybe_move_tensor_to_cpu, which skips tensors already on the CPU;
    # all_to_all_single then rejects the tensor.
    from megatron.core.transformer.moe import token_dispatcher

    original = token_dispatcher.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy().copy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _tied_embedding_stays_on_cpu():
    # language_module.py LanguageModule.setup_embeddings_and_output_layer: `weight.data.cuda()`
    # before all-reducing the tied embedding copy across the first and last pipeline stage.
    from megatron.core.models.common.language_module.language_module import LanguageModule

    original = LanguageModule.setup_embeddings_and_output_layer

    @functools.wraps(original)
    def setup_embeddings_and_output_layer(self):
        shadowed = "cuda" in vars(torch.Tensor)
        saved = torch.Tensor.cuda
        torch.Tensor.cuda = lambda tensor, *args, **kwargs: tensor
        try:
            return original(self)
        finally:
            if shadowed:
                torch.Tensor.cuda = saved
            else:
                del torch.Tensor.cuda

    LanguageModule.setup_embeddings_and_output_layer = setup_embeddings_and_output_layer


def _cuda_type_names_in_optimizer():
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mcore_optimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    DistributedOptimizer.__init__ = _with_cuda_type_names(DistributedOptimizer.__init__)
    clip = _with_cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32)
    clip_grads.clip_grad_by_total_norm_fp32 = clip
    mcore_optimizer.clip_grad_by_total_norm_fp32 = clip


_TENSOR_TYPE = torch.Tensor.type


def _cuda_type_name(tensor, *args, **kwargs):
    name = _TENSOR_TYPE(tensor, *args, **kwargs)
    if args or kwargs or tensor.device.type != "cpu":
        return name
    return name.replace("torch.", "torch.cuda.", 1)


def _with_cuda_type_names(function):
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        torch.Tensor.type = _cuda_type_name
        try:
            return function(*args, **kwargs)
        finally:
            torch.Tensor.type = _TENSOR_TYPE

    return wrapper


# ---------------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------------


def check_mcore_version() -> str:
    """Return megatron-core's version; raise RuntimeError if the patches were not checked against it
    (a warning instead when THDPACK_CPU_ALLOW_UNKNOWN_MCORE=1)."""
    found = megatron.core.__version__
    if found in CHECKED_MCORE_VERSIONS:
        return found
    message = (
        f"thdpack.megatron.cpu was checked against megatron-core {', '.join(CHECKED_MCORE_VERSIONS)}, "
        f"found {found}. Its patches target megatron-core functions by module and name, which may have "
        f"moved or changed. Set {ALLOW_UNKNOWN_MCORE_ENV}=1 to try anyway (a warning instead of this "
        f"error); once tests/unit/test_cpu_support.py and tests/functional/test_cpu_parallel.py pass, "
        f"add {found} to CHECKED_MCORE_VERSIONS."
    )
    if os.environ.get(ALLOW_UNKNOWN_MCORE_ENV, "") not in ("", "0"):
        warnings.warn(message, stacklevel=2)
        return found
    raise RuntimeError(message)


def enable_cpu_support() -> None:
    """Patch megatron-core so GPTModel (local layer spec, dense or MoE), the pipeline schedules,
    P2P communication, DDP and the tensor/sequence/expert-parallel collectives run on CPU over
    gloo. Checks the megatron-core version every call; patches once per process."""
    global _enabled
    check_mcore_version()
    if _enabled:
        return
    if torch.cuda.is_available():
        warnings.warn(
            "enable_cpu_support() in a process that sees a GPU: megatron-core will allocate its "
            "buffers on the CPU from now on.",
            stacklevel=2,
        )
    _pin_modules_to_cpu()
    define_te_general_gemm()
    _rng_state_on_cpu()
    _allow_sequence_parallel_torch_norm()
    _split_sizes_as_numpy()
    _tied_embedding_stays_on_cpu()
    _cuda_type_names_in_optimizer()
    _enabled = True


class CpuRNGStatesTracker(mcore_random.CudaRNGStatesTracker):
    """Megatron's model-parallel RNG tracker, with the CPU default generator for the CUDA one.

    `fork(name)` runs its block on the named stream of random numbers (dropout in tensor-parallel
    regions, expert initialisation) and restores the default stream afterwards, as on GPU.
    """

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"rng seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"rng state {name} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()

    @contextlib.contextmanager
    def fork(self, name: str = mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise ValueError(f"rng state {name} is not added")
        outer_state, outer_name = torch.get_rng_state(), self._current_state_name
        if outer_name != "default-rng":  # nested fork: park the outer stream where it got to
            self.states_[outer_name] = outer_state
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            if outer_name != "default-rng":
                outer_state = self.states_[outer_name]
            torch.set_rng_state(outer_state)
            self._current_state_name = outer_name


def model_parallel_cpu_manual_seed(seed: int) -> None:
    """CPU `model_parallel_cuda_manual_seed`: the same three seeded streams (default/data-parallel,
    tensor-model-parallel, expert-parallel) on the CPU generator. Call after initialize_model_parallel."""
    tracker = CpuRNGStatesTracker()
    mcore_random._CUDA_RNG_STATE_TRACKER = tracker
    mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    torch.manual_seed(seed)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    etp_rank = parallel_state.get_expert_tensor_parallel_rank()
    # the offsets are megatron's (tensor_parallel/random.py model_parallel_cuda_manual_seed)
    tracker.add(mcore_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mcore_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)


def initialize_model_parallel_cpu(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    seed: int = 1234,
    **kwargs,
) -> None:
    """Megatron-core model parallelism on CPU: init torch.distributed with gloo from the torchrun
    environment (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE) unless already initialised,
    `enable_cpu_support()`, `parallel_state.initialize_model_parallel(...)` (extra keyword
    arguments go there) and `model_parallel_cpu_manual_seed(seed)`."""
    enable_cpu_support()
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    elif dist.get_backend() != "gloo":
        raise RuntimeError(f"torch.distributed is initialised with {dist.get_backend()}; CPU runs need gloo")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        context_parallel_size=context_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        **kwargs,
    )
    model_parallel_cpu_manual_seed(seed)


def destroy_model_parallel_cpu() -> None:
    """Undo `initialize_model_parallel_cpu`: megatron's groups and RNG tracker, then the process group.
    The patches stay (they are per process)."""
    parallel_state.destroy_model_parallel()
    mcore_random._CUDA_RNG_STATE_TRACKER = None
    mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
    if dist.is_initialized():
        dist.destroy_process_group()
