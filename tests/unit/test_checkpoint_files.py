"""The files of a checkpoint directory, in this process: read without running code from them
(thdpack.megatron.checkpoint_reader), checked against their manifest (checkpoint_manifest), and the directory's
lock, leftovers and choice of the checkpoint to resume from (checkpoint_dir). A small torch distributed checkpoint
(a tensor and a plain object, as thdpack's RNG states are saved) stands in for a run's; the resume and the export
of a real one are in tests/functional/test_checkpoint_safety.py."""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
import warnings

import pytest
import torch

from tests.tampering import poison_byte_object, poison_metadata, truncate
from thdpack.megatron.checkpoint_dir import (
    LOCK,
    TRACKER,
    DirInUse,
    DirLock,
    remove_partials,
    resume_point,
    unusable,
)
from thdpack.megatron.checkpoint_manifest import MANIFEST, checksums, my_files, verify, write_manifest
from thdpack.megatron.checkpoint_reader import (
    TE_UNSAFE_PICKLE_ENV,
    DamagedCheckpoint,
    UnsafeCheckpoint,
    check_byte_objects,
    check_extra_states,
    extra_states_loading,
    load_plain,
    read_dcp_metadata,
)


def save_checkpoint_like(path):
    """What thdpack's checkpoints hold, in small: a tensor, an RNG-like object of tensors and plain values, the
    megatron-core files beside them, a manifest."""
    import torch.distributed.checkpoint as dcp

    state = {"weight": torch.arange(6.0).reshape(2, 3), "rng_state": {"state": torch.arange(4), "pos": 3}}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
    torch.save({"thdpack": {"iteration": 1}}, path / "common.pt")
    (path / "metadata.json").write_text(
        json.dumps({"sharded_backend": "torch_dist", "common_backend": "torch"})
    )
    write_manifest(path, checksums(path, my_files(path, 0)), 1, {"host": "h", "pid": 1})
    return path


@pytest.fixture
def ckpt(tmp_path):
    return save_checkpoint_like(tmp_path / "iter_0000001")


class _Marker:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (eval, (f"__import__('pathlib').Path({self.path!r}).touch()",))


# --- no code from a checkpoint -----------------------------------------------------------------------------------


def test_torchs_checkpoint_metadata_reads_through_the_allow_list(ckpt):
    metadata = read_dcp_metadata(ckpt / ".metadata")
    assert list(metadata.state_dict_metadata["weight"].size) == [2, 3]


def test_a_metadata_pickle_that_runs_code_is_refused_naming_file_and_class_before_it_runs(ckpt, tmp_path):
    marker = tmp_path / "marker"
    poison_metadata(ckpt, marker)
    with pytest.raises(UnsafeCheckpoint, match=rf"{ckpt / '.metadata'} asks to load builtins\.eval: refused"):
        read_dcp_metadata(ckpt / ".metadata")
    assert not marker.exists()


def test_a_byte_object_that_runs_code_is_refused_naming_shard_entry_and_class(ckpt, tmp_path):
    marker = tmp_path / "marker"
    shard = poison_byte_object(ckpt, "rng_state", marker)
    with pytest.raises(
        UnsafeCheckpoint,
        match=r"(?s)" + rf"{ckpt / shard} \(entry 'rng_state[.]pos'\) asks to load builtins\.eval",
    ):
        check_byte_objects(ckpt, read_dcp_metadata(ckpt / ".metadata"))
    assert not marker.exists()


def test_plain_byte_objects_and_common_pt_load_as_tensors_and_plain_data(ckpt):
    check_byte_objects(ckpt, read_dcp_metadata(ckpt / ".metadata"))
    assert load_plain(ckpt / "common.pt") == {"thdpack": {"iteration": 1}}


def test_a_common_pt_with_an_object_is_refused_naming_its_class(tmp_path):
    marker = tmp_path / "marker"
    torch.save({"thdpack": _Marker(marker)}, tmp_path / "common.pt")
    with pytest.raises(UnsafeCheckpoint, match=r"common\.pt asks to load builtins\.eval: refused"):
        load_plain(tmp_path / "common.pt")
    assert not marker.exists()


def test_numpy_arrays_load_where_asked_and_nothing_else_with_them(tmp_path):
    import numpy as np

    torch.save([{"numpy": np.random.get_state()}], tmp_path / "rng")
    assert load_plain(tmp_path / "rng", numpy_arrays=True)[0]["numpy"][0] == "MT19937"
    with pytest.raises(UnsafeCheckpoint, match=r"numpy"):
        load_plain(tmp_path / "rng")


def test_a_truncated_metadata_file_is_damage_not_a_traceback(ckpt):
    truncate(ckpt / ".metadata")
    with pytest.raises(DamagedCheckpoint, match=r"\.metadata: cannot be read"):
        read_dcp_metadata(ckpt / ".metadata")


