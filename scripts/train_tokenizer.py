"""Train a small byte-level BPE on the bundled corpus and save it in tiktoken format or as a Hugging Face
tokenizer folder.

tiktoken (the default): the tokenizer uses the Llama 3 pre-tokenizer split pattern, so
`torchtitan.datasets.tokenizer.Tokenizer` loads it exactly like Meta's Llama 3 ``tokenizer.model``: one
``base64(token_bytes) rank`` line per token, ranks 0..255 the single bytes, then each merged token in the
order its merge was learned. tiktoken merges by rank, so every token's two merge parts must rank below it;
the script checks that before writing.

``--format hf``: a Qwen3-style folder read by `torchtitan.datasets.hf_tokenizer.HFTokenizer` and by
transformers: ``tokenizer.json`` (NFC normalization, Qwen2/3's split pattern, which keeps digits single,
byte-level BPE, then the special tokens <|endoftext|>, <|im_start|>, <|im_end|> after the learned
vocabulary, as Qwen's are) and ``tokenizer_config.json`` (no BOS; EOS and pad <|endoftext|>). The
bundled ``assets/tokenizer/kjv_bpe_hf`` was made by ``python scripts/train_tokenizer.py --format hf``
(vocabulary 2000 + 3 special tokens, from train.jsonl); the training is deterministic, so the same
corpus gives the same files byte for byte.

Usage: python scripts/train_tokenizer.py [--format tiktoken|hf] [--vocab-size 2000] [--output PATH]
"""

import argparse
import base64
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import tiktoken
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
from torchtitan.config.parser import OneLineParser, positive_int  # noqa: E402
from torchtitan.config.paths import check_file  # noqa: E402
from torchtitan.errors import run_with_exit_codes  # noqa: E402

LLAMA3_PAT_STR = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
# Qwen2/3's pattern: Llama 3's, with numbers split into single digits.
QWEN_PAT_STR = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
QWEN_EOS = "<|endoftext|>"
QWEN_SPECIAL_TOKENS = [QWEN_EOS, "<|im_start|>", "<|im_end|>"]


def gpt2_unicode_to_byte() -> dict[str, int]:
    """Invert GPT-2's byte -> printable-unicode table, the alphabet HF byte-level BPE tokens are spelled in.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes are shifted to code points 256+n.
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {chr(b): b for b in printable}
    shifted = (b for b in range(256) if b not in printable)
    for n, b in enumerate(shifted):
        table[chr(256 + n)] = b
    return table


def iter_documents(paths: list[Path]) -> Iterator[str]:
    for path in paths:
        with path.open(encoding="utf-8") as f:
            for line in f:
                yield json.loads(line)["text"]


def fit_bpe(tokenizer: Tokenizer, paths: list[Path], vocab_size: int) -> Tokenizer:
    """Learn the merges of `tokenizer` (its BPE model empty) on the documents: `vocab_size` tokens, the
    256 byte-level symbols included."""
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(iter_documents(paths), trainer=trainer)
    return tokenizer


def train_hf_bpe(paths: list[Path], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PAT_STR), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return fit_bpe(tokenizer, paths, vocab_size)


def to_tiktoken_ranks(tokenizer: Tokenizer) -> dict[bytes, int]:
    """Rank the 256 bytes first, then each merged token in merge order, as raw bytes."""
    to_byte = gpt2_unicode_to_byte()

    def raw(token: str) -> bytes:
        return bytes(to_byte[ch] for ch in token)

    ranks = {bytes([b]): b for b in range(256)}
    model = json.loads(tokenizer.to_str())["model"]
    for merge in model["merges"]:
        left, right = merge.split(" ") if isinstance(merge, str) else merge
        token = raw(left) + raw(right)
        if token in ranks:
            raise ValueError(f"merge {merge!r} produces a token that already has a rank")
        ranks[token] = len(ranks)
    if set(ranks) != {raw(t) for t in model["vocab"]}:
        raise ValueError("HF vocabulary is not the 256 bytes plus the merged tokens")
    return ranks


def train_qwen_style(paths: list[Path], vocab_size: int) -> Tokenizer:
    """Qwen3's tokenizer.json recipe at a small size: NFC, Qwen's split pattern, byte-level BPE of
    `vocab_size` tokens, then its special tokens after them (EOS <|endoftext|> first)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PAT_STR), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tokenizer.post_processor = processors.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False
    )
    tokenizer.decoder = decoders.ByteLevel()
    fit_bpe(tokenizer, paths, vocab_size)
    tokenizer.add_special_tokens(QWEN_SPECIAL_TOKENS)
    return tokenizer


