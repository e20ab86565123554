"""Reading a checkpoint directory without running code from it: people share checkpoints, and a pickle can call
any function while it loads.

What a Megatron ``torch_dist`` checkpoint holds and how each part is read here:

- ``.metadata``: torch's distributed-checkpoint ``Metadata``, a pickle. Read by :class:`_MetadataUnpickler`, which
  resolves only :data:`METADATA_CLASSES` (torch's checkpoint metadata dataclasses, ``torch.Size``, dtypes);
- ``__<rank>_<i>.distcp``: tensors at offsets, plus small objects (thdpack's RNG states, Transformer Engine's
  ``_extra_state``) that torch saves with ``torch.save``: read with ``weights_only=True`` (tensors and plain
  containers; numpy arrays, which RNG states held before thdpack saved them as tensors), after
  ``torch.serialization.get_unsafe_globals_in_checkpoint`` has found nothing else;
- ``common.pt`` (optimizer param groups, the schedule, thdpack's own state): the same;
- ``metadata.json``: JSON, and it must name the ``torch_dist`` format (it picks megatron-core's reader).

A file that asks for anything else is refused with :class:`UnsafeCheckpoint`, naming the file and the class;
one that cannot be parsed with :class:`DamagedCheckpoint`. Megatron-core's own loader reads through these by
:class:`SafeTorchDistLoad` (passed as its ``sharded_strategy``) and :class:`SafeCommonLoad`; the export reads
through :class:`SafeFileSystemReader` and :func:`check_byte_objects`.

Transformer Engine keeps an FP8 layer's scaling state as a pickle inside a uint8 tensor (``_extra_state``) and
``pickle.loads`` it when the layer loads: :func:`check_extra_states` reads each one through the same kind of
allow-list first (TE's recipe classes, tensors), so that what TE then unpickles is known to be data.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import pickle
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import StorageMeta

__all__ = [
    "CheckpointFileError",
    "DamagedCheckpoint",
    "METADATA_CLASSES",
    "SafeCommonLoad",
    "SafeFileSystemReader",
    "SafeTorchDistLoad",
    "UnsafeCheckpoint",
    "check_byte_objects",
    "check_extra_states",
    "check_format",
    "load_plain",
    "read_common",
    "read_dcp_metadata",
]

COMMON = "common.pt"
FORMAT = "metadata.json"
DCP_METADATA = ".metadata"

# Every class torch's distributed checkpoint puts in .metadata (torch 2.13: metadata.py, planner.py, filesystem.py),
# found by recording what a megatron-core 0.16 save holds.
METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a layout by its name
    "torch": {"Size"},  # and the dtypes (torch.float32, ...), allowed by kind
    "collections": {"OrderedDict"},
    "pathlib": {"PosixPath", "PurePosixPath"},  # StorageMeta.checkpoint_id of torch's own FileSystemWriter
}
# Transformer Engine's FP8 extra state (transformer_engine/pytorch/module/base.py get_extra_state): the recipe
# (dataclasses and enums of this module), tensors pickled the plain way, plain values.
TE_RECIPE_MODULE = "transformer_engine.common.recipe"
# megatron-core's own recipe, a dataclass subclass of TE's DelayedScaling with no fields of its own: the recipe an
# FP8 delayed-scaling run pickles. Read as plain attributes (its constructor takes a model config, never called).
_MEGATRON_RECIPES = {("megatron.core.extensions.transformer_engine", "TEDelayedScaling")}


class _RecipeFields:
    """What the check rebuilds a megatron-core recipe as: its pickled fields as attributes, no code of its own."""


_TENSOR_REBUILD = {
    "torch._utils": {"_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter"},
    "torch": {"Size", "device"},
    "collections": {"OrderedDict"},
}


class CheckpointFileError(ValueError):
    """A checkpoint file that cannot be used; ``path`` names it."""

    def __init__(self, path: str | os.PathLike, message: str):
        super().__init__(message)
        self.path = str(path)


class UnsafeCheckpoint(CheckpointFileError):
    """A checkpoint file that asks to load something other than tensors and plain data (``name``)."""

    def __init__(self, path: str | os.PathLike, name: str):
        super().__init__(
            path,
            f"{path} asks to load {name}: refused (thdpack reads only tensors and plain data from a checkpoint, "
            "never code; was this checkpoint written by thdpack?)",
        )
        self.name = name

    def __reduce__(self):  # torch's checkpoint gathers a rank's error to every rank as a pickle
        return type(self), (self.path, self.name)


class DamagedCheckpoint(CheckpointFileError):
    def __init__(self, path: str | os.PathLike, reason: str):
        super().__init__(path, f"{path}: {reason}")
        self.reason = reason

    def __reduce__(self):
        return type(self), (self.path, self.reason)


def _file_error_in(error: BaseException) -> CheckpointFileError | None:
    """The :class:`CheckpointFileError` torch's ``CheckpointException`` carries for some rank, if any."""
    for failure in (getattr(error, "failures", None) or {}).values():
        failure = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(failure, CheckpointFileError):
            return failure
    return None


