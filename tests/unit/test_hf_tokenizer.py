"""Specification of a Hugging Face model directory's tokenizer in thdpack: the chat template's rendering with the
loss on the assistant turns only, checked against the template's own rendering, and the JSONL rows through it.

The tokenizers are small real ones (BPE trained at test time, the exact Llama 3.2 / Qwen2.5 / Qwen3 templates:
tests/hf_tokenizers.py); no download.
"""

import json
import os

import numpy as np
import pytest

pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.hf_tokenizers import STYLES, write_tokenizer  # noqa: E402
from thdpack.data import ByteTokenizer  # noqa: E402
from thdpack.data.jsonl import JsonlDataset  # noqa: E402
from thdpack.hf.tokenizer import PretrainedTokenizer, resolve_tokenizer  # noqa: E402

END_OF_TURN = {"llama3": "<|eot_id|>", "qwen2_5": "<|im_end|>", "qwen3": "<|im_end|>"}
# What Qwen3's template writes before the content of the assistant turn after the last user message.
QWEN3_EMPTY_THINK = "<think>\n\n</think>\n\n"

CHAT = [
    {"role": "system", "content": "Answer in one line."},
    {"role": "user", "content": "What does len([1, 2]) return?"},
    {"role": "assistant", "content": "It returns 2."},
    {"role": "user", "content": "And len('abc')?"},
    {"role": "assistant", "content": "3, one per character."},
]


@pytest.fixture(scope="module")
def directories(tmp_path_factory):
    return {style: write_tokenizer(tmp_path_factory.mktemp(style), style).path for style in STYLES}


@pytest.fixture(scope="module")
def tokenizers(directories):
    return {style: PretrainedTokenizer(path) for style, path in directories.items()}


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("THDPACK_CACHE", str(tmp_path / "cache"))


