"""L1: checkpoint directories as people share them and disks break them, met by ``python -m thdpack.train`` (the same
command again: a resume) and ``python -m thdpack.export``:

- a ``.metadata`` replaced by a pickle that writes a marker file and then returns the real metadata, and a pickled
  object inside a shard (the RNG state) that does the same, its manifest written again to match (an attacker
  can): both refused before anything runs, naming the file and the class, exit 2; no marker file;
- a truncated shard in the latest checkpoint: the resume names the file, passes over that checkpoint for the one
  before it (said in the log) and removes a ``.partial`` left by an earlier save; the export names the file and
  the complete checkpoint to export instead, exit 2;
- a ``checkpoint.dir`` that cannot be written (a path under a regular file, a read-only directory): refused before
  set-up, named, exit 2.

One Hugging Face run (tiny Llama, checkpoints of iterations 1 and 2) is copied for each case; the cases run together.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.hf_models import save_model
from tests.tampering import poison_byte_object, poison_metadata, truncate

from .training import Run, finish, run_train, start, start_train

pytestmark = [pytest.mark.functional, pytest.mark.cpu_only]

TWO_SAVES = ["trainer.train_iters=2", "trainer.lr_warmup_iters=0", "checkpoint.save_interval=1"]
RESUMED = ["trainer.train_iters=3"]  # the same command, one step more
LATEST = "iter_0000002"


def hf_command(source: Path, ckpt: Path, *extra: str) -> list[str]:
    return [
        "model=hf",
        f"model.pretrained={source}",
        f"dataset.tokenizer={source / 'tokenizer.json'}",
        *TWO_SAVES,
        f"checkpoint.dir={ckpt}",
        *extra,
    ]


@dataclass
class Case:
    ckpt: Path  # the tampered copy the resume ran on
    marker: Path  # what the poisoned pickles would write
    resumed: Run | None = None
    exported: Run | None = None
    shard: str = ""  # the shard tampered with


def unprivileged() -> list[str]:
    """A prefix that takes away root's right to write where the mode bits say no (setpriv, util-linux)."""
    return ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"] if os.geteuid() == 0 else []


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, Case]:
    root = tmp_path_factory.mktemp("safety")
    source = save_model("llama2", root / "source")
    run_train(hf_command(source, root / "saved"), root / "saved_run").check()
    found, started = {}, {}
    for name in ("metadata", "shard", "truncated", "truncated_export"):
        ckpt = root / name / "ckpt"
        shutil.copytree(root / "saved", ckpt)
        found[name] = case = Case(ckpt, root / name / "marker")
        latest = ckpt / LATEST
        if name == "metadata":
            poison_metadata(latest, case.marker)
        elif name == "shard":
            case.shard = poison_byte_object(latest, "rng_state", case.marker)
        else:
            case.shard = "__0_1.distcp"
            truncate(latest / case.shard)
            (ckpt / "iter_0000003.partial").mkdir()  # a save that never finished
        if name != "truncated_export":
            started[name, "resume"] = start_train(hf_command(source, ckpt, *RESUMED), root / name / "run")
        if name != "truncated":
            out = root / name / "out"
            started[name, "export"] = start(
                [sys.executable, "-m", "thdpack.export", str(ckpt), str(out)], out
            )
    (root / "a_file").write_text("")
    started["under_file", "resume"] = start_train(
        ["trainer.train_iters=1", f"checkpoint.dir={root / 'a_file' / 'ckpt'}"], root / "under_file"
    )
    read_only = root / "read_only"
    read_only.mkdir(mode=0o555)
    argv = [
        *unprivileged(),
        sys.executable,
        "-m",
        "thdpack.train",
        f"checkpoint.dir={read_only / 'ckpt'}",
        f"hydra.run.dir={root / 'read_only_run'}",
    ]
    started["read_only", "resume"] = start(argv, root / "read_only_run")
    for (name, what), run in started.items():
        case = found.setdefault(name, Case(root / name, root / name / "marker"))
        setattr(case, "resumed" if what == "resume" else "exported", finish(run))
    found["under_file"].ckpt = root / "a_file" / "ckpt"
    found["read_only"].ckpt = read_only / "ckpt"
    return found


@pytest.mark.parametrize("name", ["metadata", "shard"])
def test_a_checkpoint_that_runs_code_is_refused_by_the_resume_naming_file_and_class(cases, name):
    case = cases[name]
    file = case.ckpt / LATEST / (".metadata" if name == "metadata" else case.shard)
    assert case.resumed.returncode == 2
    assert f"{file}" in case.resumed.output
    assert "asks to load builtins.eval: refused" in case.resumed.output
    assert case.resumed.steps == []
    assert not case.marker.exists()


@pytest.mark.parametrize("name", ["metadata", "shard"])
def test_a_checkpoint_that_runs_code_is_refused_by_the_export_naming_file_and_class(cases, name):
    case = cases[name]
    file = case.ckpt / LATEST / (".metadata" if name == "metadata" else case.shard)
    assert case.exported.returncode == 2
    assert f"{file}" in case.exported.output and "asks to load builtins.eval: refused" in case.exported.output
    assert "Traceback" not in case.exported.output
    assert not case.marker.exists()


def test_a_truncated_latest_checkpoint_is_named_and_passed_over_for_the_one_before(cases):
    case = cases["truncated"]
    output = case.resumed.check().output
    size = (case.ckpt.parent.parent / "saved" / LATEST / case.shard).stat().st_size
    assert (
        f"{LATEST} is damaged: {case.ckpt / LATEST / case.shard}: {size // 2} bytes, manifest.json says {size}"
        in (output)
    )
    assert f"resuming from {case.ckpt / 'iter_0000001'}, the newest complete checkpoint" in output
    assert f"resumed from {case.ckpt} at iteration 1" in output


def test_the_resume_replaces_the_damaged_checkpoint_and_removes_a_partial_save(cases):
    case = cases["truncated"]
    assert f"removed {case.ckpt / 'iter_0000003.partial'}, left by a save that did not finish" in (
        case.resumed.check().output
    )
    assert sorted(p.name for p in case.ckpt.glob("iter_*")) == [
        "iter_0000001",
        "iter_0000002",
        "iter_0000003",
    ]


def test_the_export_of_a_damaged_checkpoint_names_the_file_and_the_complete_one(cases):
    case = cases["truncated_export"]
    assert case.exported.returncode == 2
    assert f"{case.ckpt / LATEST} is damaged: {case.ckpt / LATEST / case.shard}: " in case.exported.output
    assert "the newest complete checkpoint there is iter_0000001 (--iteration 1)" in case.exported.output


@pytest.mark.parametrize(
    ("name", "why"), [("under_file", "is a file, not a directory"), ("read_only", "cannot be written")]
)
def test_a_checkpoint_dir_that_cannot_be_written_is_refused_before_set_up(cases, name, why):
    case = cases[name]
    assert case.resumed.returncode == 2
    assert f"checkpoint.dir={case.ckpt} cannot hold checkpoints:" in case.resumed.output
    assert why in case.resumed.output
    assert "model:" not in case.resumed.output  # refused before the model was built
