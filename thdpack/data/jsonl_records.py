"""One JSONL row of :mod:`thdpack.data.jsonl` checked and tokenized: :func:`check_record` (its kind, keys, types, the
ids' range), :func:`tokenize_record` (tokens and targets, through the tokenizer's chat template where it has one),
:func:`parse_record` (both). Used by the dataset and by the start-up pass over the file
(:mod:`thdpack.data.jsonl_index`)."""

from __future__ import annotations

import difflib

import numpy as np

__all__ = ["KINDS", "check_messages", "check_record", "check_role", "parse_record", "tokenize_record"]

KINDS = ("text", "input_ids", "prompt", "messages")


def parse_record(record, tokenizer, where: str) -> tuple[np.ndarray, np.ndarray | None]:
    """``(tokens int64 [L], target_mask bool [L] or None)`` of one decoded JSON line; ``where`` = ``file:line``."""
    kind = check_record(record, tokenizer.vocab_size, where, getattr(tokenizer, "chat_roles", None))
    return tokenize_record(record, kind, tokenizer, where)


def check_record(record, vocab_size: int, where: str, roles: frozenset[str] | None = None) -> str:
    """The line's kind (``"text"``, ``"input_ids"``, ``"prompt"``, ``"messages"``) after checking its keys and
    types (and the ids' range) without tokenizing; raises ``ValueError`` naming ``where`` and the rule. ``roles``:
    the roles the chat template renders (``PretrainedTokenizer.chat_roles``); a message of another role is refused
    (without a template, a role that looks like a misspelt common one is)."""
    if not isinstance(record, dict):
        raise ValueError(
            f"{where}: a JSON {type(record).__name__}, not an object: each line must be an object"
        )
    kinds = [k for k in KINDS if k in record]
    if len(kinds) != 1:
        found = "none" if not kinds else " and ".join(repr(k) for k in kinds)
        raise ValueError(
            f"{where}: {found} of the keys {list(KINDS)}: each line needs exactly one "
            "('prompt' goes with 'response')"
        )
    kind = kinds[0]
    if kind == "text":
        if not _string(record, "text", where):
            raise ValueError(f"{where}: 'text' is empty: an LM sample needs at least one token")
    elif kind == "input_ids":
        _ids(record["input_ids"], vocab_size, where)
    elif kind == "prompt":
        _string(record, "prompt", where)
        if not _string(record, "response", where):
            raise ValueError(f"{where}: 'response' is empty: an SFT sample needs at least one target token")
    else:
        check_messages(record["messages"], where, roles)
    return kind


def tokenize_record(record: dict, kind: str, tokenizer, where: str) -> tuple[np.ndarray, np.ndarray | None]:
    """Tokens and target mask of a line that :func:`check_record` accepted as ``kind``."""
    chat = getattr(tokenizer, "has_chat_template", False)
    if kind == "text":
        if hasattr(tokenizer, "encode_text"):
            tokens = tokenizer.encode_text(record["text"])
            if len(tokens) < 2:
                raise ValueError(
                    f"{where}: 'text' is {len(tokens)} token(s) long: an LM sample needs at least 2 (a target)"
                )
            return tokens, None
        return np.concatenate(
            [[tokenizer.bos_id], tokenizer.encode(record["text"]), [tokenizer.eos_id]]
        ), None
    if kind == "input_ids":
        return np.asarray(record["input_ids"], dtype=np.int64), None
    if kind == "prompt":
        if chat:
            messages = [
                {"role": "user", "content": record["prompt"]},
                {"role": "assistant", "content": record["response"]},
            ]
            return tokenizer.render_chat(messages, where)
        bos = np.array([tokenizer.bos_id], np.int64)
        eos = np.array([tokenizer.eos_id], np.int64)
        pieces = [
            (bos, False),
            (tokenizer.encode(record["prompt"]), False),
            (tokenizer.encode(record["response"]), True),
            (eos, True),
        ]
        return _join(pieces)
    if chat:
        return tokenizer.render_chat(record["messages"], where)
    return _tagged_messages(record["messages"], tokenizer)


