"""A run's checkpoints in this process (thdpack.training.checkpointing over tiny_gpt, one gloo rank): what a resume
checks before step 1 (the model's shapes, the data set), what a save says, a disk that fills up mid-save, free
space. The same run's processes, files and signals are in tests/functional/test_checkpoint_safety.py and
test_signals.py."""

from __future__ import annotations

import errno
import logging
from pathlib import Path

import pytest

from tests.functional.training import FAST, run_in_process
from thdpack.megatron.checkpoint import CheckpointWriteError, latest_iteration
from thdpack.training.checkpointing import RunCheckpoints, checkpoint_bytes
from thdpack.training.config_error import ConfigError

pytestmark = pytest.mark.cpu_only


def step(run) -> None:
    """One training step (the optimizer has state to save after it)."""
    from thdpack.training.loop import train_step

    train_step(run, run.data.next_step())


def overrides(ckpt: Path, *extra: str) -> list[str]:
    return [*FAST, "trainer.train_iters=2", "trainer.lr_warmup_iters=1", f"checkpoint.dir={ckpt}", *extra]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A checkpoint directory holding tiny_gpt's checkpoint of iteration 1 (max_files=20: 214 samples)."""
    ckpt = tmp_path_factory.mktemp("saved") / "ckpt"
    with run_in_process(overrides(ckpt)) as run:
        checkpoints = RunCheckpoints(run, ckpt.parent / "run", "fully_reshardable")
        step(run)
        checkpoints.save(1)
        checkpoints.close()
    return ckpt


def resume(ckpt: Path, *extra: str):
    """Set up the recipe with ``extra`` on ``ckpt`` and resume: ``(iteration, data state)``."""
    with run_in_process(overrides(ckpt, *extra)) as run:
        checkpoints = RunCheckpoints(run, ckpt.parent / "run", "fully_reshardable")
        try:
            return checkpoints.resume(), run.data.state_dict()
        finally:
            checkpoints.close()


def test_another_model_shape_is_refused_naming_the_tensors_and_the_keys(saved):
    with pytest.raises(ConfigError) as refused:
        resume(saved, "model.config.ffn_hidden_size=256")
    message = str(refused.value)
    assert "decoder.layers.mlp.linear_fc2.weight: saved [2, 128, 384], this model [2, 128, 256]" in message
    assert (
        "the keys that differ from the run that saved it: model.config.ffn_hidden_size (saved 384, now 256)"
        in (message)
    )


def test_another_data_set_is_refused_naming_the_keys_and_the_override(saved):
    with pytest.raises(ConfigError) as refused:
        resume(saved, "dataset.max_files=10")
    message = str(refused.value)
    assert "was saved on another data set: fingerprint (saved '" in message
    assert "dataset.max_files (saved 20, now 10), samples (saved 214, now " in message
    assert "checkpoint.allow_dataset_change=true" in message


def test_the_same_samples_from_elsewhere_resume_at_the_saved_position(saved, caplog):
    # tokenizer=auto is the byte tokenizer for tiny_gpt: the same tokens, named another way
    with caplog.at_level(logging.INFO, logger="thdpack"):
        iteration, data = resume(saved, "dataset.tokenizer=byte")
    assert (iteration, data["consumed"]) == (1, 8)
    assert "from elsewhere (dataset.tokenizer (saved 'auto', now 'byte'))" in caplog.text


def test_allow_dataset_change_resumes_with_the_data_position_restarted(saved, caplog):
    with caplog.at_level(logging.INFO, logger="thdpack"):
        iteration, data = resume(saved, "dataset.max_files=10", "checkpoint.allow_dataset_change=true")
    assert iteration == 1
    assert data["consumed"] == 0
    assert (
        "the data position starts over on this one (the checkpoint's had consumed 8 samples)" in caplog.text
    )


