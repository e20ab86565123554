"""The packer: padded BSHD batches in, one THD row and its metadata out (pure PyTorch, no Megatron import).

:func:`find_segments` reads the real samples of a padded batch, :func:`plan_layout` aligns them
(:class:`Alignment`), :func:`pack_bshd` builds the :class:`PackedBatch` and :func:`unpack_thd` scatters results
back; :func:`from_packed_batch` adopts batches that Megatron-Bridge or NeMo packed already;
:func:`cp_partition_indices` is TE's context-parallel partition.
"""

from .adopt import from_packed_batch
from .context_parallel import cp_partition_indices, cp_unshard
from .layout import Alignment, PackLayout, plan_layout
from .pack import pack_bshd, unpack_thd
from .packed_batch import PackedBatch
from .segments import Segments, find_segments

__all__ = [
    "Alignment",
    "PackLayout",
    "PackedBatch",
    "Segments",
    "cp_partition_indices",
    "cp_unshard",
    "find_segments",
    "from_packed_batch",
    "pack_bshd",
    "plan_layout",
    "unpack_thd",
]
