"""A tokenizer's chat template, found and rendered as transformers' `apply_chat_template` renders it, so
that a conversation becomes the same text (and tokens) here as in the libraries that serve the model.

Rendering follows transformers': a sandboxed Jinja2 environment with trim_blocks and lstrip_blocks, the
loop controls, `raise_exception`, a `tojson` that does not escape HTML, and the tokenizer's named special
tokens (bos_token, eos_token, ...) as variables. A ``{% generation %}...{% endgeneration %}`` block marks
what the assistant generates: its character spans are recorded while rendering (chat.py trains on them).
"""

import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from torchtitan.config.paths import resolve_path

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
# transformers' named special tokens, passed to a template when the tokenizer has them.
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class TemplateRefused(ValueError):
    """The template raised on a conversation (`raise_exception`, or an error of its own)."""


class _GenerationSpans(Extension):
    """``{% generation %}``: renders its body unchanged and, while `spans` is set, appends the body's
    [start, end) character offsets in the whole render, told by the length of what was rendered so far."""

    tags = {"generation"}

    def __init__(self, environment: jinja2.Environment):
        super().__init__(environment)
        self.rendered: list[str] | None = None
        self.spans: list[tuple[int, int]] = []

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_record"), [], [], body).set_lineno(lineno)

    def _record(self, caller: Any) -> str:
        text = caller()
        if self.rendered is not None:
            start = sum(len(block) for block in self.rendered)
            self.spans.append((start, start + len(text)))
        return text


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class ChatTemplate:
    """One compiled template; `render` gives the text of a conversation and its generation spans."""

    def __init__(self, source: str, special_tokens: dict[str, str], origin: str):
        self.source = source
        self.origin = origin  # where it was read, named in errors
        self.has_generation = bool(_GENERATION_TAG.search(source))
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationSpans, loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._tracker = next(e for e in env.extensions.values() if isinstance(e, _GenerationSpans))
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise ValueError(f"the chat template {origin} does not compile: {e}") from None
        self._special_tokens = special_tokens

    def render(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = False
    ) -> tuple[str, list[tuple[int, int]]]:
        """The conversation's text and the character spans of its ``{% generation %}`` blocks."""
        rendered: list[str] = []
        self._tracker.rendered, self._tracker.spans = rendered, []
        try:
            for block in self._template.generate(
                messages=messages, add_generation_prompt=add_generation_prompt, **self._special_tokens
            ):
                rendered.append(block)
        except jinja2.TemplateError as e:
            raise TemplateRefused(
                f"the chat template {self.origin} does not render a conversation: {e}"
            ) from None
        finally:
            self._tracker.rendered = None
        return "".join(rendered), self._tracker.spans


def _config_template(config: dict[str, Any]) -> str | None:
    """tokenizer_config.json's chat_template: a string, or a list of named ones ("default" is used)."""
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def load_chat_template(
    folder: Path | None, config: dict[str, Any], template_path: str | None
) -> ChatTemplate:
    """The tokenizer's own template (chat_template.jinja beside its tokenizer.json, else its
    tokenizer_config.json's chat_template), else the file `template_path` (chat.template_path)."""
    special = {name: token for name in SPECIAL_TOKEN_NAMES if isinstance(token := _token(config, name), str)}
    if folder is not None and (folder / TEMPLATE_FILE).is_file():
        return ChatTemplate((folder / TEMPLATE_FILE).read_text(), special, str(folder / TEMPLATE_FILE))
    if (source := _config_template(config)) is not None:
        return ChatTemplate(source, special, f"of {folder / TOKENIZER_CONFIG}")
    if template_path is None:
        where = f"no {TEMPLATE_FILE} or chat_template in {TOKENIZER_CONFIG} in {folder}" if folder else "none"
        raise ValueError(
            f"the tokenizer has no chat template ({where}); set chat.template_path to a Jinja template file"
        )
    path = Path(resolve_path(template_path))
    if not path.is_file():
        raise FileNotFoundError(f"chat.template_path: no such file {template_path}")
    return ChatTemplate(path.read_text(), special, str(path))


def _token(config: dict[str, Any], name: str) -> str | None:
    """A special token of tokenizer_config.json, given as a string or as an AddedToken dict."""
    value = config.get(name)
    return value.get("content") if isinstance(value, dict) else value
