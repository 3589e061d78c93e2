"""Hugging Face ``tokenizer.json`` tokenizers (Qwen3's, Llama 3's from the hub, ...), read with the
`tokenizers` library that transformers' fast tokenizers are built on, so the ids are transformers' own.

``model.tokenizer_path`` names a ``tokenizer.json`` file (read alone) or a folder holding one, whose
``tokenizer_config.json``, when present, names the special tokens. The reader has the interface of the
tiktoken `Tokenizer` (tokenizer.py), except that ``bos_id`` may be None: Qwen3 has no BOS.
"""

import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as Backend

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
# Without a configured EOS, the special added token with the first of these names ends a document.
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
FIX = (
    "set model.tokenizer_path to a Hugging Face tokenizer.json (or a folder holding one) or to a tiktoken "
    "BPE file"
)


def tokenizer_file(path: str | Path) -> Path:
    """The file a tokenizer is read from, whose sha256 pre-tokenized data records: `path`, or the
    tokenizer.json of a Hugging Face tokenizer folder."""
    path = Path(path)
    return path / TOKENIZER_JSON if path.is_dir() else path


def _config_token(config: dict[str, Any], key: str, where: Path) -> str | None:
    """A special token of tokenizer_config.json: a string, an AddedToken dict ({"content": ...}) or null."""
    value = config[key]
    if isinstance(value, dict):
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise ValueError(
            f'{where}: {key} must be a token string, {{"content": token}} or null, got {config[key]!r}; '
            f"fix {TOKENIZER_CONFIG}"
        )
    return value


class HFTokenizer:
    """A tokenizer.json behind the tiktoken `Tokenizer`'s interface: ``model_path``, ``n_words``, ``bos_id``
    (None without BOS), ``eos_id``, ``encode(s, bos, eos)``, ``decode(ids)``, plus ``pad_id`` (or None).

    BOS, EOS and pad are tokenizer_config.json's bos_token, eos_token and pad_token where it has the key
    (null: none); BOS is none too when its add_bos_token is false. Without the config or the key, they
    come from tokenizer.json: BOS is the token its post-processor adds before a text, EOS the one it adds
    after, else the special added token named <|endoftext|>, <|end_of_text|>, </s> or <eos> (the first
    found); pad is its padding's token. Without BOS, ``encode(bos=True)`` adds nothing and documents are
    separated by EOS alone; a tokenizer without EOS is refused, as the data path ends documents with it.

    As with the tiktoken reader, text never produces special tokens ("<|endoftext|>" in a document is
    ordinary text, as transformers' split_special_tokens=True encodes it); BOS/EOS come from the flags only.
    Truncation and padding set in tokenizer.json are turned off: documents are encoded whole.
    """

    def __init__(self, path: str | Path):
        path = Path(path)
        file = tokenizer_file(path)
        self.model_path = str(file)  # pre-tokenized data is checked against this file's hash
        if not file.is_file():
            missing = f"{path} holds no {TOKENIZER_JSON}" if path.is_dir() else f"no such file {file}"
            raise FileNotFoundError(f"{missing}; {FIX}")
        raw = file.read_bytes()
        self._raw = raw
        try:
            json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{file} is not a tokenizer.json: not JSON ({e}); {FIX}") from None
        try:
            self._backend = Backend.from_buffer(raw)
        except Exception as e:  # the library raises a bare Exception for JSON it cannot read
            raise ValueError(f"{file} is not a tokenizer.json `tokenizers` can read ({e}); {FIX}") from None
        padding = self._backend.padding
        self._backend.no_truncation()
        self._backend.no_padding()
        self._backend.encode_special_tokens = True

        vocab = self._backend.get_vocab(with_added_tokens=True)
        if not vocab:
            raise ValueError(f"{file} has an empty vocabulary; {FIX}")
        self.n_words = max(vocab.values()) + 1  # embedding rows: ids may leave gaps

        config_path = path / TOKENIZER_CONFIG if path.is_dir() else None
        config = self._read_config(config_path) if config_path and config_path.is_file() else {}
        self.config = config  # chat templates read their special tokens and template from it
        self.folder = path if path.is_dir() else None
        before, after = self._post_processor_tokens()
        self.bos_id = self._special(config, "bos_token", config_path, before)
        if config.get("add_bos_token") is False:
            self.bos_id = None
        self.eos_id = self._special(config, "eos_token", config_path, after or self._named_eos())
        self.pad_id = self._special(config, "pad_token", config_path, padding and padding["pad_id"])
        if self.eos_id is None:
            raise ValueError(
                f"{file} has no EOS token (no eos_token in {TOKENIZER_CONFIG}, none added by its "
                f"post-processor, no special token named {', '.join(EOS_NAMES)}): documents are separated "
                f"by it; set eos_token in {TOKENIZER_CONFIG} beside it"
            )

    @staticmethod
    def _read_config(path: Path) -> dict[str, Any]:
        try:
            config = json.loads(path.read_bytes())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path} is not JSON ({e}); fix or remove it") from None
        if not isinstance(config, dict):
            raise ValueError(f"{path} is not a JSON object; fix or remove it")
        return config

    def _post_processor_tokens(self) -> tuple[int | None, int | None]:
        """The single tokens the post-processor adds before and after a text, found by encoding one."""
        plain = self._backend.encode("a", add_special_tokens=False).ids
        if not plain:  # "a" is not in its vocabulary: nothing to frame
            return None, None
        ids = self._backend.encode("a", add_special_tokens=True).ids
        start = next((i for i in range(len(ids) - len(plain) + 1) if ids[i : i + len(plain)] == plain), None)
        if start is None:
            return None, None
        before, after = ids[:start], ids[start + len(plain) :]
        return (before[0] if len(before) == 1 else None), (after[0] if len(after) == 1 else None)

    def _named_eos(self) -> int | None:
        special = {t.content: i for i, t in self._backend.get_added_tokens_decoder().items() if t.special}
        return next((special[name] for name in EOS_NAMES if name in special), None)

    def _special(
        self, config: dict[str, Any], key: str, config_path: Path | None, fallback: Any
    ) -> int | None:
        """The id of tokenizer_config.json's `key` where it has it, else `fallback`."""
        if key not in config:
            return fallback
        name = _config_token(config, key, config_path)
        if name is None:
            return None
        token_id = self._backend.token_to_id(name)
        if token_id is None:
            raise ValueError(
                f"{config_path}: {key} {name!r} is not a token of its {TOKENIZER_JSON}; fix {key} in it"
            )
        return token_id

    def encode(self, s: str, bos: bool, eos: bool) -> list[int]:
        """Token ids of ``s``, optionally framed by BOS (when the tokenizer has one) and EOS."""
        ids = [self.bos_id] if bos and self.bos_id is not None else []
        ids.extend(self._backend.encode(s, add_special_tokens=False).ids)
        if eos:
            ids.append(self.eos_id)
        return ids

    @functools.cached_property
    def _rendered_backend(self) -> Backend:
        """A reader that, unlike `encode`'s, makes special tokens of their text, as transformers reads a
        rendered chat template: "<|im_start|>" there is the token, not its characters."""
        backend = Backend.from_buffer(self._raw)
        backend.no_truncation()
        backend.no_padding()
        return backend

    def encode_rendered(self, s: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of a rendered chat template (special tokens read as tokens, none added) and each
        token's character span in `s`."""
        encoding = self._rendered_backend.encode(s, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        """The special added tokens (end-of-turn markers among them)."""
        return frozenset(i for i, t in self._backend.get_added_tokens_decoder().items() if t.special)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens included; byte sequences that are not UTF-8 become U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=False)