def test_transformer_engines_fp8_extra_state_is_read_through_an_allow_list(tmp_path):
    # TE keeps its FP8 state as pickle.dumps(dict) in a uint8 tensor, tensors pickled the plain way
    good = pickle.dumps({"scale_fwd": torch.ones(3), "extra_fp8_variables": {"num_gemms": 3}})
    check_extra_states({"layer._extra_state": torch.frombuffer(bytearray(good), dtype=torch.uint8)}, "ckpt")
    marker = tmp_path / "marker"
    bad = pickle.dumps({"recipe": _Marker(marker)})
    with pytest.raises(
        UnsafeCheckpoint, match=r"ckpt \(entry 'layer._extra_state'\) asks to load builtins\.eval"
    ):
        check_extra_states(
            {"layer._extra_state": torch.frombuffer(bytearray(bad), dtype=torch.uint8)}, "ckpt"
        )
    assert not marker.exists()


class _DelayedScaling:  # pickled under megatron-core's name for its FP8 recipe (TE is not importable here)
    pass


def _as_megatron_class(data: bytes, name: str) -> bytes:
    # protocol 2 names a class with the GLOBAL opcode: "c<module>\n<name>\n"
    here = f"c{__name__}\n_DelayedScaling\n".encode()
    assert here in data
    return data.replace(here, f"cmegatron.core.extensions.transformer_engine\n{name}\n".encode())


def test_megatrons_fp8_delayed_recipe_in_te_extra_state_is_read_as_plain_fields(tmp_path):
    # an FP8 delayed-scaling run pickles megatron-core's TEDelayedScaling (a dataclass of TE's DelayedScaling) as
    # the recipe of every TE layer's extra state: its resume was refused before (seen on an H200, 2026-12-01)
    recipe = _DelayedScaling()
    recipe.__dict__.update(margin=0, amax_history_len=1024, amax_compute_algo="max", fp8_dpa=False)
    data = pickle.dumps({"recipe": recipe, "extra_fp8_variables": {"num_gemms": 1}}, protocol=2)
    state = _as_megatron_class(data, "TEDelayedScaling")
    check_extra_states({"layer._extra_state": torch.frombuffer(bytearray(state), dtype=torch.uint8)}, "ckpt")
    other = _as_megatron_class(data, "TELinear")  # any other class of that module stays refused
    with pytest.raises(
        UnsafeCheckpoint, match=r"asks to load megatron\.core\.extensions\.transformer_engine\.TELinear"
    ):
        check_extra_states(
            {"layer._extra_state": torch.frombuffer(bytearray(other), dtype=torch.uint8)}, "ckpt"
        )