def _is_dtype(module: str, name: str) -> bool:
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


class _AllowListUnpickler(pickle.Unpickler):
    """Resolves only the names of ``allowed`` (``{module: {name}}``) and torch dtypes; anything else is refused
    before it is imported. ``replace`` maps a name to a stand-in callable."""

    def __init__(self, file, path, allowed: Mapping[str, set[str]], replace: Mapping | None = None):
        super().__init__(file)
        self.path, self.allowed, self.replace = path, allowed, replace or {}

    def find_class(self, module: str, name: str):
        if (module, name) in self.replace:
            return self.replace[module, name]
        if name in self.allowed.get(module, ()) or _is_dtype(module, name):
            return super().find_class(module, name)
        raise UnsafeCheckpoint(self.path, f"{module}.{name}")

    def persistent_load(self, pid):
        raise UnsafeCheckpoint(self.path, f"a persistent object ({str(pid)[:40]})")


class _MetadataUnpickler(_AllowListUnpickler):
    def __init__(self, file, path):
        super().__init__(file, path, METADATA_CLASSES)


def read_dcp_metadata(path: str | os.PathLike):
    """torch's distributed-checkpoint ``Metadata`` from a ``.metadata`` file, reading nothing but
    :data:`METADATA_CLASSES`."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(path)
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f, path).load()
    except FileNotFoundError:
        raise DamagedCheckpoint(path, "missing (the checkpoint's index of tensors)") from None
    except CheckpointFileError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError) as error:
        raise DamagedCheckpoint(path, f"cannot be read ({type(error).__name__}: {error})") from None
    if not isinstance(metadata, Metadata):
        raise DamagedCheckpoint(path, f"holds a {type(metadata).__name__}, not torch's checkpoint Metadata")
    return metadata


def _numpy_arrays() -> dict[str, Any]:
    """numpy's array rebuild, by the names a pickle gives (data only: a dtype, a shape, bytes). thdpack's RNG states
    held numpy arrays before they were saved as tensors: a checkpoint of then still resumes."""
    import numpy as np

    found = {"numpy.ndarray": np.ndarray, "numpy.dtype": np.dtype}
    dtypes = getattr(np, "dtypes", None)  # numpy >= 1.25: one class a dtype (UInt32DType, ...)
    found |= {f"numpy.dtypes.{n}": v for n, v in vars(dtypes or object).items() if isinstance(v, type)}
    for module in ("numpy._core.multiarray", "numpy.core.multiarray"):
        with contextlib.suppress(ImportError, AttributeError), warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # numpy 2 renamed numpy.core
            found[f"{module}._reconstruct"] = importlib.import_module(module)._reconstruct
    return found


def load_plain(
    source: str | os.PathLike | io.BytesIO, where: str | os.PathLike | None = None, numpy_arrays: bool = False
) -> Any:
    """What ``torch.save`` wrote to ``source`` (a path or bytes), if it is tensors and plain containers only
    (``numpy_arrays``: numpy arrays too); ``where`` names it in errors (the file, and the entry in it)."""
    where = str(where if where is not None else source)
    arrays = _numpy_arrays() if numpy_arrays else {}
    try:
        # An independent scan first: torch.load's weights_only can be turned off from the environment only for
        # calls that leave it unset, but the scan names the class.
        try:
            unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(source)
        except ValueError:  # torch's legacy format (a storage pickled the plain way): weights_only names it
            unsafe = []
        unsafe = [name for name in unsafe if name not in arrays]
        if unsafe:
            raise UnsafeCheckpoint(where, ", ".join(unsafe))
        if isinstance(source, io.IOBase):
            source.seek(0)
        with torch.serialization.safe_globals(list(arrays.values())):
            return torch.load(source, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise DamagedCheckpoint(where, "missing") from None
    except CheckpointFileError:
        raise
    except pickle.UnpicklingError as error:
        raise UnsafeCheckpoint(where, _refused_name(str(error))) from None
    except (RuntimeError, EOFError, ValueError, OSError) as error:
        raise DamagedCheckpoint(where, f"cannot be read ({type(error).__name__}: {error})") from None


def _refused_name(message: str) -> str:
    """What torch's weights_only unpickler refused, from its message."""
    found = re.search(r"GLOBAL (\S+)", message) or re.search(r"but got <class '([^']+)'>", message)
    return found.group(1) if found else "an object weights_only=True refuses"


