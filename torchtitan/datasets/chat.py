"""Conversations -> tokens and the mask of the tokens trained on (chat.loss_on).

A row of the user's data (chat.format: messages, ShareGPT or Alpaca) becomes a list of role/content
messages; the chat template (chat_template.py) renders it, and the tokenizer reads the text with its
special tokens. The trained tokens are, for loss_on assistant, each assistant turn's, its end-of-turn
token included (the model learns to stop): the ``{% generation %}`` spans of a template that has them,
else found by rendering prefixes of the conversation. A prefix whose tokens are not a prefix of the whole
render's (a template that rewrites earlier turns, e.g. dropping past thinking) makes the spans unknowable:
that conversation is refused, as is one with no trained token, and counted (`ChatCounts`).
"""

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from torchtitan.datasets.chat_template import ChatTemplate, TemplateRefused
from torchtitan.logging import logger

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant"}
SHAREGPT_ROLES |= {"assistant": "assistant", "tool": "tool"}
FORMAT_COLUMNS = {
    "messages": ("messages",),
    "sharegpt": ("conversations",),
    "alpaca": ("instruction", "output"),
}

Messages = list[dict[str, str]]


class ChatTokenizer(Protocol):
    special_ids: frozenset[int]

    def encode_rendered(self, s: str) -> tuple[list[int], list[tuple[int, int]]]: ...


def detect_format(columns: list[str], fmt: str) -> str:
    """chat.format, or with auto the one whose columns the data has."""
    if fmt != "auto":
        missing = [c for c in FORMAT_COLUMNS[fmt] if c not in columns]
        if missing:
            raise ValueError(f"chat.format {fmt}: the data has no {', '.join(missing)} column ({columns})")
        return fmt
    for name, needed in FORMAT_COLUMNS.items():
        if all(c in columns for c in needed):
            return name
    raise ValueError(
        f"chat.format auto: the columns {columns} are none of messages (messages), sharegpt "
        "(conversations) or alpaca (instruction, input, output); set chat.format or fix the data"
    )


def _message(role: Any, content: Any, where: str) -> dict[str, str]:
    if role not in ROLES:
        raise ValueError(f"{where}: unknown role {role!r} (roles: {', '.join(ROLES)})")
    if not isinstance(content, str):
        raise ValueError(f"{where}: a {role} message's content must be text, got {type(content).__name__}")
    return {"role": role, "content": content}


def to_messages(row: dict[str, Any], fmt: str) -> Messages:
    """A row of the data in `fmt` (detect_format's) as role/content messages."""
    if fmt == "alpaca":
        prompt = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
        return [_message("user", prompt, "alpaca"), _message("assistant", row["output"], "alpaca")]
    turns = row["messages"] if fmt == "messages" else row["conversations"]
    if not isinstance(turns, list) or not turns:
        raise ValueError(
            f"chat.format {fmt}: a conversation must be a non-empty list of messages, got {turns!r}"
        )
    if fmt == "messages":
        return [_message(t.get("role"), t.get("content"), "messages") for t in turns]
    return [
        _message(SHAREGPT_ROLES.get(t.get("from"), t.get("from")), t.get("value"), "sharegpt") for t in turns
    ]


@dataclass
class ChatCounts:
    """Conversations left out or cut, logged as they happen (at 1, 10, 100, ... of each kind)."""

    counts: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str) -> None:
        n = self.counts[kind] = self.counts.get(kind, 0) + 1
        if str(n).rstrip("0") == "1":
            logger.warning(f"Chat data: {n} conversation{'s' if n > 1 else ''} {kind} so far")


@dataclass(frozen=True)
class Encoded:
    """A conversation's tokens and, per token, whether it is a target of the loss."""

    ids: list[int]
    trained: list[bool]