def check_round_trip(tokenizer: Tokenizer, docs: list[str]) -> None:
    """Every document must decode back to itself (the corpus is NFC already, so NFC changes nothing)."""
    for doc in docs:
        if tokenizer.decode(tokenizer.encode(doc, add_special_tokens=False).ids) != doc:
            raise ValueError("HF tokenizer round trip failed")


def write_hf_folder(tokenizer: Tokenizer, folder: Path) -> None:
    """tokenizer.json and a Qwen3-style tokenizer_config.json: no BOS, EOS and pad <|endoftext|>."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": QWEN_EOS,
        "pad_token": QWEN_EOS,
        "unk_token": None,
        "additional_special_tokens": QWEN_SPECIAL_TOKENS[1:],
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "errors": "replace",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def check_merge_order(ranks: dict[bytes, int]) -> None:
    """Every multi-byte token must split into two tokens of lower rank, or tiktoken could not build it."""
    for token, rank in ranks.items():
        if len(token) == 1:
            continue
        if not any(
            ranks.get(token[:i], rank) < rank and ranks.get(token[i:], rank) < rank
            for i in range(1, len(token))
        ):
            raise ValueError(f"token {token!r} (rank {rank}) has no split into lower-ranked parts")


def check_matches_hf(tokenizer: Tokenizer, ranks: dict[bytes, int], docs: list[str]) -> None:
    """tiktoken must reproduce HF's tokenization and round-trip the text exactly."""
    enc = tiktoken.Encoding(name="check", pat_str=LLAMA3_PAT_STR, mergeable_ranks=ranks, special_tokens={})
    to_byte = gpt2_unicode_to_byte()
    for doc in docs:
        ids = enc.encode_ordinary(doc)
        if enc.decode(ids) != doc:
            raise ValueError("tiktoken round trip failed")
        hf_tokens = [bytes(to_byte[ch] for ch in t) for t in tokenizer.encode(doc).tokens]
        if [enc.decode_single_token_bytes(i) for i in ids] != hf_tokens:
            raise ValueError("tiktoken and HF tokenizations differ")


def write_tiktoken_file(ranks: dict[bytes, int], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="ascii") as f:
        for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
            f.write(f"{base64.b64encode(token).decode('ascii')} {rank}\n")


def main() -> int:
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--vocab-size", type=positive_int, default=2000, help="base vocabulary incl. the 256 bytes"
    )
    parser.add_argument(
        "--corpus", type=Path, nargs="+", default=[REPO_ROOT / "assets/corpus/kjv/train.jsonl"]
    )
    parser.add_argument(
        "--format",
        choices=["tiktoken", "hf"],
        default="tiktoken",
        help="a tiktoken BPE file, or a Qwen3-style Hugging Face tokenizer folder",
    )
    parser.add_argument(
        "--output",
        type=Path,
        help="default: assets/tokenizer/kjv_bpe.tiktoken, or the folder assets/tokenizer/kjv_bpe_hf",
    )
    args = parser.parse_args()
    if args.vocab_size <= 256:
        parser.error(f"argument --vocab-size: must exceed the 256 single-byte tokens, got {args.vocab_size}")
    for corpus in args.corpus:
        check_file("--corpus", str(corpus), text=True, fix="give .jsonl files with a 'text' field")

    if args.format == "hf":
        output = args.output or REPO_ROOT / "assets/tokenizer/kjv_bpe_hf"
        tokenizer = train_qwen_style(args.corpus, args.vocab_size)
        check_round_trip(tokenizer, list(iter_documents(args.corpus)))
        write_hf_folder(tokenizer, output)
        special = len(QWEN_SPECIAL_TOKENS)
        print(f"wrote {tokenizer.get_vocab_size()} tokens ({special} of them special) to {output}")
        return 0
    args.output = args.output or REPO_ROOT / "assets/tokenizer/kjv_bpe.tiktoken"
    tokenizer = train_hf_bpe(args.corpus, args.vocab_size)
    ranks = to_tiktoken_ranks(tokenizer)
    check_merge_order(ranks)
    check_matches_hf(tokenizer, ranks, list(iter_documents(args.corpus)))
    write_tiktoken_file(ranks, args.output)
    print(f"wrote {len(ranks)} tokens ({len(ranks) - 256} merges) to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(run_with_exit_codes(main))
