"""A Hugging Face model directory's tokenizer and chat template, for thdpack's datasets.

:class:`PretrainedTokenizer` loads ``DIR`` with ``transformers.AutoTokenizer.from_pretrained(DIR,
local_files_only=True)`` (never the hub, never ``trust_remote_code``) and offers what the datasets use
(``encode``, ``decode``, ``vocab_size``, ``bos_id``, ``eos_id``, ``pad_id``, ``name``) plus
:meth:`~PretrainedTokenizer.encode_text` (the tokenizer's own special tokens) and
:meth:`~PretrainedTokenizer.render_chat` (the model's chat template, with the loss on the assistant turns).

How the assistant spans are found (:meth:`~PretrainedTokenizer.render_chat`), for ``messages`` ``m``:

1. ``full`` = the template applied to the whole conversation (``add_generation_prompt=False``).
2. For each assistant message ``m[k]``: ``prompt_k`` = the template applied to ``m[:k]`` with
   ``add_generation_prompt=True``, i.e. exactly the text a model is given before it writes turn ``k``.
   ``prompt_k`` must be a prefix of ``full`` (checked; else an error naming the row and the turn). The turn's
   target span starts at ``len(prompt_k)`` and ends after the first end-of-turn token that follows it.
3. The end-of-turn token is read off the template once, at load: the first special token that the template
   renders after an assistant message's content (``<|eot_id|>`` for Llama 3, ``<|im_end|>`` for Qwen2.5/3).
   An assistant content that holds that token's text is refused (the turn's end would be ambiguous).
4. Tokens: the text between spans and each span are encoded separately (no special tokens added: the template
   renders its own BOS), so no BPE merge crosses a target boundary; this is also how generation sees a turn (the
   prompt encoded, then the reply token by token). The result equals the template's own tokenization
   (``apply_chat_template(tokenize=True)``) except where an assistant content starts with whitespace that the
   pre-tokenizer would merge with the header's newline (e.g. a Qwen reply starting with ``"\\n"``).

So the targets are each assistant turn's rendered content and its own end-of-turn token (the model learns to
stop); the system prompt or date lines that a template injects (Llama 3.x "Cutting Knowledge Date" / "Today
Date", Qwen2.5's default system prompt), the role headers and the newline after an end-of-turn are never
targets. Exact for the Llama 3.x and Qwen2.5 templates. Qwen3's template renders the assistant turn after the
last user message with an empty ``<think>\\n\\n</think>\\n\\n`` block (earlier turns without it): that block is
part of the last turn's targets (what the model writes after the generation prompt). Templates that read the
clock (Llama 3.2's ``strftime_now`` date line) render a different prompt each day: pass ``date_string`` in
``chat_template_kwargs`` to pin it. ``{% generation %}`` markers are not needed and not used.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

__all__ = ["ROLE_CANDIDATES", "PretrainedTokenizer", "check_rendered", "resolve_tokenizer", "template_roles"]

# Files that define a tokenizer's vocabulary and template: their bytes make the cache key (``name``).
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
_PROBE = "\x00thdpack probe\x00"


class PretrainedTokenizer:
    """The tokenizer of a Hugging Face model directory.

    Args:
        directory: holds ``tokenizer.json`` / ``tokenizer_config.json`` (as saved by ``save_pretrained``).
        chat_template_kwargs: extra variables for the chat template (``date_string``, ``enable_thinking``, ...).

    Attributes:
        hf: the ``transformers`` tokenizer.
        vocab_size: ``len(hf)`` (added tokens included).
        eos_id: ``hf.eos_token_id`` (required); ``bos_id``: ``hf.bos_token_id``, else ``eos_id``;
            ``pad_id``: ``hf.pad_token_id``, else ``eos_id`` (pad never reaches the loss).
        has_chat_template: the directory ships a chat template; ``end_of_turn``: its end-of-turn token text.
        name: ``hf-`` and a hash of the tokenizer files and the template variables (cache keys).
    """

    def __init__(self, directory: str | Path, *, chat_template_kwargs: Mapping | None = None):
        directory = Path(directory)
        if not directory.is_dir():
            raise ValueError(f"tokenizer directory '{directory}' does not exist")
        try:
            from transformers import AutoTokenizer
        except ImportError as e:
            raise ImportError(
                f"the tokenizer of '{directory}' needs transformers: pip install 'thdpack[hf]' "
                "(or use dataset.tokenizer=byte)"
            ) from e
        try:
            self.hf = AutoTokenizer.from_pretrained(
                str(directory), local_files_only=True, trust_remote_code=False
            )
        except (OSError, ValueError) as e:
            raise ValueError(
                f"'{directory}' holds no tokenizer that transformers can load offline: {e}"
            ) from None
        self.directory = directory
        self.template_kwargs = dict(chat_template_kwargs or {})
        self.vocab_size = len(self.hf)
        if self.hf.eos_token_id is None:
            raise ValueError(
                f"{directory}/tokenizer_config.json names no eos_token: thdpack ends samples and turns with it"
            )
        self.eos_id = int(self.hf.eos_token_id)
        self.bos_id = int(self.hf.bos_token_id) if self.hf.bos_token_id is not None else self.eos_id
        self.pad_id = int(self.hf.pad_token_id) if self.hf.pad_token_id is not None else self.eos_id
        key = hashlib.sha256(repr(sorted(self.template_kwargs.items())).encode())
        for file in _TOKENIZER_FILES:
            if (directory / file).is_file():
                key.update(file.encode() + b"\0" + (directory / file).read_bytes())
        self.name = "hf-" + key.hexdigest()[:16]
        self.has_chat_template = bool(self.hf.chat_template)
        self.end_of_turn = self._find_end_of_turn() if self.has_chat_template else None
        self.chat_roles = (
            template_roles(self._render, self.hf.chat_template) if self.has_chat_template else None
        )

    def __repr__(self) -> str:
        return f"PretrainedTokenizer('{self.directory}', vocab_size={self.vocab_size})"

    def encode(self, text: str) -> np.ndarray:
        """int64 ``[L]``; no special tokens added (special-token text in ``text`` maps to its id)."""
        return np.asarray(self.hf.encode(text, add_special_tokens=False), dtype=np.int64)

    def encode_text(self, text: str) -> np.ndarray:
        """int64 ``[L]`` with the special tokens the tokenizer itself adds (``add_special_tokens=True``: BOS for
        Llama 3, nothing for Qwen)."""
        return np.asarray(self.hf.encode(text, add_special_tokens=True), dtype=np.int64)

    def decode(self, ids) -> str:
        """Text of ``ids``; special tokens are dropped."""
        return self.hf.decode(np.asarray(ids).reshape(-1).tolist(), skip_special_tokens=True)

    def _render(self, messages: Sequence[Mapping], generation_prompt: bool) -> str:
        return self.hf.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=generation_prompt, **self.template_kwargs
        )

    def _find_end_of_turn(self) -> str:
        where = f"the chat template of '{self.directory}'"
        try:
            text = self._render(
                [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}], False
            )
        except (
            Exception
        ) as e:  # a template raises whatever its authors chose (TemplateError, ValueError, ...)
            raise ValueError(f"{where} cannot render a user/assistant pair: {e}") from None
        tail = text[text.index(_PROBE) + len(_PROBE) :] if _PROBE in text else ""
        specials = set(self.hf.all_special_ids) | {
            i for i, t in self.hf.added_tokens_decoder.items() if getattr(t, "special", False)
        }
        for token_id in self.hf.encode(tail, add_special_tokens=False):
            if token_id in specials:
                return self.hf.convert_ids_to_tokens(token_id)
        raise ValueError(
            f"{where} renders no special token after an assistant message ({text!r}): thdpack cannot tell where "
            "an assistant turn ends"
        )

    def render_chat(
        self, messages: Sequence[Mapping], where: str = "messages"
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(tokens int64 [L], target_mask bool [L])`` of a conversation through the chat template; targets are
        the assistant turns (see the module docstring). ``where`` prefixes errors (``file:line``).

        ``messages``: ``[{"role": str, "content": str, ...}, ...]`` (other keys reach the template as given).
        """
        if not self.has_chat_template:
            raise ValueError(f"{where}: the tokenizer of '{self.directory}' has no chat template")
        full = self._render_checked(messages, False, where, "the conversation")
        check_rendered(messages, full, where, self.directory)
        pieces: list[tuple[str, bool]] = []
        position = 0
        for k, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            turn = f"messages[{k}]"
            if k == 0:
                raise ValueError(
                    f"{where}: {turn} is an assistant message with nothing before it: its prompt is the template "
                    "applied to the messages before it (start with a system or user message)"
                )
            if self.end_of_turn in str(message.get("content", "")):
                raise ValueError(
                    f"{where}: {turn}.content holds the end-of-turn token text '{self.end_of_turn}': the end of "
                    "the turn would be ambiguous"
                )
            prompt = self._render_checked(messages[:k], True, where, f"messages[:{k}]")
            if not full.startswith(prompt) or len(prompt) < position:
                raise ValueError(
                    f"{where}: the chat template renders messages[:{k}] with its generation prompt as text that is "
                    f"not a prefix of the whole conversation: {turn} cannot be located ({prompt[-60:]!r} vs "
                    f"{full[len(prompt) - 60 : len(prompt)]!r})"
                )
            end = full.find(self.end_of_turn, len(prompt))
            if end < 0:
                raise ValueError(
                    f"{where}: no '{self.end_of_turn}' after {turn} in the rendered conversation: its end is unknown"
                )
            end += len(self.end_of_turn)
            pieces += [(full[position : len(prompt)], False), (full[len(prompt) : end], True)]
            position = end
        if not pieces:
            raise ValueError(
                f"{where}: no assistant message: a chat sample needs at least one target token (loss is on the "
                "assistant turns only)"
            )
        pieces.append((full[position:], False))
        pieces = [(text, target) for text, target in pieces if text]
        encoded = self.hf([text for text, _ in pieces], add_special_tokens=False)["input_ids"]
        tokens = np.fromiter((i for ids in encoded for i in ids), dtype=np.int64)
        mask = np.concatenate(
            [np.full(len(ids), target, dtype=bool) for ids, (_, target) in zip(encoded, pieces, strict=True)]
        )
        return tokens, mask

    def _render_checked(self, messages, generation_prompt: bool, where: str, what: str) -> str:
        try:
            return self._render(messages, generation_prompt)
        except (
            Exception
        ) as e:  # a template raises whatever its authors chose (TemplateError, ValueError, ...)
            raise ValueError(f"{where}: the chat template cannot render {what}: {e}") from None


