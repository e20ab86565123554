"""Test-suite wiring: tests marked ``gpu`` need CUDA and skip cleanly on CPU-only machines (CI); tests marked
``cpu_only`` exercise thdpack's CPU support for Megatron-core, which is meant for machines without CUDA, and skip
where a GPU is visible.

On a GPU the tests' fp32 is true fp32: Transformer Engine runs fp32 GEMMs with cuBLAS's TF32 compute type and
torch's cuDNN convolutions allow TF32, which the fp32 parity checks against transformers and PEFT would measure
(about 1e-3 relative). NVIDIA_TF32_OVERRIDE=0 turns TF32 off in cuBLAS and cuDNN; set before CUDA starts, it holds
for this process and the runs it launches. bf16 and FP8 GEMMs are unchanged."""

import os

os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        marker, reason = "cpu_only", "thdpack.megatron.cpu is for machines without CUDA"
    else:
        marker, reason = "gpu", "needs a CUDA GPU (run on a GPU host; results are in benchmarks/results)"
    for item in items:
        if marker in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="module")
def one_rank_megatron(tmp_path_factory):
    """One process as a whole world (gloo) with Megatron's parallel state, for a test module's in-process model
    runs (``thdpack.megatron.cpu``)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from thdpack.megatron import cpu

    # A process group left behind by another test is a leak in that test: fail here rather than skip.
    assert not dist.is_initialized() and not ps.model_parallel_is_initialized(), "a process group leaked"
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    cpu.initialize_model_parallel_cpu(seed=1234)
    yield
    cpu.destroy_model_parallel_cpu()
