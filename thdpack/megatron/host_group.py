"""One gloo process group over the world for small host values (a stop flag, checksums, a verdict): the world group
itself on CPU, a gloo group beside it when the world is NCCL, so that exchanging host values never touches a
device stream (no host-device sync)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["all_gather_host", "broadcast_host", "host_group"]

_made: tuple = (None, None)  # (the world group it was made for, the gloo group)


def host_group():
    """The world's gloo group (beside NCCL: made on the first call, a collective: every rank calls it at the same
    point of the run)."""
    global _made
    world = dist.group.WORLD
    if dist.get_backend() == "gloo":
        return world
    if _made[0] is not world:
        _made = (world, dist.new_group(backend="gloo"))
    return _made[1]


def all_gather_host(value: Any) -> list[Any]:
    """Every rank's ``value`` (picklable, small), in rank order; ``[value]`` without a process group."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value, group=host_group())
    return out


def broadcast_host(value: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``value`` on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=src, group=host_group())
    return box[0]
