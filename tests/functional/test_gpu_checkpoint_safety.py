"""GPU: checkpoints written with Transformer Engine read through thdpack's allow-lists. TE keeps an FP8 layer's
scaling state as a pickle inside a uint8 ``_extra_state`` tensor (and unpickles it when the layer loads):
thdpack.megatron.checkpoint_reader.check_extra_states reads each one first, allowing TE's recipe classes and
tensors only. An FP8 run stops after step 2 with a checkpoint; its extra states hold FP8 state and pass the
allow-list; the same command resumes from it. A bf16 run's ``.metadata`` (TE's layer spec, NCCL) reads through the
metadata allow-list.

    pytest tests/functional/test_gpu_checkpoint_safety.py -m gpu
"""

from __future__ import annotations

import io

import pytest

from thdpack.megatron.checkpoint_reader import check_extra_states, load_plain, read_dcp_metadata

from .gpu import FP8_CORES, WITH_TE
from .training import run_train

pytestmark = [*WITH_TE, FP8_CORES, pytest.mark.functional]


def extra_states(iteration_dir) -> dict:
    """``{key: value}`` of the checkpoint's ``_extra_state`` objects, read as plain data."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata = read_dcp_metadata(iteration_dir / ".metadata")
    found = {}
    for index, info in metadata.storage_data.items():
        if "_extra_state" not in index.fqn or not isinstance(
            metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata
        ):
            continue
        with open(iteration_dir / info.relative_path, "rb") as f:
            f.seek(info.offset)
            value = load_plain(io.BytesIO(f.read(info.length)), index.fqn)
        found[index.fqn] = value[0] if isinstance(value, list) else value
    return found


@pytest.mark.parametrize("precision", ["fp8", "bf16"])
def test_a_te_checkpoint_passes_the_allow_lists_and_resumes(precision, tmp_path):
    ckpt = tmp_path / "ckpt"
    command = [
        f"trainer.precision={precision}",
        "trainer.fp8_recipe=delayed",
        "model.te_op_fuser=false",
        "dataset.max_files=40",
        "dataset.seq_length=512",
        "trainer.train_iters=4",
        "trainer.lr_warmup_iters=1",
        "trainer.progress_bar=false",
        f"checkpoint.dir={ckpt}",
    ]
    run_train([*command, "trainer.exit_interval=2"], tmp_path / "run").check()
    states = extra_states(ckpt / "iter_0000002")
    assert states, "no _extra_state in the checkpoint"
    held = [key for key, value in states.items() if hasattr(value, "numel") and value.numel() > 0]
    if precision == "fp8":
        assert held, "no FP8 state in the checkpoint"
    for key, value in states.items():  # what loading the model hands Transformer Engine
        check_extra_states({"_extra_state": value}, f"{ckpt / 'iter_0000002'} ({key})")
    resumed = run_train(command, tmp_path / "run").check()
    assert f"resumed from {ckpt} at iteration 2" in resumed.output
    assert resumed.steps[-2:] == [3, 4]