# Roles tried on every chat template at load, besides those its source compares message roles with.
ROLE_CANDIDATES = ("system", "user", "assistant", "tool", "developer", "ipython", "function")
_ROLE_LITERAL = re.compile(r"""role['"]?\]?\s*==\s*['"]([A-Za-z_]+)['"]""")


def template_roles(render: Callable[[list[dict], bool], str], source: str | None) -> frozenset[str]:
    """The roles whose content a chat template renders: :data:`ROLE_CANDIDATES` and the roles its ``source``
    compares a message's role with, each tried alone, after a user turn, after a user/assistant pair and before a
    user turn (templates that insist on an order raise on the others). ``render(messages, generation_prompt)``."""
    probe = "thdpack role probe 7f3a"  # plain text: a template may escape it (tojson) but keeps it
    names = dict.fromkeys([*ROLE_CANDIDATES, *_ROLE_LITERAL.findall(source or "")])
    known = set()
    for role in names:
        turn = {"role": role, "content": probe}
        for messages in (
            [turn],
            [{"role": "user", "content": "hi"}, turn],
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}, turn],
            [turn, {"role": "user", "content": "hi"}],
        ):
            try:
                if probe in render(messages, False):
                    known.add(role)
                    break
            except Exception:  # a template raises whatever its authors chose for an order it refuses
                continue
    return frozenset(known)