def read_common(directory: str | os.PathLike) -> dict:
    """``common.pt`` of the checkpoint in ``directory``, tensors and plain data only."""
    return load_plain(Path(directory) / COMMON)


def check_format(directory: str | os.PathLike) -> None:
    """``metadata.json`` must name megatron-core's ``torch_dist`` format (and torch's ``common.pt``): it chooses
    megatron-core's reader."""
    path = Path(directory) / FORMAT
    try:
        saved = json.loads(path.read_text())
    except FileNotFoundError:
        raise DamagedCheckpoint(
            path, f"missing: {directory} is not a Megatron distributed checkpoint"
        ) from None
    except (ValueError, UnicodeDecodeError) as error:
        raise DamagedCheckpoint(path, f"not JSON ({error})") from None
    saved = saved if isinstance(saved, dict) else {}
    if saved.get("sharded_backend") != "torch_dist" or saved.get("common_backend", "torch") != "torch":
        raise DamagedCheckpoint(
            path,
            f"sharded_backend is {saved.get('sharded_backend')!r}, common_backend {saved.get('common_backend')!r}; "
            "only Megatron's 'torch_dist' format (torch DCP) with 'torch' is read",
        )


class SafeFileSystemReader(FileSystemReader):
    """torch's ``FileSystemReader`` whose ``read_metadata`` goes through :func:`read_dcp_metadata` (read once per
    reader, as megatron-core's cached reader does)."""

    def __init__(self, path: str | os.PathLike):
        super().__init__(path)
        self._metadata = None

    def read_metadata(self, *args, **kwargs):
        if kwargs.get("rank") is not None:
            raise DamagedCheckpoint(self.path, "per-rank metadata files are not a format thdpack writes")
        if self._metadata is None:
            metadata = read_dcp_metadata(Path(self.path) / DCP_METADATA)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            self._metadata = metadata
        return self._metadata


def _where(directory, metadata, read_item) -> str:
    info = (getattr(metadata, "storage_data", None) or {}).get(read_item.storage_index)
    file = Path(directory) / info.relative_path if info is not None else Path(directory)
    return f"{file} (entry '{read_item.dest_index.fqn}')"


