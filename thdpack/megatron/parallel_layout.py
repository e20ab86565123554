"""The parallel layout a checkpoint was saved on, and what may change between the save and a resume.

    saved = ParallelLayout.from_dict(metadata["layout"])
    check_resumable(saved, ParallelLayout.current(), "fully_reshardable", "ckpt/iter_0000042")   # or raises

Megatron's distributed checkpoints hold the model as global tensors (each rank writes its TP/PP/EP slice of
them), so the model reloads on any layout. The distributed optimizer's state reloads on any layout only in the
``fully_reshardable`` format (gathered into the model's shapes at save); ``dp_reshardable`` keeps each rank's
flat buffer and reloads only where the model is cut the same way (same TP, PP, CP and EP; the data-parallel size
may change). A mixture of experts keeps ep either 1 or above 1 (its optimizer's structure depends on it).
Per-rank random streams never carry over to another layout: they are re-seeded.

:func:`first_stage_layers`: how many decoder layers the first pipeline stage holds, by Megatron's split rule.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields

__all__ = ["OPTIMIZER_FORMATS", "ParallelLayout", "check_resumable", "first_stage_layers"]

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


# Megatron's other ways to split the layers over pipeline stages: it validates them itself.
_OTHER_SPLITS = (
    "pipeline_model_parallel_layout",
    "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
)


def first_stage_layers(config: Mapping, pp: int) -> int | None:
    """How many decoder layers the first of ``pp`` pipeline stages holds under ``config`` (the recipe's
    ``model.config``): ``num_layers_in_first_pipeline_stage`` if set, else an even share of what
    ``num_layers_in_last_pipeline_stage`` leaves (Megatron checks that split), else ``num_layers / pp``. None where
    a layout or an ``account_for_*`` split decides (Megatron checks those). Raises ``ValueError`` naming the keys
    when ``num_layers`` does not divide evenly over ``pp`` stages and no uneven split is given (Megatron's own
    assertion, transformer_block.py, names no key a recipe can set)."""
    if pp <= 1:
        return int(config["num_layers"])
    if any(config.get(key) for key in _OTHER_SPLITS):
        return None
    layers = int(config["num_layers"])
    first, last = (
        config.get("num_layers_in_first_pipeline_stage"),
        config.get("num_layers_in_last_pipeline_stage"),
    )
    if first is not None:
        return int(first)
    if last is not None:
        return (layers - int(last)) // (pp - 1)
    if layers % pp:
        raise ValueError(
            f"model.config.num_layers ({layers}) does not divide over parallel.pipeline_model_parallel_size={pp} "
            "stages: set model.config.num_layers_in_first_pipeline_stage (and/or "
            "num_layers_in_last_pipeline_stage) so that the other stages share the rest evenly, or change the "
            "pipeline size"
        )
    return layers // pp
