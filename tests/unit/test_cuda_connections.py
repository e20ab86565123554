"""``CUDA_DEVICE_MAX_CONNECTIONS`` under tensor or context parallelism
(:func:`thdpack.megatron.runtime.serialize_cuda_connections`), as Megatron-LM's argument checks require:
Transformer Engine overlaps TP collectives with the backward GEMMs only with one hardware queue, and warned so on
every rank of the four-H100 8B runs (2026-11-27). Set before the CUDA context exists (the variable is read then),
a user's own value kept."""

from __future__ import annotations

import os

from thdpack.megatron.runtime import serialize_cuda_connections

VAR = "CUDA_DEVICE_MAX_CONNECTIONS"


def test_tensor_parallelism_gets_one_connection_when_unset(monkeypatch):
    monkeypatch.delenv(VAR, raising=False)
    assert serialize_cuda_connections(2) is None

    assert os.environ[VAR] == "1"


def test_context_parallelism_gets_one_connection_too(monkeypatch):
    monkeypatch.delenv(VAR, raising=False)
    assert serialize_cuda_connections(1, 2) is None
    assert os.environ[VAR] == "1"


def test_without_tensor_or_context_parallelism_nothing_is_set(monkeypatch):
    monkeypatch.delenv(VAR, raising=False)
    assert serialize_cuda_connections(1, 1) is None

    assert VAR not in os.environ


def test_a_users_other_value_is_kept_and_warned_about(monkeypatch):
    monkeypatch.setenv(VAR, "8")
    warning = serialize_cuda_connections(4)

    assert os.environ[VAR] == "8"
    assert warning.startswith("CUDA_DEVICE_MAX_CONNECTIONS=8 under tensor or context parallelism")


def test_the_training_run_sets_it_before_the_recipe_touches_the_gpu():
    # setup_run calls it first: resolve_recipe sizes the token budget from the GPU's memory (a CUDA context)
    import inspect

    from thdpack.training import loop

    source = inspect.getsource(loop.setup_run)
    assert source.index("serialize_cuda_connections(") < source.index("resolve_recipe(cfg)")
