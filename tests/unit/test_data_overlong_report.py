"""Specification of what the start-up log says about samples longer than the limit (``TrainData.check_overlong``,
``startup_report``) and of the console's running counts (``thdpack.training.metrics``)."""

import json

import numpy as np
import pytest

from thdpack.data import ByteTokenizer, Sample, TrainData
from thdpack.data.jsonl import JsonlDataset
from thdpack.data.loader import startup_report
from thdpack.data.samples import Subset
from thdpack.training.metrics import _format


class Sized:
    """Sample ``i`` has ``lengths[i]`` tokens; ``known`` says whether the dataset tells its lengths up front."""

    def __init__(self, lengths, known=True):
        self._lengths = np.asarray(lengths)
        if known:
            self.lengths = self._lengths

    def __len__(self):
        return len(self._lengths)

    def __getitem__(self, i):
        return Sample(np.arange(self._lengths[i], dtype=np.int64), None, f"sized:{i}")


def make(dataset, **kw):
    args = dict(
        seq_length=10, global_batch_size=2, micro_batch_size=1, dp_rank=0, dp_size=1, seed=0, pad_id=0
    )
    return TrainData(dataset, **{**args, **kw})


@pytest.mark.parametrize(
    ("overlong", "says"),
    [
        ("truncate", "truncated to their first 10 tokens"),
        ("drop", "dropped (the stream refills the batch)"),
    ],
)
def test_known_lengths_give_the_overlong_count_and_the_rule(overlong, says):
    line = make(Sized([5, 11, 10, 30]), overlong=overlong).check_overlong()
    assert line.startswith("2 of 4 samples (50.0%) are longer than seq_length (10)")
    assert f"dataset.overlong={overlong}, they are {says}" in line


def test_the_limit_is_the_token_budget_when_it_is_smaller():
    line = make(Sized([5, 9]), micro_batch_tokens=8, micro_batch_size=None).check_overlong()
    assert line.startswith("1 of 2 samples (50.0%) are longer than micro_batch_tokens (8)")


def test_unknown_lengths_state_the_rule_and_where_counts_appear():
    line = make(Sized([5, 30], known=False)).check_overlong()
    assert line.startswith(
        "sample lengths are not known before training: samples longer than seq_length (10)"
    )
    assert "dataset.overlong=truncate" in line and "the step log counts them" in line


def test_overlong_error_refuses_known_overlong_samples_before_step_one():
    data = make(Sized([5, 11, 3, 12]), overlong="error")
    with pytest.raises(
        ValueError, match=r"2 of 4 samples are longer than seq_length \(10\): dataset.overlong=error"
    ) as e:
        data.check_overlong()
    assert e.match(r"sized:1 \(11 tokens\), sized:3 \(12 tokens\)")


def test_overlong_error_without_overlong_samples_passes():
    assert make(Sized([5, 10]), overlong="error").check_overlong().startswith("all 2 samples fit")


def test_without_overlong_samples_the_log_says_the_rule_has_nothing_to_do():
    line = make(Sized([5, 10])).check_overlong()
    assert line == "all 2 samples fit seq_length (10): dataset.overlong=truncate has nothing to do"


def test_lengths_are_seen_through_a_held_out_split():
    line = make(Subset(Sized([30, 5, 11, 2]), 1, 3)).check_overlong()
    assert line.startswith("1 of 2 samples")


def test_the_start_up_report_of_a_jsonl_file_has_its_pass_and_the_overlong_count(tmp_path, monkeypatch):
    monkeypatch.setenv("THDPACK_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": "x" * n}) + "\n" for n in (3, 20, 4)))
    data = make(JsonlDataset(path, ByteTokenizer()))
    first, second = startup_report(data)
    assert first.startswith(f"{path}: 3 samples, every line parsed, checked and tokenized in ")
    assert second.startswith("1 of 3 samples (33.3%) are longer than seq_length (10)")
    again = startup_report(make(JsonlDataset(path, ByteTokenizer())))[0]
    assert "at an earlier start (index loaded from" in again


def test_the_console_line_shows_the_running_truncated_and_dropped_totals_once_they_happen():
    record = {"loss": 1.0, "samples_truncated": 0, "samples_dropped": 0}
    assert "truncated" not in _format(record) and "dropped" not in _format(record)
    line = _format({**record, "samples_truncated": 152, "samples_dropped": 3})
    assert line.endswith("152 truncated so far | 3 dropped so far")