def _plain_bytes_planner(base, directory):
    """``base`` (a DCP load planner) reading its byte objects with :func:`load_plain`."""
    from torch.distributed.checkpoint._traverse import set_element

    class Planner(base):
        def load_bytes(self, read_item, value):
            loaded = load_plain(value, _where(directory, self.metadata, read_item), numpy_arrays=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    Planner.__name__ = f"Plain{base.__name__}"
    return Planner


@contextlib.contextmanager
def _megatron_reads_safely(directory):
    """megatron-core 0.16's torch_dist loader (dist_checkpointing/strategies/torch.py) builds its reader with
    ``_get_filesystem_reader`` and its planner from the module's ``MCoreLoadPlanner`` (whose ``load_bytes`` is
    DCP's: ``torch.load(weights_only=False)``): both replaced while one load runs."""
    from megatron.core.dist_checkpointing.strategies import torch as strategy

    missing = [n for n in ("_get_filesystem_reader", "MCoreLoadPlanner") if not hasattr(strategy, n)]
    if missing:
        raise RuntimeError(
            f"megatron-core's {strategy.__name__} has no {missing}: thdpack's safe checkpoint reading "
            "(thdpack/megatron/checkpoint_reader.py) must follow it before any checkpoint is loaded"
        )
    saved = strategy._get_filesystem_reader, strategy.MCoreLoadPlanner
    strategy._get_filesystem_reader = lambda checkpoint_dir, cache_metadata=False: SafeFileSystemReader(
        checkpoint_dir
    )
    strategy.MCoreLoadPlanner = _plain_bytes_planner(saved[1], directory)
    try:
        yield
    finally:
        strategy._get_filesystem_reader, strategy.MCoreLoadPlanner = saved


def SafeTorchDistLoad():  # noqa: N802 (an instance of a class built on first use)
    """megatron-core's torch_dist load strategy, reading every file through this module."""
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    class Strategy(TorchDistLoadShardedStrategy):
        def load(self, sharded_state_dict, checkpoint_dir):
            from torch.distributed.checkpoint.api import CheckpointException

            with _megatron_reads_safely(checkpoint_dir):
                try:
                    return super().load(sharded_state_dict, checkpoint_dir)
                except CheckpointException as error:
                    raise (_file_error_in(error) or error) from None

        def load_tensors_metadata(self, checkpoint_dir, metadata=None):
            with _megatron_reads_safely(checkpoint_dir):
                return super().load_tensors_metadata(checkpoint_dir, metadata)

        def load_sharded_metadata(self, checkpoint_dir):
            with _megatron_reads_safely(checkpoint_dir):
                return super().load_sharded_metadata(checkpoint_dir)

    return Strategy()


def SafeCommonLoad():  # noqa: N802 (an instance of a class built on first use)
    """megatron-core's common (``common.pt``) load strategy, through :func:`read_common`."""
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    class Strategy(TorchCommonLoadStrategy):
        def load_common(self, checkpoint_dir):
            return read_common(checkpoint_dir)

        def load_sharded_objects(self, sharded_objects_state_dict, checkpoint_dir):
            raise DamagedCheckpoint(checkpoint_dir, "objects outside the torch_dist files are not read")

    return Strategy()


def check_byte_objects(directory: str | os.PathLike, metadata) -> None:
    """Read every byte object of the checkpoint (``BytesStorageMetadata`` entries: RNG states, TE extra state)
    with :func:`load_plain`: a checkpoint that holds anything else is refused as a whole, also where the reader
    would not need that entry (an export)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    directory = Path(directory)
    for index, info in (metadata.storage_data or {}).items():
        if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        file = directory / info.relative_path
        try:
            with open(file, "rb") as f:
                f.seek(info.offset)
                data = f.read(info.length)
        except OSError as error:
            raise DamagedCheckpoint(file, f"cannot be read ({error})") from None
        if len(data) != info.length:
            raise DamagedCheckpoint(file, f"ends before entry '{index.fqn}' (truncated)")
        load_plain(io.BytesIO(data), f"{file} (entry '{index.fqn}')", numpy_arrays=True)


def check_extra_states(state: Mapping[str, Any], where: str | os.PathLike) -> None:
    """Every Transformer Engine ``_extra_state`` of a loaded model state (``{name: value}``), read through an
    allow-list (TE's recipe classes, tensors, plain values) before TE's ``set_extra_state`` unpickles it."""
    for name, value in state.items():
        if not name.endswith("_extra_state"):
            continue
        here = f"{where} (entry '{name}')"
        if isinstance(value, io.BytesIO):
            load_plain(value, here)
            value.seek(0)
        elif torch.is_tensor(value) and value.numel() and value.dtype == torch.uint8:
            _check_te_pickle(value.detach().cpu().numpy().tobytes(), here)


# Transformer Engine 2.20 refuses to unpickle an FP8 delayed-scaling extra state unless this is "1"
# (transformer_engine/pytorch/_extra_state.py): its only stateful recipe still checkpoints as a pickle
TE_UNSAFE_PICKLE_ENV = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"


@contextlib.contextmanager
def extra_states_loading(state: Mapping[str, Any], where: str | os.PathLike):
    """Loads ``state``'s Transformer Engine extra states within the block: each is first read through the
    allow-list (:func:`check_extra_states`), then TE is let to unpickle them (:data:`TE_UNSAFE_PICKLE_ENV`) for
    the block alone, the variable restored after it."""
    check_extra_states(state, where)
    before = os.environ.get(TE_UNSAFE_PICKLE_ENV)
    os.environ[TE_UNSAFE_PICKLE_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(TE_UNSAFE_PICKLE_ENV, None)
        else:
            os.environ[TE_UNSAFE_PICKLE_ENV] = before


def _check_te_pickle(data: bytes, where: str) -> None:
    try:
        recipe = importlib.import_module(TE_RECIPE_MODULE)
        recipe_classes = {n for n, v in vars(recipe).items() if isinstance(v, type)}
    except ImportError:
        recipe_classes = set()
    allowed = {**_TENSOR_REBUILD, TE_RECIPE_MODULE: recipe_classes}
    # a tensor pickled the plain way carries its storage as torch.save bytes
    replace = {("torch.storage", "_load_from_bytes"): lambda b: load_plain(io.BytesIO(b), where)}
    replace.update(dict.fromkeys(_MEGATRON_RECIPES, _RecipeFields))
    try:
        _AllowListUnpickler(io.BytesIO(data), where, allowed, replace).load()
    except CheckpointFileError:
        raise
    except Exception as error:  # noqa: BLE001 - any failure of a data-only rebuild means damage
        raise DamagedCheckpoint(where, f"cannot be read ({type(error).__name__}: {error})") from None
