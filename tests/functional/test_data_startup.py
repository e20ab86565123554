"""L1: what ``python -m thdpack.train`` says about its data before step 1 and while it trains (one CPU process):
a JSONL file with bad lines stops the start naming every bad line; overlong samples are counted in the start-up
log and the truncations on the console; a model directory's tokenizer and chat template feed ``embedded_sft``."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from .training import Run, finish, start_train

pytestmark = [pytest.mark.functional, pytest.mark.cpu_only]

SHORT = (
    "model=tiny_gpt",
    "trainer.train_iters=2",
    "trainer.lr_warmup_iters=0",
    "dataset.global_batch_size=4",
    "dataset.micro_batch_size=2",
)


def jsonl(tmp_path, rows):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(r if isinstance(r, str) else json.dumps(r) + "\n" for r in rows))
    return path


def cache(tmp_path):
    return {"THDPACK_CACHE": str(tmp_path / "cache")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, Run]]:
    """``name -> (data file or tokenizer, run)`` of the module's three runs, started together (independent
    one-process runs; one alone leaves a core of two idle)."""
    started = {}
    root = tmp_path_factory.mktemp("bad_lines")
    path = jsonl(root, [{"text": "fine"}] * 3 + ["{broken\n", {"prompt": "p"}, {"text": "fine"}])
    overrides = [*SHORT, "dataset=jsonl", f"dataset.path={path}"]
    started["bad_lines"] = path, start_train(overrides, root / "run", env=cache(root))

    root = tmp_path_factory.mktemp("overlong")
    rows = [{"prompt": "q" * 10, "response": "a" * (300 if i % 4 == 0 else 20)} for i in range(16)]
    path = jsonl(root, rows)
    overrides = [
        *SHORT,
        "dataset=jsonl",
        f"dataset.path={path}",
        "dataset.seq_length=64",
        "dataset.shuffle=false",
    ]
    started["overlong"] = path, start_train(overrides, root / "run", env=cache(root))

    if importlib.util.find_spec("transformers") is not None:  # else its test skips
        from tests.hf_tokenizers import write_tokenizer

        root = tmp_path_factory.mktemp("sft")
        info = write_tokenizer(root / "qwen", "qwen2_5")
        overrides = [*SHORT, "dataset=embedded_sft", "dataset.max_files=3", f"dataset.tokenizer={info.path}"]
        env = {**cache(root), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
        started["sft"] = info.path, start_train(overrides, root / "run", env=env)
    return {name: (path, finish(run)) for name, (path, run) in started.items()}


def test_bad_jsonl_lines_stop_the_start_naming_each_line(runs):
    path, result = runs["bad_lines"]
    assert result.returncode == 2  # the message alone, no traceback
    assert f"thdpack: {path}: 2 bad line(s) of 6" in result.output
    assert "Traceback" not in result.output
    assert (
        f"{path}:4: malformed JSON" in result.output and f"{path}:5: 'response' is missing" in result.output
    )
    assert not (result.run_dir / "metrics.jsonl").exists()


def test_overlong_samples_are_counted_at_start_up_and_truncations_on_the_console(runs):
    _, result = runs["overlong"]
    result.check()
    assert "every line parsed, checked and tokenized" in result.output
    assert (
        "data: 4 of 16 samples (25.0%) are longer than seq_length (64): dataset.overlong=truncate, they are "
        "truncated to their first 64 tokens" in result.output
    )
    assert (
        "step 1 | " in result.output and "| 1 truncated so far" in result.output
    )  # samples 0-3 hold one long one
    assert "| 2 truncated so far" in result.output
    assert "data: 8 samples trained on, 2 truncated, 0 dropped (dataset.overlong=truncate)" in result.output
    assert [r["samples_truncated"] for r in result.records] == [1, 2]


def test_embedded_sft_trains_through_a_model_directorys_chat_template(runs):
    pytest.importorskip("transformers")
    _, result = runs["sft"]
    result.check()
    assert result.steps == [1, 2] and all(math.isfinite(loss) for loss in result.losses)
    assert "data: embedded_sft" in result.output
