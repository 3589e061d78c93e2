"""Train a small byte-level BPE on the bundled corpus and save it in tiktoken format.

The tokenizer uses the Llama 3 pre-tokenizer split pattern, so `torchtitan.datasets.tokenizer.Tokenizer`
loads it exactly like Meta's Llama 3 ``tokenizer.model``: one ``base64(token_bytes) rank`` line per token,
ranks 0..255 the single bytes, then each merged token in the order its merge was learned. tiktoken merges
by rank, so every token's two merge parts must rank below it; the script checks that before writing.

Usage: python scripts/train_tokenizer.py [--vocab-size 2000] [--output assets/tokenizer/kjv_bpe.tiktoken]
"""

import argparse
import base64
import json
from collections.abc import Iterator
from pathlib import Path

import tiktoken
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

REPO_ROOT = Path(__file__).resolve().parent.parent
LLAMA3_PAT_STR = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


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


def train_hf_bpe(paths: list[Path], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PAT_STR), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(iter_documents(paths), trainer=trainer)
    return tokenizer


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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vocab-size", type=int, default=2000, help="base vocabulary incl. the 256 bytes")
    parser.add_argument(
        "--corpus", type=Path, nargs="+", default=[REPO_ROOT / "assets/corpus/kjv/train.jsonl"]
    )
    parser.add_argument("--output", type=Path, default=REPO_ROOT / "assets/tokenizer/kjv_bpe.tiktoken")
    args = parser.parse_args()
    if args.vocab_size <= 256:
        parser.error("--vocab-size must exceed the 256 single-byte tokens")

    tokenizer = train_hf_bpe(args.corpus, args.vocab_size)
    ranks = to_tiktoken_ranks(tokenizer)
    check_merge_order(ranks)
    check_matches_hf(tokenizer, ranks, list(iter_documents(args.corpus)))
    write_tiktoken_file(ranks, args.output)
    print(f"wrote {len(ranks)} tokens ({len(ranks) - 256} merges) to {args.output}")


if __name__ == "__main__":
    main()
