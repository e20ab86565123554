"""Specification of the ``jsonl`` dataset: the four line kinds, errors that name file and line, and the one pass
that checks every line when the dataset is built (its report and its cache)."""

import json
import pickle

import numpy as np
import pytest

from thdpack.data import ByteTokenizer
from thdpack.data.jsonl import JsonlDataset

TOK = ByteTokenizer()
BOS, EOS = TOK.bos_id, TOK.eos_id


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Every test's index cache in its own folder (none under the home directory)."""
    monkeypatch.setenv("THDPACK_CACHE", str(tmp_path / "cache"))


def write(tmp_path, *lines, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


def ids(text):
    return TOK.encode(text).tolist()


def test_text_line_is_bos_text_eos_with_plain_lm_targets(tmp_path):
    s = JsonlDataset(write(tmp_path, {"text": "hi"}), TOK)[0]
    assert s.tokens.tolist() == [BOS, *ids("hi"), EOS]
    assert s.target_mask is None


def test_input_ids_are_used_as_given(tmp_path):
    s = JsonlDataset(write(tmp_path, {"input_ids": [5, 6, 7]}), TOK)[0]
    assert s.tokens.tolist() == [5, 6, 7] and s.tokens.dtype == np.int64
    assert s.target_mask is None


def test_prompt_response_targets_the_response_and_eos(tmp_path):
    s = JsonlDataset(write(tmp_path, {"prompt": "Hi", "response": "Yo"}), TOK)[0]
    assert s.tokens.tolist() == [BOS, *ids("Hi"), *ids("Yo"), EOS]
    assert s.target_mask.tolist() == [False, False, False, True, True, True]


def test_messages_target_only_assistant_content_and_eos(tmp_path):
    line = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    s = JsonlDataset(write(tmp_path, line), TOK)[0]
    user, assistant = ids("<|user|>\n"), ids("<|assistant|>\n")
    assert s.tokens.tolist() == [BOS, *user, *ids("a"), EOS, *assistant, *ids("b"), EOS]
    expected = [False] * (1 + len(user) + 2 + len(assistant)) + [True, True]
    assert s.target_mask.tolist() == expected


def test_other_keys_are_ignored(tmp_path):
    s = JsonlDataset(write(tmp_path, {"text": "x", "id": 7, "meta": {"a": 1}}), TOK)[0]
    assert s.tokens.tolist() == [BOS, *ids("x"), EOS]


def test_source_names_file_and_line(tmp_path):
    path = write(tmp_path, {"text": "a"}, {"text": "b"})
    assert JsonlDataset(path, TOK)[1].source == f"{path}:2"


def test_blank_lines_are_skipped_and_lines_keep_their_numbers(tmp_path):
    path = write(tmp_path, {"text": "a"}, "", "\r", {"text": "b"}, "")
    data = JsonlDataset(path, TOK)
    assert len(data) == 2
    assert data[1].source.endswith(":4")


def test_a_file_without_trailing_newline_keeps_its_last_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a"}\n{"text": "b"}')
    assert len(JsonlDataset(path, TOK)) == 2


BAD = [
    ("{not json", "malformed JSON"),
    ("[1, 2]", "not an object"),
    ({"title": "x"}, "none of the keys"),
    ({"text": "x", "prompt": "y", "response": "z"}, "'text' and 'prompt'"),
    ({"text": ""}, "'text' is empty"),
    ({"text": 5}, "'text' is a int: it must be a string"),
    ({"prompt": "p"}, "'response' is missing"),
    ({"prompt": "p", "response": ""}, "no.*target|at least one target"),
    ({"input_ids": []}, "0 id"),
    ({"input_ids": [3]}, "1 id"),
    ({"input_ids": [1, 2.5]}, "non-integer"),
    ({"input_ids": [1, "2"]}, "non-integer"),
    ({"input_ids": [1, None]}, "non-integer"),
    ({"input_ids": [True, False]}, "non-integer"),
    ({"input_ids": [1, [2]]}, "non-integer"),
    ({"input_ids": "12"}, "'input_ids' is a str"),
    ({"input_ids": [1, 259]}, r"input_ids\[1\] = 259 is out of range.*\[0, 259\)"),
    ({"input_ids": [-1, 2]}, r"input_ids\[0\] = -1 is out of range"),
    ({"messages": []}, "non-empty list"),
    ({"messages": [{"content": "x"}]}, r"messages\[0\].*'role'"),
    ({"messages": [{"role": "user"}]}, r"'messages\[0\].content' is missing"),
    ({"messages": [{"role": "user", "content": "q"}]}, "no assistant message"),
]


@pytest.mark.parametrize(("line", "rule"), BAD, ids=[rule for _, rule in BAD])
@pytest.mark.parametrize("validate", ["parse", "tokenize"])
def test_bad_line_stops_the_build_naming_file_line_and_rule(tmp_path, line, rule, validate):
    path = write(tmp_path, {"text": "fine"}, line, name="bad.jsonl")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: ") as err:
        JsonlDataset(path, TOK, validate=validate)
    assert err.match(rule)
    assert err.match(r"1 bad line\(s\) of 2")


def test_every_bad_line_is_reported_with_its_line_and_counted(tmp_path):
    path = write(tmp_path, {"text": "a"}, "{oops", {"text": "b"}, {"title": "x"}, "", {"input_ids": [1]})
    with pytest.raises(ValueError) as err:
        JsonlDataset(path, TOK)
    message = str(err.value)
    assert "3 bad line(s) of 5" in message
    for line, rule in ((2, "malformed JSON"), (4, "none of the keys"), (6, "1 id")):
        assert f"{path}:{line}: " in message and rule in message


def test_the_report_quotes_the_first_max_errors_bad_lines_and_counts_all(tmp_path):
    path = write(tmp_path, *([{"text": "ok"}] + ["[1]"] * 25))
    with pytest.raises(ValueError) as err:
        JsonlDataset(path, TOK, max_errors=20)
    message = str(err.value)
    assert "25 bad line(s) of 26" in message and "the first 20" in message
    assert f"{path}:21: " in message and f"{path}:22: " not in message


def test_a_tokenizing_pass_knows_every_sample_length(tmp_path):
    path = write(tmp_path, {"text": "hi"}, {"prompt": "Hi", "response": "Yo"}, {"input_ids": [5, 6, 7]})
    data = JsonlDataset(path, TOK, validate="tokenize")
    assert data.lengths.tolist() == [len(data[i]) for i in range(3)] == [4, 6, 3]


def test_a_parsing_pass_leaves_lengths_unknown(tmp_path):
    data = JsonlDataset(write(tmp_path, {"text": "hi"}), TOK, validate="parse")
    assert data.lengths is None and len(data) == 1


def test_auto_tokenizes_a_small_file(tmp_path):
    assert JsonlDataset(write(tmp_path, {"text": "hi"}), TOK).lengths.tolist() == [4]


def test_a_second_build_loads_the_cached_index(tmp_path):
    path = write(tmp_path, {"text": "a"}, "", {"text": "bc"})
    first = JsonlDataset(path, TOK)
    second = JsonlDataset(path, TOK)
    assert not first.index.cached and second.index.cached
    assert second.index.cache_path.exists()
    assert second.lengths.tolist() == first.lengths.tolist() == [3, 4]
    assert second[1].source == f"{path}:3"


def test_a_changed_file_is_checked_again(tmp_path):
    path = write(tmp_path, {"text": "a"}, {"text": "b"})
    JsonlDataset(path, TOK)
    path.write_text(path.read_text().replace('{"text": "b"}', '{"text": 777}'))  # same size
    with pytest.raises(ValueError, match=r":2: 'text' is a int"):
        JsonlDataset(path, TOK)


def test_another_tokenizer_does_not_reuse_the_index(tmp_path):
    class Other(ByteTokenizer):
        name = "other"

    path = write(tmp_path, {"text": "a"})
    JsonlDataset(path, TOK)
    assert not JsonlDataset(path, Other()).index.cached


def test_a_file_with_bad_lines_is_not_cached(tmp_path):
    path = write(tmp_path, {"text": "a"}, "[]")
    with pytest.raises(ValueError):
        JsonlDataset(path, TOK)
    assert not list((tmp_path / "cache").rglob("*.npz"))


def test_validate_names_its_options(tmp_path):
    with pytest.raises(ValueError, match=r"dataset.validate is 'all'.*'auto', 'parse', 'tokenize'"):
        JsonlDataset(write(tmp_path, {"text": "a"}), TOK, validate="all")


def test_a_line_that_goes_bad_after_indexing_raises_when_reached(tmp_path):
    path = write(tmp_path, {"text": "a"}, {"text": "b"}, {"text": "c"})
    data = JsonlDataset(path, TOK)
    text = path.read_text().replace('{"text": "b"}', '{"text": "b"')  # same offsets for line 1
    path.write_text(text)
    data[0]
    with pytest.raises(ValueError, match=r"data\.jsonl:2: malformed JSON"):
        data[1]


def test_dataset_pickles_without_its_open_file(tmp_path):
    data = JsonlDataset(write(tmp_path, {"text": "a"}, {"text": "b"}), TOK)
    data[0]  # opens the file
    clone = pickle.loads(pickle.dumps(data))
    assert clone[1].tokens.tolist() == data[1].tokens.tolist()


def test_an_empty_file_has_no_samples(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    assert len(JsonlDataset(path, TOK)) == 0


def test_index_out_of_range_is_an_index_error(tmp_path):
    with pytest.raises(IndexError):
        JsonlDataset(write(tmp_path, {"text": "a"}), TOK)[1]
