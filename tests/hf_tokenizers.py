"""Small real Hugging Face tokenizer directories, built at test time with no download.

:func:`write_tokenizer` writes ``tokenizer.json`` and ``tokenizer_config.json`` (with the model family's own
``chat_template``) into a directory, laid out as the released checkpoints lay them out, so that
``transformers.AutoTokenizer.from_pretrained(directory)`` loads it offline. The BPE vocabulary is trained with
``tokenizers`` on a slice of the Python standard library's sources (what ``dataset=embedded`` reads), once per
process and vocabulary size (about a second); the family's special tokens follow it at the end of the vocabulary,
as in the real tokenizers.

Styles:

* ``llama3``: Llama 3's pre-tokenizer split (digits in runs of up to three), ``<|begin_of_text|>`` prepended by
  the post-processor, ``eos_token`` ``<|eot_id|>`` (as in Llama-3.2-*-Instruct), pad
  ``<|finetune_right_pad_id|>``, and the exact ``chat_template`` of ``meta-llama/Llama-3.2-1B-Instruct`` (a
  system header with "Cutting Knowledge Date" and "Today Date" lines on every conversation).
* ``qwen2_5``: Qwen2's split (single digits), NFC normalizer, no BOS, ``eos_token`` ``<|im_end|>``, pad
  ``<|endoftext|>``, and the exact ``chat_template`` of ``Qwen/Qwen2.5-*-Instruct`` (a default system prompt
  "You are Qwen, created by Alibaba Cloud. ..." when the conversation has none).
* ``qwen3``: as ``qwen2_5`` with the ``<think>`` tokens and the exact ``chat_template`` of ``Qwen/Qwen3-*``
  (the last assistant turn after the last user query renders an empty ``<think>\\n\\n</think>\\n\\n`` block).

``chat_template`` replaces the style's template: ``write_tokenizer(d, "qwen2_5",
chat_template=QWEN2_VL_CHAT_TEMPLATE)`` lays out the tokenizer of the released Qwen2.5-VL checkpoints (Qwen2.5's
tokens, the vision ones included, and the Qwen2-VL template, which renders an image part as
``<|vision_start|><|image_pad|><|vision_end|>``).

Usage (e.g. beside a tiny model saved with ``XxxForCausalLM(config).save_pretrained(directory)``)::

    info = write_tokenizer(directory, "qwen3")
    config = Qwen3Config(vocab_size=info.vocab_size, eos_token_id=info.eos_id, ...)
"""

from __future__ import annotations

import functools
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "QWEN2_VL_CHAT_TEMPLATE",
    "QWEN3_VL_CHAT_TEMPLATE",
    "STYLES",
    "TokenizerInfo",
    "train_bpe",
    "write_tokenizer",
]

STYLES = ("llama3", "qwen2_5", "qwen3")

# The pre-tokenizer splits of the released tokenizer.json files (Llama 3 groups digits by three, Qwen2 by one).
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)

LLAMA3_SPECIALS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|reserved_special_token_2|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
)
QWEN_SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# Added tokens that are not special in the released Qwen files (they survive skip_special_tokens).
QWEN2_5_ADDED = ("<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>")
QWEN3_ADDED = (*QWEN2_5_ADDED, "<tool_response>", "</tool_response>", "<think>", "</think>")