def check_rendered(messages: Sequence[Mapping], text: str, where: str, directory) -> None:
    """Raise ``ValueError`` naming ``where`` and the turn when the chat template's ``text`` of ``messages`` leaves out
    a turn: the last line of each turn's text content must appear in it, turn after turn (a template that drops a
    role it does not know would otherwise train on a conversation without that turn)."""
    position = 0
    for k, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, str):
            content = "\n".join(p.get("text", "") for p in content or [] if isinstance(p, Mapping))
        lines = [line.strip() for line in content.splitlines() if line.strip()]
        if not lines:
            continue
        last = lines[-1]
        found = text.find(last, position)
        if found < 0:  # a template may render a turn as JSON (Llama 3's tool turns: tojson)
            last = json.dumps(last)[1:-1]
            found = text.find(last, position)
        if found < 0:
            raise ValueError(
                f"{where}: messages[{k}] (role '{message.get('role')}') is not in the text the chat template of "
                f"'{directory}' renders: the template drops this turn"
            )
        position = found + len(last)


def resolve_tokenizer(
    spec: str | None, pretrained: str | None = None, chat_template_kwargs: Mapping | None = None
):
    """The dataset's tokenizer from the recipe: ``dataset.tokenizer`` (``spec``) and ``model.pretrained``.

    ``"auto"`` (or None): the pretrained directory's tokenizer when ``pretrained`` is set, else the byte tokenizer.
    ``"byte"``: :class:`~thdpack.data.tokenizer.ByteTokenizer`. A directory: :class:`PretrainedTokenizer`. A
    ``tokenizer.json`` file: :class:`~thdpack.data.tokenizer.HFTokenizer` (no chat template).
    """
    from thdpack.data.tokenizer import build_tokenizer

    if spec is None or spec == "auto":
        spec = pretrained or "byte"
    if spec != "byte" and Path(spec).is_dir():
        return PretrainedTokenizer(spec, chat_template_kwargs=chat_template_kwargs)
    if spec != "byte" and not Path(spec).exists():
        raise ValueError(
            f"dataset.tokenizer is '{spec}': it must be auto, byte, a Hugging Face model directory or a "
            "tokenizer.json file, and that path does not exist"
        )
    return build_tokenizer(spec)
