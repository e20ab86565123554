"""Test-suite wiring: tests marked ``gpu`` need CUDA and skip cleanly on CPU-only machines (CI); tests marked
``cpu_only`` exercise thdpack's CPU support for Megatron-core, which is meant for machines without CUDA, and skip
where a GPU is visible."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        marker, reason = "cpu_only", "thdpack.megatron.cpu is for machines without CUDA"
    else:
        marker, reason = "gpu", "needs a CUDA GPU (run on a GPU host; results are in benchmarks/results)"
    for item in items:
        if marker in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))
