"""thdpack: padding-free (THD) sequence packing for Megatron-core.

The core is pure PyTorch on host metadata: :func:`find_segments` reads the real samples of a padded batch,
:func:`pack_bshd` turns it into one THD row (:class:`PackedBatch`), :func:`unpack_thd` scatters results back,
:func:`cp_partition_indices` is TE's context-parallel partition. Megatron-core and Transformer Engine are used
only by :mod:`thdpack.megatron` and :mod:`thdpack.attention`, imported lazily.
"""

from .context_parallel import cp_partition_indices, cp_unshard
from .layout import Alignment, PackLayout, plan_layout
from .pack import pack_bshd, unpack_thd
from .packed_batch import PackedBatch
from .packed_input import from_packed_batch
from .segments import Segments, find_segments

__version__ = "0.1.0"

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
