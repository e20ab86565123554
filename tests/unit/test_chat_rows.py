"""Chat rows checked before step 1 against the roles the model's chat template renders (thdpack.hf.tokenizer,
thdpack.data.jsonl_records): a misspelt or unknown role, an empty assistant turn and a turn the template drops are
each named as ``file:line`` with the turn; ``dataset.bad_lines=skip`` leaves such rows out, counted in the start-up
log. Tokenizers: tests/hf_tokenizers.py's small BPE with the real Qwen2.5 template (no download)."""

import json
import os

import pytest

pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.hf_tokenizers import write_tokenizer  # noqa: E402
from thdpack.data import ByteTokenizer  # noqa: E402
from thdpack.data.jsonl import JsonlDataset  # noqa: E402
from thdpack.hf.tokenizer import PretrainedTokenizer  # noqa: E402

GOOD = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4."}]
# A template that renders a system turn only as the first message (as some do): a later one is dropped.
FIRST_SYSTEM_ONLY = (
    "{% for m in messages %}{% if m['role'] != 'system' or loop.first %}<|im_start|>{{ m['role'] }}\n"
    "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return PretrainedTokenizer(write_tokenizer(tmp_path_factory.mktemp("qwen"), "qwen2_5").path)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("THDPACK_CACHE", str(tmp_path / "cache"))


def write(tmp_path, *conversations):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations))
    return path


def test_the_roles_a_template_renders_are_read_off_it(qwen):
    assert qwen.chat_roles == {"system", "user", "assistant", "tool"}


def test_a_misspelt_role_in_a_later_turn_is_named_with_the_closest_role(tmp_path, qwen):
    row = [*GOOD, {"role": "user", "content": "And 3 + 3?"}, {"role": "assitant", "content": "6."}]
    path = write(tmp_path, GOOD, row)
    with pytest.raises(
        ValueError, match=rf"{path}:2: messages\[3\] has role 'assitant': did you mean 'assistant'\?"
    ):
        JsonlDataset(path, qwen, validate="parse")


def test_a_role_the_template_does_not_render_is_named_with_the_roles_it_does(tmp_path, qwen):
    path = write(tmp_path, [{"role": "context", "content": "x"}, *GOOD])
    with pytest.raises(
        ValueError, match=r"has role 'context': The roles the chat template renders are assistant, "
    ):
        JsonlDataset(path, qwen)


def test_without_a_template_a_misspelt_assistant_is_named_too(tmp_path):
    path = write(tmp_path, [GOOD[0], {"role": "asistant", "content": "4."}])
    with pytest.raises(
        ValueError, match=r"chat\.jsonl:1: messages\[1\] has role 'asistant': did you mean 'assistant'"
    ):
        JsonlDataset(path, ByteTokenizer())


def test_a_row_without_an_assistant_turn_names_the_roles_it_has(tmp_path):
    path = write(tmp_path, [GOOD[0], {"role": "bot", "content": "4."}])
    with pytest.raises(ValueError, match=r":1: no assistant message \(the roles are 'user', 'bot'\)"):
        JsonlDataset(path, ByteTokenizer())


@pytest.mark.parametrize("content", ["", "  \n"])
def test_an_empty_assistant_turn_is_refused(tmp_path, qwen, content):
    path = write(
        tmp_path, [*GOOD, {"role": "user", "content": "More?"}, {"role": "assistant", "content": content}]
    )
    with pytest.raises(ValueError, match=rf"{path}:1: messages\[3\] is an assistant turn with empty content"):
        JsonlDataset(path, qwen, validate="parse")


def test_a_turn_the_template_drops_is_found_by_the_tokenizing_pass(tmp_path):
    directory = write_tokenizer(tmp_path / "tok", "qwen2_5", chat_template=FIRST_SYSTEM_ONLY).path
    tokenizer = PretrainedTokenizer(directory)
    path = write(tmp_path, [*GOOD, {"role": "system", "content": "Be brief."}, *GOOD])
    with pytest.raises(
        ValueError, match=rf"{path}:1: messages\[2\] \(role 'system'\) is not in the text the chat"
    ):
        JsonlDataset(path, tokenizer, validate="tokenize")


def test_bad_lines_skip_leaves_them_out_and_the_summary_counts_them(tmp_path, qwen):
    path = write(tmp_path, GOOD, [GOOD[0], {"role": "assitant", "content": "4."}], GOOD, [*GOOD[:1]])
    data = JsonlDataset(path, qwen, bad_lines="skip")
    assert len(data) == 2 and [s.source for s in (data[0], data[1])] == [f"{path}:1", f"{path}:3"]
    assert "; 2 bad line(s) left out (dataset.bad_lines=skip), the first: " in data.summary
    assert f"{path}:2: messages[1] has role 'assitant'" in data.summary
