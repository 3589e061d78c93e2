"""Llama 3 style tiktoken tokenizer, and `build_tokenizer`, which picks the reader for a path.

Reads the same ``base64(token_bytes) rank`` BPE files as Meta's Llama 3 ``tokenizer.model``, so the real
128k vocabulary and the small bundled ``assets/tokenizer/kjv_bpe.tiktoken`` go through one code path.
Hugging Face ``tokenizer.json`` files are hf_tokenizer.py's.
"""

import base64
import binascii
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import tiktoken

from torchtitan.datasets.hf_tokenizer import HFTokenizer

# Llama 3 pre-tokenizer: contractions, words, numbers of up to 3 digits, punctuation runs, newlines, spaces.
LLAMA3_PAT_STR = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
NUM_SPECIAL_TOKENS = 256
# Named special tokens in Llama 3.1 order; the rest of the 256 are reserved placeholders.
_NAMED_SPECIAL_TOKENS = [
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
]
SPECIAL_TOKENS = _NAMED_SPECIAL_TOKENS + [
    f"<|reserved_special_token_{i}|>" for i in range(3, 3 + NUM_SPECIAL_TOKENS - len(_NAMED_SPECIAL_TOKENS))
]

# tiktoken slows down badly (and can overflow its stack) on huge inputs and on very long runs of
# whitespace or non-whitespace, so text is fed to it in bounded pieces, as in Meta's tokenizer.
TIKTOKEN_MAX_ENCODE_CHARS = 400_000
MAX_NO_WHITESPACES_CHARS = 25_000
_RUNS = re.compile(r"\s+|\S+")


def load_bpe_ranks(path: str | Path) -> dict[bytes, int]:
    """Parse a tiktoken BPE file: one ``base64(token_bytes) rank`` line per token, ranks 0..n-1."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"Tokenizer file not found: {path.resolve()}. Set model.tokenizer_path to a tiktoken BPE file, "
            "e.g. assets/tokenizer/kjv_bpe.tiktoken or a Llama 3 tokenizer.model."
        )
    ranks: dict[bytes, int] = {}
    with path.open("rb") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token_b64, rank_str = line.split()
                token = base64.b64decode(token_b64, validate=True)
                rank = int(rank_str)
            except (ValueError, binascii.Error) as e:
                raise ValueError(
                    f"Malformed tokenizer file {path}, line {line_no}: expected 'base64_token rank', "
                    f"got {line[:80]!r}"
                ) from e
            if not token or token in ranks:
                raise ValueError(f"Malformed tokenizer file {path}, line {line_no}: empty or duplicate token")
            ranks[token] = rank
    if not ranks:
        raise ValueError(f"Malformed tokenizer file {path}: no tokens")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"Malformed tokenizer file {path}: ranks must be exactly 0..{len(ranks) - 1}")
    return ranks


def _split_long_runs(s: str, max_run: int) -> Iterator[str]:
    """Cut ``s`` inside every whitespace or non-whitespace run longer than ``max_run`` characters."""
    if len(s) <= max_run:
        yield s
        return
    start = 0
    for run in _RUNS.finditer(s):
        for cut in range(run.start() + max_run, run.end(), max_run):
            yield s[start:cut]
            start = cut
    yield s[start:]


class Tokenizer:
    """Byte-level BPE tokenizer backed by ``tiktoken``, with Llama 3's split pattern and special tokens.

    Plain text never produces special tokens: ``encode`` treats "<|begin_of_text|>" in the input as ordinary
    text, and BOS/EOS are only added through its flags.
    """

    def __init__(self, model_path: str | Path):
        self.model_path = str(model_path)  # pre-tokenized data is checked against this file's hash
        mergeable_ranks = load_bpe_ranks(model_path)
        self.num_base_tokens = len(mergeable_ranks)
        self.special_tokens = {token: self.num_base_tokens + i for i, token in enumerate(SPECIAL_TOKENS)}
        self.model = tiktoken.Encoding(
            name=Path(model_path).name,
            pat_str=LLAMA3_PAT_STR,
            mergeable_ranks=mergeable_ranks,
            special_tokens=self.special_tokens,
        )

    @property
    def n_words(self) -> int:
        """Vocabulary size including the special tokens: the model's embedding size."""
        return self.model.n_vocab

    @property
    def bos_id(self) -> int:
        return self.special_tokens["<|begin_of_text|>"]

    @property
    def eos_id(self) -> int:
        return self.special_tokens["<|end_of_text|>"]

    def encode(self, s: str, bos: bool, eos: bool) -> list[int]:
        """Token ids of ``s``, optionally framed by BOS/EOS. Any length of input is fine."""
        ids = [self.bos_id] if bos else []
        for i in range(0, len(s), TIKTOKEN_MAX_ENCODE_CHARS):
            for piece in _split_long_runs(s[i : i + TIKTOKEN_MAX_ENCODE_CHARS], MAX_NO_WHITESPACES_CHARS):
                ids.extend(self.model.encode_ordinary(piece))
        if eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; byte sequences that are not valid UTF-8 become U+FFFD."""
        return self.model.decode(list(ids))


# Either reader: model_path, n_words, bos_id (None for a tokenizer without BOS), eos_id, encode, decode.
AnyTokenizer = Tokenizer | HFTokenizer


def build_tokenizer(path: str | Path) -> AnyTokenizer:
    """The tokenizer at ``model.tokenizer_path``: a folder or a ``.json`` file is a Hugging Face
    tokenizer (hf_tokenizer.py), anything else a tiktoken BPE file."""
    if Path(path).is_dir() or Path(path).suffix.lower() == ".json":
        return HFTokenizer(path)
    return Tokenizer(path)
