"""Conversations -> tokens and the mask of the tokens trained on (chat.loss_on).

A row of the user's data (chat.format: messages, ShareGPT or Alpaca) becomes a list of role/content
messages; the chat template (chat_template.py) renders it, and the tokenizer reads the text with its
special tokens. The trained tokens are, for loss_on assistant, each assistant turn's, its end-of-turn
token included (the model learns to stop): the ``{% generation %}`` spans of a template that has them,
else found by rendering prefixes of the conversation. A prefix whose tokens are not a prefix of the whole
render's (a template that rewrites earlier turns, e.g. Qwen3's dropping past reasoning) makes one render
unable to serve every turn: each assistant turn is then a sample of its own, the conversation up to it as
the template renders it at inference, only that turn trained. A conversation left out (the template raised,
a turn's prompt is no token prefix of the turn, no assistant turn, longer than seq_len) is counted
(`ChatCounts`).
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


# Where a message may hold its reasoning, the first the name templates read (Qwen3's, DeepSeek's):
# transformers' apply_chat_template passes it under that name whichever the data uses.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _message(role: Any, content: Any, where: str, turn: dict[str, Any] | None = None) -> dict[str, str]:
    if role not in ROLES:
        raise ValueError(f"{where}: unknown role {role!r} (roles: {', '.join(ROLES)})")
    if not isinstance(content, str):
        raise ValueError(f"{where}: a {role} message's content must be text, got {type(content).__name__}")
    message = {"role": role, "content": content}
    reasoning = next((turn[k] for k in REASONING_FIELDS if isinstance((turn or {}).get(k), str)), None)
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return message


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
        return [_message(t.get("role"), t.get("content"), "messages", t) for t in turns]
    return [
        _message(SHAREGPT_ROLES.get(t.get("from"), t.get("from")), t.get("value"), "sharegpt") for t in turns
    ]


# What a conversation left out or changed is counted as (ChatCounts), and what the nothing-to-train error
# says of each (chat_data.py).
REFUSED = "refused by the chat template"
UNMASKABLE = "refused (the prompt before an assistant turn is not a token prefix of the turn's render)"
NO_ASSISTANT = "skipped (no assistant turn)"
NO_TOKEN = "skipped (no trained token)"
TRUNCATED = "truncated"
DROPPED = "dropped as longer than training.seq_len"
PER_TURN = "trained as one sample per assistant turn (the template re-renders earlier turns)"


@dataclass
class ChatCounts:
    """Conversations left out, cut or split, each counted once however often it is read (every epoch,
    every resume, every stream's look-ahead): the first of each kind is logged as it happens, then
    `summary` once per epoch (chat_data.py). `extra_tokens` adds up what per-turn samples cost beyond one
    render of their conversations."""

    name: str = "(unnamed)"  # the dataset's path or name, in the log lines
    seen: dict[str, set[int]] = field(default_factory=dict)
    extra_tokens: int = 0

    @property
    def counts(self) -> dict[str, int]:
        return {kind: len(keys) for kind, keys in self.seen.items()}

    def add(self, kind: str, messages: Messages, extra_tokens: int = 0) -> None:
        keys = self.seen.setdefault(kind, set())
        key = hash(json.dumps(messages, sort_keys=True))
        if key in keys:
            return
        keys.add(key)
        self.extra_tokens += extra_tokens
        if len(keys) == 1:
            logger.warning(
                f"Chat data {self.name}: a conversation {kind} (each counted once; totals at epochs' ends)"
            )

    def summary(self) -> str:
        """One line: every kind's count so far."""
        parts = [f"{n} {kind}" for kind, n in self.counts.items()]
        if PER_TURN in self.seen:
            parts.append(f"per-turn samples costing {self.extra_tokens:,} tokens beyond one render of each")
        return f"Chat data {self.name}: {', '.join(parts) or 'every conversation trained whole'}"


@dataclass(frozen=True)
class Encoded:
    """A conversation's tokens and, per token, whether it is a target of the loss; `starts`: where each of
    its packed samples begins (one per assistant turn for a template that re-renders earlier turns)."""

    ids: list[int]
    trained: list[bool]
    starts: tuple[int, ...] = (0,)

    def samples(self) -> list["Encoded"]:
        """Each packed sample: a document of its own (positions from 0)."""
        ends = (*self.starts[1:], len(self.ids))
        return [Encoded(self.ids[a:b], self.trained[a:b]) for a, b in zip(self.starts, ends)]

    def longest(self) -> int:
        return max(b - a for a, b in zip(self.starts, (*self.starts[1:], len(self.ids))))


def _joined(samples: list[Encoded]) -> Encoded:
    starts = [0]
    for sample in samples[:-1]:
        starts.append(starts[-1] + len(sample.ids))
    ids = [t for s in samples for t in s.ids]
    return Encoded(ids, [m for s in samples for m in s.trained], tuple(starts))


class ChatEncoder:
    """Renders, tokenizes and masks conversations (loss_on: assistant, last_assistant or all), and fits
    each into `max_tokens` (overflow: truncate to its whole leading turns, or drop).

    Each assistant turn is trained in the context the template gives it at inference: the render of the
    conversation up to it. Where that render is a token prefix of the whole conversation's for every
    turn trained, one render serves them all (one sample); where not (a template that rewrites earlier
    turns, e.g. Qwen3's dropping their reasoning), each turn is a sample of its own: the conversation up
    to and including it, only its own tokens trained."""

    def __init__(
        self, template: ChatTemplate, tokenizer: ChatTokenizer, loss_on: str, overflow: str, max_tokens: int
    ):
        self.template = template
        self.tokenizer = tokenizer
        self.loss_on = loss_on
        self.overflow = overflow
        self.max_tokens = max_tokens
        self.counts = ChatCounts()
        self.refusal = ""  # the template's first error, named where nothing is left to train

    def why_nothing(self) -> str:
        """Why no conversation was kept (each kind counted and its fix), for the one-line refusal of a row
        of the global batch with nothing to train."""
        template = f"the chat template {self.template.origin}"
        fixes = {
            REFUSED: f" ({self.refusal})",
            UNMASKABLE: f": {template} renders the prompt before an assistant turn differently from the "
            "turn itself, so the turn's tokens cannot be told; add {% generation %} tags around its "
            "assistant turns or set chat.loss_on all",
            NO_ASSISTANT: f": chat.loss_on {self.loss_on} trains assistant turns; check the roles, or set "
            "chat.loss_on all",
            NO_TOKEN: f": {template} renders their assistant turns as no token",
            DROPPED: f" {self.max_tokens} under chat.overflow {self.overflow}"
            + (
                "; set chat.overflow truncate or raise training.seq_len"
                if self.overflow == "drop"
                else " (not even their first assistant turn fits); raise training.seq_len"
            ),
        }
        counts = self.counts.counts
        found = [f"{counts[kind]} {kind}{fix}" for kind, fix in fixes.items() if counts.get(kind)]
        return "; ".join(found) or "none of its conversations is kept"

    def _render(
        self, messages: Messages, add_generation_prompt: bool = False
    ) -> tuple[list[int], list[tuple[int, int]], list[tuple[int, int]]]:
        """Token ids, their character offsets and the ``{% generation %}`` spans of a render."""
        text, spans = self.template.render(messages, add_generation_prompt)
        ids, offsets = self.tokenizer.encode_rendered(text)
        return ids, offsets, spans

    def encode_document(self, text: str) -> Encoded | None:
        """`encode` of a conversation as the chat streams hold it: JSON role/content messages."""
        return self.encode(json.loads(text))

    def encode(self, messages: Messages) -> Encoded | None:
        """The conversation to train on, each sample within `max_tokens`; None (counted) where it is
        left out."""
        try:
            encoded = self._encode(messages)
            if encoded is not None and encoded.longest() > self.max_tokens:
                encoded = self._truncate(messages) if self.overflow == "truncate" else None
                self.counts.add(TRUNCATED if encoded else DROPPED, messages)
        except TemplateRefused as e:
            self.refusal = self.refusal or str(e)
            self.counts.add(REFUSED, messages)
            return None
        if encoded is not None and len(encoded.starts) > 1:
            # All samples but the last (the one render of the conversation up to its last turn) are extra.
            self.counts.add(PER_TURN, messages, extra_tokens=encoded.starts[-1])
        return encoded

    def _truncate(self, messages: Messages) -> Encoded | None:
        """The longest leading turns, ending with an assistant message, that fit and train a token."""
        for end in range(len(messages) - 1, 0, -1):
            if messages[end - 1]["role"] != "assistant":
                continue
            encoded = self._encode(messages[:end], count=False)
            if encoded is not None and encoded.longest() <= self.max_tokens:
                return encoded
        return None

    def _encode(self, messages: Messages, count: bool = True) -> Encoded | None:
        whole = self._render(messages)
        ids, offsets, spans = whole
        if self.loss_on == "all":
            return Encoded(ids, [True] * len(ids))
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if self.loss_on == "last_assistant":
            turns = turns[-1:]
        last = len(messages) - 1
        renders = {t: whole if t == last else self._render(messages[: t + 1]) for t in turns}
        if all(_is_prefix(renders[t][0], ids) for t in turns):
            samples = [self._one_render(messages, turns, renders, whole)]
        else:
            samples = [self._turn_sample(messages, t, renders[t]) for t in turns]
        kind = UNMASKABLE if None in samples else NO_ASSISTANT if not turns else NO_TOKEN
        trains = [s for s in samples if s is not None and any(s.trained[1:])]  # token 0 is no target
        if kind == UNMASKABLE or not trains:
            if count:
                self.counts.add(kind, messages)
            return None
        return _joined(trains)

    def _one_render(
        self, messages: Messages, turns: list[int], renders: dict, whole: tuple
    ) -> Encoded | None:
        """The conversation as one sample: its ``{% generation %}`` spans, or each turn's span found from
        the render up to it."""
        ids, offsets, spans = whole
        if self.template.has_generation:
            return Encoded(
                ids, _overlapping(offsets, spans[-1:] if self.loss_on == "last_assistant" else spans)
            )
        trained = [False] * len(ids)
        for turn in turns:
            span = self._turn_span(messages, turn, renders[turn][0])
            if span is None:
                return None
            trained[span[0] : span[1]] = [True] * (span[1] - span[0])
        return Encoded(ids, trained)

    def _turn_sample(self, messages: Messages, turn: int, render: tuple) -> Encoded | None:
        """Assistant turn `turn` alone trained, in `render`: that of the conversation up to it."""
        ids, offsets, spans = render
        if self.template.has_generation:
            return Encoded(ids, _overlapping(offsets, spans[-1:]))
        span = self._turn_span(messages, turn, ids)
        if span is None:
            return None
        return Encoded(ids, [span[0] <= i < span[1] for i in range(len(ids))])

    def _turn_span(self, messages: Messages, turn: int, through: list[int]) -> tuple[int, int] | None:
        """[start, end) of assistant turn `turn` in `through`, the tokens of the render up to it: from the
        end of the prompt before it (the generation prompt included) to its end-of-turn token (the last
        special token; what follows is the template's spacing between turns). None where the prompt's
        tokens are not a prefix of `through`."""
        prompt = self._render(messages[:turn], add_generation_prompt=True)[0]
        if not _is_prefix(prompt, through):
            return None
        last_special = _last_index(through, self.tokenizer.special_ids.__contains__, len(prompt))
        return len(prompt), len(through) if last_special is None else last_special + 1


def _is_prefix(prefix: list[int], ids: list[int]) -> bool:
    return len(prefix) <= len(ids) and ids[: len(prefix)] == prefix


def _last_index(ids: list[int], is_special: Callable[[int], bool], start: int) -> int | None:
    return next((i for i in range(len(ids) - 1, start - 1, -1) if is_special(ids[i])), None)


def _overlapping(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[bool]:
    """Tokens whose characters overlap a span, as transformers' assistant mask marks them."""
    return [
        any(start < span_end and end > span_start for span_start, span_end in spans) for start, end in offsets
    ]
