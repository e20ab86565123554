"""The parallel layout a checkpoint was saved on, and what may change between the save and a resume.

    saved = ParallelLayout.from_dict(metadata["layout"])
    check_resumable(saved, ParallelLayout.current(), "fully_reshardable", "ckpt/iter_0000042")   # or raises

Megatron's distributed checkpoints hold the model as global tensors (each rank writes its TP/PP/EP slice of
them), so the model reloads on any layout. The distributed optimizer's state reloads on any layout only in the
``fully_reshardable`` format (gathered into the model's shapes at save); ``dp_reshardable`` keeps each rank's
flat buffer and reloads only where the model is cut the same way (same TP, PP, CP and EP; the data-parallel size
may change). A mixture of experts keeps ep either 1 or above 1 (its optimizer's structure depends on it).
Per-rank random streams never carry over to another layout: they are re-seeded.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields

__all__ = ["OPTIMIZER_FORMATS", "ParallelLayout", "check_resumable"]

# megatron-core's names (DistributedOptimizer.sharded_state_dict, metadata["distrib_optim_sharding_type"])
OPTIMIZER_FORMATS = ("fully_reshardable", "dp_reshardable")
# What dp_reshardable's flat per-rank buffers depend on: the model's cut, not the data-parallel size.
_MODEL_CUT = ("tp", "pp", "cp", "ep")


@dataclass(frozen=True)
class ParallelLayout:
    """Process counts of one run: ``world = dp x tp x pp x cp``; ``ep`` splits the experts inside ``dp x cp``."""

    world: int
    dp: int
    tp: int
    pp: int
    cp: int
    ep: int

    @classmethod
    def current(cls) -> ParallelLayout:
        """This run's layout, from Megatron's process groups (initialised)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        return cls(
            world=dist.get_world_size(),
            dp=ps.get_data_parallel_world_size(),
            tp=ps.get_tensor_model_parallel_world_size(),
            pp=ps.get_pipeline_model_parallel_world_size(),
            cp=ps.get_context_parallel_world_size(),
            ep=ps.get_expert_model_parallel_world_size(),
        )

    @classmethod
    def from_dict(cls, saved: Mapping[str, int] | None) -> ParallelLayout | None:
        """The layout stored by :meth:`as_dict`; None for a checkpoint that stored none."""
        if saved is None:
            return None
        names = [f.name for f in fields(cls)]
        missing = sorted(set(names) - set(saved))
        if missing:
            raise ValueError(f"the checkpoint's layout {dict(saved)} lacks {missing}")
        return cls(**{name: int(saved[name]) for name in names})

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def __str__(self) -> str:  # the start-up log's words
        return (
            f"world {self.world} = dp {self.dp} x tp {self.tp} x pp {self.pp} x cp {self.cp} (ep {self.ep})"
        )


def check_resumable(
    saved: ParallelLayout | None,
    current: ParallelLayout,
    optimizer_format: str,
    where: str,
    has_experts: bool = False,
) -> None:
    """Raise ``ValueError`` naming both layouts when the checkpoint at ``where``, saved on ``saved`` with the
    distributed optimizer's ``optimizer_format``, cannot be loaded on ``current`` (``has_experts``: the model is a
    mixture of experts). ``saved`` is None for a checkpoint that did not record its layout: it loads only where it
    was saved, which dist_checkpointing checks itself."""
    if optimizer_format not in OPTIMIZER_FORMATS:
        raise ValueError(
            f"{where}: the optimizer state is in format '{optimizer_format}': thdpack reads {list(OPTIMIZER_FORMATS)}"
        )
    if saved is None or saved == current:
        return
    if has_experts and (saved.ep == 1) != (current.ep == 1):
        raise ValueError(
            f"{where} was saved on {saved}; this run is {current}. megatron-core keeps the expert parameters in "
            "the dense parameters' optimizer when ep is 1 and in an optimizer of their own when ep > 1, and its "
            f"checkpoints cannot move optimizer state from one to the other: resume with ep "
            f"{'1' if saved.ep == 1 else '> 1'} (parallel.expert_model_parallel_size)"
        )
    if optimizer_format == "fully_reshardable":
        return
    changed = [name for name in _MODEL_CUT if getattr(saved, name) != getattr(current, name)]
    if changed:
        raise ValueError(
            f"{where} was saved on {saved} with checkpoint.optimizer_format=dp_reshardable, whose optimizer "
            f"state reloads only where {', '.join(_MODEL_CUT)} are the same; this run is {current} "
            f"({', '.join(changed)} changed). Resume on the saved layout, or resume there once with "
            "checkpoint.optimizer_format=fully_reshardable and stop after the next save "
            "(trainer.exit_interval): that checkpoint loads on any layout"
        )
