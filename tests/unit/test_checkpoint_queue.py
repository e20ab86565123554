"""thdpack.megatron.checkpoint: a synchronous save hands megatron-core's write results over an in-process queue,
so megatron-core's torch_dist writer never spawns its multiprocessing Manager (a second interpreter per rank)."""

from __future__ import annotations

import multiprocessing
import queue

import pytest

from thdpack.megatron.checkpoint import _write_results_in_process

filesystem_async = pytest.importorskip("megatron.core.dist_checkpointing.strategies.filesystem_async")


def _megatrons_queue():
    # the getter is _get_write_results_queue in megatron-core 0.16, get_write_results_queue in 0.19
    getter = (
        getattr(filesystem_async, "get_write_results_queue", None)
        or filesystem_async._get_write_results_queue
    )
    return getter()


def test_the_writer_gets_an_in_process_queue_and_no_manager_process_starts(monkeypatch):
    monkeypatch.setattr(filesystem_async, "_results_queue", None)
    before = set(multiprocessing.active_children())
    _write_results_in_process()
    results = _megatrons_queue()
    assert isinstance(results, queue.Queue)
    assert set(multiprocessing.active_children()) == before


def test_a_queue_megatron_already_made_is_kept(monkeypatch):
    existing = queue.Queue()
    monkeypatch.setattr(filesystem_async, "_results_queue", existing)
    _write_results_in_process()
    assert _megatrons_queue() is existing