# meta-llama/Llama-3.2-1B-Instruct, tokenizer_config.json "chat_template".
LLAMA3_CHAT_TEMPLATE = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# Qwen/Qwen2.5-*-Instruct, tokenizer_config.json "chat_template".
QWEN2_5_CHAT_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Qwen/Qwen2-VL-*-Instruct and Qwen/Qwen2.5-VL-*-Instruct, chat_template.json "chat_template".
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen/Qwen3-VL-*-Instruct, chat_template.json "chat_template", without its tool-calling branches: no default
# system prompt (unlike Qwen2-VL's), an image part as <|vision_start|><|image_pad|><|vision_end|>, text parts
# joined, assistant content as a string or text parts.
QWEN3_VL_CHAT_TEMPLATE = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].content is string %}
        {{- messages[0].content }}
    {%- else %}
        {%- for content in messages[0].content %}
            {%- if 'text' in content %}
                {{- content.text }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
    {{- '<|im_end|>\\n' }}
{%- endif %}
{%- set image_count = namespace(value=0) %}
{%- set video_count = namespace(value=0) %}
{%- for message in messages %}
    {%- if message.role == "user" %}
        {{- '<|im_start|>' + message.role + '\\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for content in message.content %}
                {%- if content.type == 'image' or 'image' in content or 'image_url' in content %}
                    {%- set image_count.value = image_count.value + 1 %}
                    {%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}
                    <|vision_start|><|image_pad|><|vision_end|>
                {%- elif content.type == 'video' or 'video' in content %}
                    {%- set video_count.value = video_count.value + 1 %}
                    {%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}
                    <|vision_start|><|video_pad|><|vision_end|>
                {%- elif 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for content_item in message.content %}
                {%- if 'text' in content_item %}
                    {{- content_item.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Qwen/Qwen3-* (dense and MoE), tokenizer_config.json "chat_template".
QWEN3_CHAT_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""


@dataclass(frozen=True)
class TokenizerInfo:
    """What a model config needs from a written tokenizer directory."""

    path: Path
    style: str
    vocab_size: int  # len(tokenizer): BPE vocabulary plus the added tokens
    bos_id: int | None  # None for the Qwen styles (no BOS token)
    eos_id: int  # the tokenizer_config's eos_token (the end of an assistant turn)
    pad_id: int
    end_of_text_id: int  # <|end_of_text|> / <|endoftext|>: a base model's end of document
    added_ids: dict[
        str, int
    ]  # every added token's id (<|image_pad|>, <|vision_start|>, ... for the Qwen styles)


def _corpus(max_chars: int) -> list[str]:
    # The top-level stdlib modules in name order: part of what dataset=embedded reads, found without walking
    # the whole tree (a walk takes seconds on a busy machine).
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return texts


@functools.lru_cache(maxsize=8)
def train_bpe(split: str = "llama3", vocab_size: int = 1024):
    """A byte-level BPE ``tokenizers.Tokenizer`` (no added tokens) with ``split``'s pre-tokenizer
    (``"llama3"`` or ``"qwen2"``), trained on about 300 K characters of the stdlib's sources; cached."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    pattern = {"llama3": LLAMA3_SPLIT, "qwen2": QWEN2_SPLIT}[split]
    tok = Tokenizer(models.BPE(ignore_merges=split == "llama3"))
    if split == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(max_chars=300_000), trainer=trainer)
    return tok


def _added(content: str, token_id: int, special: bool) -> dict:
    return {
        "id": token_id,
        "content": content,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "special": special,
    }


def write_tokenizer(
    directory: str | Path, style: str = "llama3", vocab_size: int = 1024, *, chat_template: str | None = None
) -> TokenizerInfo:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` of ``style`` (one of :data:`STYLES`) into
    ``directory`` (created if needed; other files there are left alone). ``chat_template``: instead of the
    style's own. ``vocab_size``: the BPE part; the family's added tokens follow it."""
    from tokenizers import processors

    if style not in STYLES:
        raise ValueError(f"style '{style}' is not one of {STYLES}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    llama = style == "llama3"
    tok = train_bpe("llama3" if llama else "qwen2", vocab_size)
    base = json.loads(tok.to_str())
    n = tok.get_vocab_size()
    if llama:
        added = [_added(t, n + i, True) for i, t in enumerate(LLAMA3_SPECIALS)]
    else:
        extra = QWEN2_5_ADDED if style == "qwen2_5" else QWEN3_ADDED
        added = [_added(t, n + i, True) for i, t in enumerate(QWEN_SPECIALS)]
        added += [_added(t, n + len(QWEN_SPECIALS) + i, False) for i, t in enumerate(extra)]
    ids = {a["content"]: a["id"] for a in added}
    base["added_tokens"] = added
    if llama:
        bos = ids["<|begin_of_text|>"]
        post = processors.TemplateProcessing(
            single="<|begin_of_text|> $A",
            pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
            special_tokens=[("<|begin_of_text|>", bos)],
        )
        base["post_processor"] = json.loads(post.__getstate__())
    else:
        base["post_processor"] = {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": False,
            "use_regex": False,
        }
    (directory / "tokenizer.json").write_text(json.dumps(base, ensure_ascii=False, indent=2))

    decoder = {str(a["id"]): {k: v for k, v in a.items() if k != "id"} for a in added}
    if llama:
        config = {
            "added_tokens_decoder": decoder,
            "bos_token": "<|begin_of_text|>",
            "chat_template": LLAMA3_CHAT_TEMPLATE,
            # The released file says true; transformers 5.24 ignores it for BPE (with a warning) and older
            # versions strip spaces before punctuation on decode: false decodes exactly on every version.
            "clean_up_tokenization_spaces": False,
            "eos_token": "<|eot_id|>",
            "model_input_names": ["input_ids", "attention_mask"],
            "model_max_length": 131072,
            "pad_token": "<|finetune_right_pad_id|>",
            "tokenizer_class": "PreTrainedTokenizerFast",
        }
        eos, pad, end_of_text, bos_id = "<|eot_id|>", "<|finetune_right_pad_id|>", "<|end_of_text|>", bos
    else:
        config = {
            "add_prefix_space": False,
            "added_tokens_decoder": decoder,
            "additional_special_tokens": [t for t in QWEN_SPECIALS if t != "<|endoftext|>"],
            "bos_token": None,
            "chat_template": QWEN2_5_CHAT_TEMPLATE if style == "qwen2_5" else QWEN3_CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "eos_token": "<|im_end|>",
            "errors": "replace",
            "model_max_length": 131072,
            "pad_token": "<|endoftext|>",
            "split_special_tokens": False,
            "tokenizer_class": "Qwen2Tokenizer",
            "unk_token": None,
        }
        eos, pad, end_of_text, bos_id = "<|im_end|>", "<|endoftext|>", "<|endoftext|>", None
    if chat_template is not None:
        config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2))
    return TokenizerInfo(
        path=directory,
        style=style,
        vocab_size=n + len(added),
        bos_id=bos_id,
        eos_id=ids[eos],
        pad_id=ids[pad],
        end_of_text_id=ids[end_of_text],
        added_ids=ids,
    )