def check_messages(messages, where: str, roles: frozenset[str] | None = None) -> None:
    """Check a ``messages`` list: objects with a string ``role`` and ``content``, each role one the chat template
    renders (``roles``; without a template only a misspelt common role is refused), every assistant turn with
    content, at least one assistant turn."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{'role': str, 'content': str}}")
    for turn, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"{where}: messages[{turn}] must be an object with a string 'role'")
        _string(message, "content", where, f"messages[{turn}].content")
        check_role(message["role"], turn, where, roles)
        if message["role"] == "assistant" and not message["content"].strip():
            raise ValueError(
                f"{where}: messages[{turn}] is an assistant turn with empty content: it would train on its "
                "end-of-turn token alone"
            )
    require_assistant([m["role"] for m in messages], where)


COMMON_ROLES = ("system", "user", "assistant", "tool")


def check_role(role: str, turn: int, where: str, roles: frozenset[str] | None) -> None:
    """Refuse ``role`` (of ``messages[turn]``) when the chat template does not render it (``roles``), or, without a
    template, when it is a near miss of a common role."""
    known = sorted(roles) if roles is not None else COMMON_ROLES
    if role in known:
        return
    close = difflib.get_close_matches(role, known, n=1, cutoff=0.75)
    if roles is None and not close:
        return  # thdpack's own tags render any role
    hint = f": did you mean '{close[0]}'?" if close else ":"
    whose = "the chat template renders" if roles is not None else "are common"
    raise ValueError(
        f"{where}: messages[{turn}] has role '{role}'{hint} The roles {whose} are {', '.join(known)} (a turn of "
        "another role would be dropped or never trained on)"
    )


def require_assistant(roles: list[str], where: str) -> None:
    if "assistant" not in roles:
        raise ValueError(
            f"{where}: no assistant message (the roles are {', '.join(repr(r) for r in dict.fromkeys(roles))}): "
            "a chat sample needs at least one target token (loss is on the assistant turns only)"
        )


def _tagged_messages(messages, tokenizer):
    """thdpack's own chat format (no chat template): ``<|role|>\\n`` tags, eos after every turn."""
    bos = np.array([tokenizer.bos_id], np.int64)
    eos = np.array([tokenizer.eos_id], np.int64)
    pieces = [(bos, False)]
    for message in messages:
        trained = message["role"] == "assistant"
        pieces += [
            (tokenizer.encode(f"<|{message['role']}|>\n"), False),
            (tokenizer.encode(message["content"]), trained),
            (eos, trained),
        ]
    return _join(pieces)


def _join(pieces):
    tokens = np.concatenate([p for p, _ in pieces]).astype(np.int64)
    targets = np.concatenate([np.full(len(p), t, dtype=bool) for p, t in pieces])
    return tokens, targets


def _string(record: dict, key: str, where: str, name: str | None = None) -> str:
    value = record.get(key)
    if not isinstance(value, str):
        got = "missing" if key not in record else f"a {type(value).__name__}"
        raise ValueError(f"{where}: '{name or key}' is {got}: it must be a string")
    return value


def _ids(value, vocab_size: int, where: str) -> None:
    rule = f"'input_ids' must be a list of at least 2 integers in [0, {vocab_size})"
    if not isinstance(value, list):
        raise ValueError(f"{where}: 'input_ids' is a {type(value).__name__}: {rule}")
    if len(value) < 2:
        raise ValueError(f"{where}: 'input_ids' has {len(value)} id(s), no target token: {rule}")
    try:
        ids = np.asarray(value)
    except (ValueError, OverflowError):  # nested lists, huge ints
        ids = np.asarray(value, dtype=object)
    if ids.ndim != 1 or ids.dtype.kind not in "iu":  # floats, strings, null, booleans (JSON true/false)
        raise ValueError(f"{where}: 'input_ids' holds non-integer values: {rule}")
    bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    if bad.size:
        raise ValueError(f"{where}: input_ids[{bad[0]}] = {ids[bad[0]]} is out of range: {rule}")