class _ExtraStateModule(torch.nn.Module):
    """Where TE's set_extra_state would unpickle: records whether TE's opt-in was on and what it was handed."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def get_extra_state(self):
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state):
        self.seen.append((os.environ.get(TE_UNSAFE_PICKLE_ENV), bytes(state.numpy())))


def test_te_unpickles_an_extra_state_only_after_the_allow_list_and_only_while_it_loads(monkeypatch, tmp_path):
    # TE 2.20 refuses a delayed-scaling pickle unless NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1 (an FP8 run's resume
    # stopped there on an H200, 2026-12-01): thdpack opens it for the load of states it has checked, and no longer
    monkeypatch.delenv(TE_UNSAFE_PICKLE_ENV, raising=False)
    good = pickle.dumps({"scale_fwd": torch.ones(2), "extra_fp8_variables": {"num_gemms": 1}})
    module = _ExtraStateModule()
    state = {"_extra_state": torch.frombuffer(bytearray(good), dtype=torch.uint8)}
    with extra_states_loading(state, "ckpt"):
        module.load_state_dict(state)
    assert module.seen == [("1", good)]
    assert TE_UNSAFE_PICKLE_ENV not in os.environ
    marker = tmp_path / "marker"
    bad = {
        "_extra_state": torch.frombuffer(
            bytearray(pickle.dumps({"recipe": _Marker(marker)})), dtype=torch.uint8
        )
    }
    with pytest.raises(UnsafeCheckpoint, match="builtins.eval"), extra_states_loading(bad, "ckpt"):
        module.load_state_dict(bad)
    assert len(module.seen) == 1 and TE_UNSAFE_PICKLE_ENV not in os.environ and not marker.exists()
    monkeypatch.setenv(TE_UNSAFE_PICKLE_ENV, "0")  # a user's own setting comes back after the load
    with extra_states_loading(state, "ckpt"):
        module.load_state_dict(state)
    assert module.seen[-1][0] == "1" and os.environ[TE_UNSAFE_PICKLE_ENV] == "0"


# --- the manifest ------------------------------------------------------------------------------------------------


def test_a_complete_checkpoint_passes_its_manifest(ckpt):
    assert verify(ckpt) is None


def test_a_truncated_file_is_named_with_both_sizes(ckpt):
    shard = next(ckpt.glob("*.distcp"))
    size = shard.stat().st_size
    truncate(shard)
    assert (
        str(verify(ckpt)) == f"{shard}: {size // 2} bytes, manifest.json says {size} (truncated or replaced)"
    )


def test_a_changed_byte_is_named_by_its_checksum(ckpt):
    shard = next(ckpt.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    assert "CRC-32" in str(verify(ckpt)) and str(verify(ckpt)).startswith(str(shard))


def test_a_missing_file_is_named(ckpt):
    (ckpt / ".metadata").unlink()
    assert str(verify(ckpt)) == f"{ckpt / '.metadata'}: missing (listed in manifest.json)"


def test_without_a_manifest_the_files_every_checkpoint_has_are_looked_for(ckpt):
    (ckpt / MANIFEST).unlink()
    assert verify(ckpt) is None
    (ckpt / "common.pt").unlink()
    assert str(verify(ckpt)) == f"{ckpt / 'common.pt'}: missing (and the checkpoint has no manifest.json)"


def test_each_rank_sums_the_shards_it_wrote_and_rank_0_the_rest(tmp_path):
    for name in ("__0_0.distcp", "__1_0.distcp", "__1_1.distcp", ".metadata", "common.pt", MANIFEST):
        (tmp_path / name).write_text(name)
    assert sorted(my_files(tmp_path, 0, 2)) == [".metadata", "__0_0.distcp", "common.pt"]
    assert sorted(my_files(tmp_path, 1, 2)) == ["__1_0.distcp", "__1_1.distcp"]


# --- the directory: which checkpoint to resume from ---------------------------------------------------------------


@pytest.fixture
def two_saves(tmp_path):
    for i in (1, 2):
        save_checkpoint_like(tmp_path / f"iter_{i:07d}")
    (tmp_path / TRACKER).write_text("2\n")
    return tmp_path


def test_the_tracked_checkpoint_is_resumed_from(two_saves):
    point = resume_point(two_saves)
    assert (point.iteration, point.passed_over) == (2, [])


def test_a_damaged_latest_checkpoint_is_passed_over_for_the_newest_complete_one(two_saves):
    truncate(next((two_saves / "iter_0000002").glob("*.distcp")))
    point = resume_point(two_saves)
    assert point.iteration == 1
    assert point.passed_over[0].startswith("iter_0000002 is damaged: ")


def test_a_tracker_naming_a_missing_iteration_falls_back_to_the_newest_complete_one(two_saves):
    (two_saves / TRACKER).write_text("7\n")
    point = resume_point(two_saves)
    assert point.iteration == 2
    assert point.passed_over == [f"{two_saves / TRACKER} names iteration 7, whose directory is missing"]


def test_a_directory_of_damaged_checkpoints_only_is_refused(two_saves):
    for i in (1, 2):
        (two_saves / f"iter_{i:07d}" / ".metadata").unlink()
    with pytest.raises(
        ValueError, match=r"holds no complete checkpoint \(iter_0000002 is damaged: .*; iter_0000001"
    ):
        resume_point(two_saves)


def test_partial_saves_are_removed(tmp_path):
    (tmp_path / "iter_0000003.partial").mkdir()
    (tmp_path / "iter_0000003.partial" / "__0_0.distcp").write_text("x")
    assert remove_partials(tmp_path) == [tmp_path / "iter_0000003.partial"]
    assert not (tmp_path / "iter_0000003.partial").exists()


# --- the directory: writable, one writer --------------------------------------------------------------------------


def test_a_checkpoint_dir_under_a_regular_file_is_unusable(tmp_path):
    (tmp_path / "file").write_text("")
    assert unusable(tmp_path / "file" / "ckpt") == f"{tmp_path / 'file'} is a file, not a directory"


def test_a_missing_checkpoint_dir_is_made(tmp_path):
    assert unusable(tmp_path / "a" / "b") is None
    assert (tmp_path / "a" / "b").is_dir()


def test_a_second_claim_is_refused_naming_host_and_pid(tmp_path):
    first = DirLock.claim(tmp_path, "outputs/run1")
    with pytest.raises(
        DirInUse, match=rf"in use by pid {os.getpid()} on host {socket.gethostname()} since .*run1"
    ):
        DirLock.claim(tmp_path)
    first.release()
    assert not (tmp_path / LOCK).exists()


def test_the_lock_of_an_ended_process_is_taken_over_and_said_so(tmp_path):
    ended = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    pid = int(ended.stdout)
    (tmp_path / LOCK).write_text(json.dumps({"host": socket.gethostname(), "pid": pid, "job": None}))
    lock = DirLock.claim(tmp_path)
    assert lock.took_over == f"pid {pid} on {socket.gethostname()} has ended"
    assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()
    lock.release()


def test_the_lock_of_an_earlier_attempt_of_the_same_slurm_job_is_taken_over(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    (tmp_path / LOCK).write_text(json.dumps({"host": "node7", "pid": 1, "job": "4242"}))
    assert "earlier attempt of SLURM job 4242" in DirLock.claim(tmp_path).took_over


def test_a_lock_held_on_another_host_is_not_taken_over(tmp_path):
    (tmp_path / LOCK).write_text(json.dumps({"host": "elsewhere", "pid": 1, "job": None}))
    with pytest.raises(
        DirInUse, match=rf"pid 1 on host elsewhere.*if that run is gone, delete {tmp_path / LOCK}"
    ):
        DirLock.claim(tmp_path)