def test_the_same_recipe_resumes_at_the_saved_data_position(saved):
    iteration, data = resume(saved)
    assert (iteration, data["consumed"]) == (1, 8)


def test_saving_the_iteration_a_run_resumed_from_writes_nothing_and_does_not_say_saved(saved, caplog):
    with run_in_process(overrides(saved)) as run, caplog.at_level(logging.INFO, logger="thdpack"):
        checkpoints = RunCheckpoints(run, saved.parent / "run", "fully_reshardable")
        checkpoints.resume()
        before = (saved / "iter_0000001" / "manifest.json").read_text()
        assert checkpoints.save(1)
        checkpoints.close()
    assert "is the one this run resumed from, and nothing was trained since" in caplog.text
    assert "saved checkpoint" not in caplog.text
    assert (saved / "iter_0000001" / "manifest.json").read_text() == before


def test_a_full_disk_mid_save_says_so_keeps_the_previous_checkpoint_and_leaves_no_partial(
    tmp_path, monkeypatch
):
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    ckpt = tmp_path / "ckpt"
    with run_in_process(overrides(ckpt)) as run:
        checkpoints = RunCheckpoints(run, tmp_path / "run", "fully_reshardable")
        step(run)
        checkpoints.save(1)
        step(run)
        write_item = filesystem_async._write_item

        def disk_full(*args, **kwargs):  # in megatron-core's forked writer: some bytes, then ENOSPC
            args[-3].write(b"\0" * 100)
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(filesystem_async, "_write_item", disk_full)
        with pytest.raises(CheckpointWriteError) as failed:
            checkpoints.save(2)
        monkeypatch.setattr(filesystem_async, "_write_item", write_item)
        checkpoints.close()
    message = str(failed.value)
    assert message.startswith(f"no space left on device while saving the checkpoint of iteration 2 to {ckpt}")
    assert (
        f"the previous checkpoint, {ckpt / 'iter_0000001'}, is kept and the same command resumes from it"
        in message
    )
    assert latest_iteration(ckpt) == 1
    assert sorted(p.name for p in ckpt.glob("iter_*")) == ["iter_0000001"]


def test_the_checkpoint_size_estimate_is_what_a_save_of_tiny_gpt_takes(saved):
    from omegaconf import OmegaConf

    from thdpack.training.recipe_keys import recipes_dir

    model = OmegaConf.load(recipes_dir() / "model" / "tiny_gpt.yaml")
    estimate = checkpoint_bytes(model, 384, "fp32")
    written = sum(f.stat().st_size for f in (saved / "iter_0000001").iterdir())
    assert 0.95 * written < estimate <= written


def test_too_little_free_space_is_warned_of_at_start_up(tmp_path, monkeypatch, caplog):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(2**20, 2**20 - 4096, 4096))
    with run_in_process(overrides(tmp_path / "ckpt")) as run, caplog.at_level(logging.INFO, logger="thdpack"):
        RunCheckpoints(run, tmp_path / "run", "fully_reshardable").close()
    assert (
        "has 0.00 GiB free, and one checkpoint of this model takes about 0.01 GiB: a save may fail"
        in caplog.text
    )


def test_rng_states_saved_as_numpy_arrays_by_an_earlier_thdpack_still_resume(saved, tmp_path):
    import shutil

    import numpy as np

    from tests.tampering import replace_byte_object

    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)

    def as_before(states):  # [rng state] as thdpack saved it then: Python's and numpy's own tuples
        state = states[0]
        python, numpy = state["python"], state["numpy"]
        keys = numpy["keys"].numpy().astype(np.uint32)
        state["python"] = (python["version"], tuple(python["state"].tolist()), python["gauss"])
        state["numpy"] = ("MT19937", keys, numpy["pos"], numpy["has_gauss"], numpy["cached_gaussian"])
        return states

    replace_byte_object(ckpt / "iter_0000001", "rng_state", as_before)
    assert resume(ckpt)[0] == 1