def target_spans(tok, tokens, mask):
    """The decoded text of each run of target tokens, special tokens kept."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return [tok.hf.decode(tokens[a:b].tolist()) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def expected_spans(style, messages):
    contents = [m["content"] for m in messages if m["role"] == "assistant"]
    if style == "qwen3":  # only the turn after the last user message carries the empty think block
        contents[-1] = QWEN3_EMPTY_THINK + contents[-1]
    return [c + END_OF_TURN[style] for c in contents]


@pytest.mark.parametrize("style", STYLES)
def test_the_end_of_turn_token_is_read_off_the_template(tokenizers, style):
    assert tokenizers[style].end_of_turn == END_OF_TURN[style]


@pytest.mark.parametrize("style", STYLES)
def test_targets_are_exactly_the_assistant_contents_and_their_end_of_turn(tokenizers, style):
    tok = tokenizers[style]
    tokens, mask = tok.render_chat(CHAT)
    assert target_spans(tok, tokens, mask) == expected_spans(style, CHAT)


@pytest.mark.parametrize("style", STYLES)
def test_tokens_are_the_templates_own_tokenization(tokenizers, style):
    tok = tokenizers[style]
    tokens, mask = tok.render_chat(CHAT)
    assert tokens.dtype == np.int64 and mask.dtype == bool and tokens.shape == mask.shape
    assert tokens.tolist() == tok.hf.apply_chat_template(CHAT, tokenize=True)["input_ids"]


@pytest.mark.parametrize("style", STYLES)
def test_a_single_turn_without_system_message(tokenizers, style):
    tok = tokenizers[style]
    chat = CHAT[1:3]
    tokens, mask = tok.render_chat(chat)
    assert target_spans(tok, tokens, mask) == expected_spans(style, chat)
    assert tokens.tolist() == tok.hf.apply_chat_template(chat, tokenize=True)["input_ids"]


@pytest.mark.parametrize("style", STYLES)
def test_the_prompt_is_what_generation_is_given(tokenizers, style):
    tok = tokenizers[style]
    tokens, mask = tok.render_chat(CHAT)
    first_target = int(np.argmax(mask))
    prompt = tok.hf.apply_chat_template(CHAT[:2], tokenize=True, add_generation_prompt=True)["input_ids"]
    assert tokens[:first_target].tolist() == prompt


def test_injected_system_lines_are_never_targets(tokenizers):
    llama = tokenizers["llama3"]
    tokens, mask = llama.render_chat(CHAT[1:3])
    prompt = llama.hf.decode(tokens[~mask].tolist())
    assert "Cutting Knowledge Date: December 2023" in prompt and "Today Date:" in prompt
    qwen = tokenizers["qwen2_5"]
    tokens, mask = qwen.render_chat(CHAT[1:3])
    assert "You are Qwen, created by Alibaba Cloud." in qwen.hf.decode(tokens[~mask].tolist())


def test_qwen3_renders_the_think_block_only_on_the_last_turn(tokenizers):
    tok = tokenizers["qwen3"]
    spans = target_spans(tok, *tok.render_chat(CHAT))
    assert not spans[0].startswith("<think>") and spans[1].startswith(QWEN3_EMPTY_THINK)


def test_template_variables_reach_the_template(directories):
    tok = PretrainedTokenizer(directories["llama3"], chat_template_kwargs={"date_string": "01 Jan 2025"})
    tokens, mask = tok.render_chat(CHAT[1:3])
    assert "Today Date: 01 Jan 2025" in tok.hf.decode(tokens.tolist())
    assert tok.name != PretrainedTokenizer(directories["llama3"]).name


def test_an_assistant_message_first_is_refused(tokenizers):
    with pytest.raises(
        ValueError, match=r"f\.jsonl:3: messages\[0\] is an assistant message with nothing before"
    ):
        tokenizers["qwen2_5"].render_chat([{"role": "assistant", "content": "hi"}], "f.jsonl:3")


def test_an_assistant_content_holding_the_end_of_turn_text_is_refused(tokenizers):
    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a<|im_end|>b"}]
    with pytest.raises(
        ValueError, match=r"messages\[1\].content holds the end-of-turn token text '<\|im_end\|>'"
    ):
        tokenizers["qwen3"].render_chat(chat)


def test_a_template_that_cannot_render_a_row_names_the_row(tokenizers):
    # Llama 3.2's template accepts one tool call per message and raises on two.
    calls = [{"function": {"name": "f", "arguments": {}}}] * 2
    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    with pytest.raises(ValueError, match=r"f\.jsonl:5: the chat template cannot render .*single tool-calls"):
        tokenizers["llama3"].render_chat(chat, "f.jsonl:5")


def test_name_follows_the_tokenizer_files(directories, tokenizers, tmp_path):
    assert PretrainedTokenizer(directories["qwen3"]).name == tokenizers["qwen3"].name
    assert len({t.name for t in tokenizers.values()}) == len(STYLES)


def test_special_ids_come_from_the_tokenizer_config(tokenizers):
    llama, qwen = tokenizers["llama3"], tokenizers["qwen2_5"]
    assert llama.hf.convert_ids_to_tokens([llama.bos_id, llama.eos_id, llama.pad_id]) == [
        "<|begin_of_text|>",
        "<|eot_id|>",
        "<|finetune_right_pad_id|>",
    ]
    assert qwen.hf.convert_ids_to_tokens([qwen.eos_id, qwen.pad_id]) == ["<|im_end|>", "<|endoftext|>"]
    assert qwen.bos_id == qwen.eos_id  # no BOS token: the eos stands in where a dataset needs one
    assert llama.vocab_size == len(llama.hf)


# --- JSONL rows through a model directory's tokenizer ---------------------------------------------------------


def write(tmp_path, *rows):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("style", STYLES)
def test_messages_rows_go_through_the_chat_template(tmp_path, tokenizers, style):
    tok = tokenizers[style]
    sample = JsonlDataset(write(tmp_path, {"messages": CHAT}), tok)[0]
    assert sample.tokens.tolist() == tok.render_chat(CHAT)[0].tolist()
    assert target_spans(tok, sample.tokens, sample.target_mask) == expected_spans(style, CHAT)


@pytest.mark.parametrize("style", STYLES)
def test_prompt_response_rows_are_a_user_assistant_pair(tmp_path, tokenizers, style):
    tok = tokenizers[style]
    sample = JsonlDataset(write(tmp_path, {"prompt": "Say hi.", "response": "Hi."}), tok)[0]
    pair = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi."}]
    tokens, mask = tok.render_chat(pair)
    assert sample.tokens.tolist() == tokens.tolist() and sample.target_mask.tolist() == mask.tolist()


@pytest.mark.parametrize("style", STYLES)
def test_input_ids_rows_are_used_verbatim(tmp_path, tokenizers, style):
    sample = JsonlDataset(write(tmp_path, {"input_ids": [7, 3, 9]}), tokenizers[style])[0]
    assert sample.tokens.tolist() == [7, 3, 9] and sample.target_mask is None


def test_text_rows_take_the_tokenizers_own_special_tokens(tmp_path, tokenizers):
    llama, qwen = tokenizers["llama3"], tokenizers["qwen2_5"]
    path = write(tmp_path, {"text": "def f(x): return x"})
    assert JsonlDataset(path, llama)[0].tokens.tolist() == [llama.bos_id, *llama.encode("def f(x): return x")]
    assert JsonlDataset(path, qwen)[0].tokens.tolist() == qwen.encode("def f(x): return x").tolist()


def test_a_row_without_an_assistant_turn_names_file_and_line(tmp_path, tokenizers):
    path = write(tmp_path, {"messages": CHAT}, {"messages": CHAT[:2]})
    with pytest.raises(ValueError, match=rf"{path}:2: no assistant message"):
        JsonlDataset(path, tokenizers["llama3"])


def test_a_row_the_template_refuses_is_found_by_the_tokenizing_pass(tmp_path, tokenizers):
    path = write(tmp_path, {"messages": CHAT}, {"messages": [{"role": "assistant", "content": "hi"}]})
    with pytest.raises(ValueError, match=rf"{path}:2: messages\[0\] is an assistant message"):
        JsonlDataset(path, tokenizers["qwen3"], validate="tokenize")


def test_the_tokenizing_pass_counts_chat_lengths(tmp_path, tokenizers):
    tok = tokenizers["qwen3"]
    data = JsonlDataset(write(tmp_path, {"messages": CHAT}, {"prompt": "a", "response": "b"}), tok)
    assert data.lengths.tolist() == [len(data[0]), len(data[1])]


def test_a_directory_without_a_chat_template_uses_thdpacks_role_tags(tmp_path, directories):
    config_path = directories["qwen2_5"] / "tokenizer_config.json"
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "tokenizer.json").write_bytes((directories["qwen2_5"] / "tokenizer.json").read_bytes())
    config = json.loads(config_path.read_text())
    del config["chat_template"]
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    tok = PretrainedTokenizer(plain)
    assert not tok.has_chat_template
    sample = JsonlDataset(write(tmp_path, {"messages": CHAT[1:3]}), tok)[0]
    assert tok.hf.decode(sample.tokens.tolist()).startswith("<|im_end|><|user|>\nWhat does")


# --- which tokenizer a recipe gets -----------------------------------------------------------------------------


def test_auto_is_the_pretrained_directorys_tokenizer(directories):
    tok = resolve_tokenizer("auto", str(directories["llama3"]))
    assert isinstance(tok, PretrainedTokenizer) and tok.directory == directories["llama3"]


def test_auto_without_a_pretrained_model_is_the_byte_tokenizer():
    assert isinstance(resolve_tokenizer("auto", None), ByteTokenizer)
    assert isinstance(resolve_tokenizer(None), ByteTokenizer)


def test_an_explicit_tokenizer_wins_over_the_pretrained_one(directories):
    assert isinstance(resolve_tokenizer("byte", str(directories["llama3"])), ByteTokenizer)
    tok = resolve_tokenizer(str(directories["qwen3"]), str(directories["llama3"]))
    assert tok.directory == directories["qwen3"]


def test_a_missing_tokenizer_path_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"dataset.tokenizer is '.*nowhere'.*does not exist"):
        resolve_tokenizer(str(tmp_path / "nowhere"))


def test_a_directory_without_a_tokenizer_is_named(tmp_path):
    with pytest.raises(ValueError, match=rf"'{tmp_path}' holds no tokenizer"):
        PretrainedTokenizer(tmp_path)
