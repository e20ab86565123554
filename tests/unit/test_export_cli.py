"""``python -m thdpack.export``'s command line: a checkpoint it cannot export is named in one line (exit code 2,
no traceback), and nothing is written; nothing is left in the temporary directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from thdpack.models.export import main


def _fails(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    return capsys.readouterr().err


def test_a_directory_without_a_checkpoint_is_named(tmp_path, capsys):
    err = _fails([str(tmp_path / "ckpt"), str(tmp_path / "out")], capsys)
    assert err.startswith("python -m thdpack.export: error: ")
    assert f"{tmp_path / 'ckpt'} holds no complete checkpoint (no latest_checkpointed_iteration.txt)" in err
    assert not (tmp_path / "out").exists()


def test_a_failed_export_leaves_an_existing_output_directory_as_it_was(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    _fails([str(tmp_path / "ckpt"), str(tmp_path / "out")], capsys)
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


def test_the_export_process_group_leaves_nothing_in_the_temporary_directory(tmp_path):
    # load_checkpoint_model's one-process group, and a group made on its store as Megatron's parallel state makes them
    script = (
        "import torch.distributed as dist\n"
        "from thdpack.models.export import start_one_process_group\n"
        "start_one_process_group(); dist.new_group([0]); dist.barrier(); dist.destroy_process_group()\n"
    )
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, capture_output=True)
    assert list(tmp_path.iterdir()) == []