class ChatEncoder:
    """Renders, tokenizes and masks conversations (loss_on: assistant, last_assistant or all), and fits
    each into `max_tokens` (overflow: truncate to its whole leading turns, or drop)."""

    def __init__(
        self, template: ChatTemplate, tokenizer: ChatTokenizer, loss_on: str, overflow: str, max_tokens: int
    ):
        self.template = template
        self.tokenizer = tokenizer
        self.loss_on = loss_on
        self.overflow = overflow
        self.max_tokens = max_tokens
        self.counts = ChatCounts()

    def _tokens(self, messages: Messages, add_generation_prompt: bool = False) -> list[int]:
        return self.tokenizer.encode_rendered(self.template.render(messages, add_generation_prompt)[0])[0]

    def encode_document(self, text: str) -> Encoded | None:
        """`encode` of a conversation as the chat streams hold it: JSON role/content messages."""
        return self.encode(json.loads(text))

    def encode(self, messages: Messages) -> Encoded | None:
        """The conversation to train on, cut to `max_tokens`; None (counted) where it is refused."""
        try:
            encoded = self._encode(messages)
        except TemplateRefused:
            self.counts.add("refused by the chat template")
            return None
        if encoded is None:
            return None
        if len(encoded.ids) > self.max_tokens:
            encoded = self._truncate(messages) if self.overflow == "truncate" else None
            self.counts.add("truncated" if encoded else "dropped as longer than training.seq_len")
        return encoded

    def _truncate(self, messages: Messages) -> Encoded | None:
        """The longest leading turns, ending with an assistant message, that fit and train a token."""
        for end in range(len(messages) - 1, 0, -1):
            if messages[end - 1]["role"] != "assistant":
                continue
            encoded = self._encode(messages[:end], count=False)
            if encoded is not None and len(encoded.ids) <= self.max_tokens:
                return encoded
        return None

    def _encode(self, messages: Messages, count: bool = True) -> Encoded | None:
        text, spans = self.template.render(messages)
        ids, offsets = self.tokenizer.encode_rendered(text)
        if self.loss_on == "all":
            trained = [True] * len(ids)
        elif self.template.has_generation:
            trained = _overlapping(offsets, spans[-1:] if self.loss_on == "last_assistant" else spans)
        else:
            trained = self._prefix_mask(messages, ids)
            if trained is None:
                if count:
                    self.counts.add("refused (a prefix render is not a token prefix of the whole render)")
                return None
        if not any(trained[1:]):  # the first token is never a target
            if count:
                self.counts.add("skipped (no trained token)")
            return None
        return Encoded(ids, trained)

    def _prefix_mask(self, messages: Messages, ids: list[int]) -> list[bool] | None:
        """Each assistant turn's tokens from rendering prefixes: from the end of the prompt before it
        (the generation prompt included) to its end-of-turn token (the last special token of the render
        through it; what follows is the template's spacing between turns). None where a prefix's tokens
        are not a prefix of `ids`."""
        trained = [False] * len(ids)
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if self.loss_on == "last_assistant":
            turns = turns[-1:]
        for turn in turns:
            prompt = self._tokens(messages[:turn], add_generation_prompt=True)
            through = self._tokens(messages[: turn + 1])
            if not (_is_prefix(prompt, ids) and _is_prefix(through, ids)):
                return None
            end = len(through)
            last_special = _last_index(through, self.tokenizer.special_ids.__contains__, len(prompt))
            if last_special is not None:
                end = last_special + 1
            trained[len(prompt) : end] = [True] * (end - len(prompt))
        return trained


def _is_prefix(prefix: list[int], ids: list[int]) -> bool:
    return len(prefix) <= len(ids) and ids[: len(prefix)] == prefix


def _last_index(ids: list[int], is_special: Callable[[int], bool], start: int) -> int | None:
    return next((i for i in range(len(ids) - 1, start - 1, -1) if is_special(ids[i])), None)


def _overlapping(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[bool]:
    """Tokens whose characters overlap a span, as transformers' assistant mask marks them."""
    return [
        any(start < span_end and end > span_start for span_start, span_end in spans) for start, end in offsets
    ]
