"""thdpack: padding-free (THD) sequence packing for Megatron-core.

The packer is pure PyTorch on host metadata: :func:`find_segments` reads the real samples of a padded batch,
:func:`pack_bshd` turns it into one THD row (:class:`PackedBatch`), :func:`unpack_thd` scatters results back,
:func:`cp_partition_indices` is TE's context-parallel partition.

Layers, each a folder that imports only the layers below it: :mod:`thdpack.packing` (the packer, no Megatron
import), :mod:`thdpack.data` (datasets, collator, loader), :mod:`thdpack.megatron` (the Megatron-core
integration: batch, step, loss, models, attention, checkpoints, CPU mode; Megatron-core and Transformer Engine
are imported there only, lazily), :mod:`thdpack.hf` (Hugging Face files: checkpoints, the tensor
mapping engine, tokenizers, processors), :mod:`thdpack.models` (the model families) and :mod:`thdpack.training` (the
training product). ``python -m thdpack.train``, ``python -m thdpack.compare`` and
``python -m thdpack.export`` are the command lines.
"""

from .packing import (
    Alignment,
    PackedBatch,
    PackLayout,
    Segments,
    cp_partition_indices,
    cp_unshard,
    find_segments,
    from_packed_batch,
    pack_bshd,
    plan_layout,
    unpack_thd,
)

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
