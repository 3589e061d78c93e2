import base64
import itertools
import json
from pathlib import Path

import pytest

from torchtitan.datasets.tokenizer import SPECIAL_TOKENS, Tokenizer, load_bpe_ranks

REPO_ROOT = Path(__file__).resolve().parents[1]
KJV_BPE = REPO_ROOT / "assets/tokenizer/kjv_bpe.tiktoken"


def write_bpe(path: Path, tokens: list[bytes]) -> Path:
    path.write_text("".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens)))
    return path


def single_bytes() -> list[bytes]:
    return [bytes([b]) for b in range(256)]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(KJV_BPE)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "In the beginning God created the heaven and the earth.",
        "Ünïcödé façade, ἐν ἀρχῇ ἦν ὁ λόγος, 日本語のテキスト, שָׁלוֹם",
        "emoji 👍🏽 family 👨‍👩‍👧 flags 🇫🇷🇯🇵",
        " " * 30_000 + "x" + "\n" * 30_000 + "\t \r\n" * 1000 + "y",
        "a" * 60_000 + "." * 30_000,
        "don't WE'LL they'RE 12345678 3.14159 \x00\x01\x7f",
    ],
    ids=["empty", "ascii", "unicode", "emoji", "whitespace_runs", "long_words", "misc"],
)
def test_round_trip(tok: Tokenizer, text: str):
    ids = tok.encode(text, bos=False, eos=False)
    assert all(0 <= i < tok.num_base_tokens for i in ids)
    assert tok.decode(ids) == text


def test_round_trip_one_megabyte(tok: Tokenizer):
    with open(REPO_ROOT / "assets/corpus/kjv/validation.jsonl") as f:
        prose = "\n\n".join(json.loads(line)["text"] for line in f)
    text = (prose + " ✝️ ")[:1_000_000]
    text = (text * (1_000_000 // len(text) + 1))[:1_000_000]
    ids = tok.encode(text, bos=True, eos=True)
    assert tok.decode(ids[1:-1]) == text
    # Compresses like real text: a few characters per token.
    assert len(ids) < len(text) / 3


def test_bos_eos(tok: Tokenizer):
    assert (tok.bos_id, tok.eos_id) == (tok.num_base_tokens, tok.num_base_tokens + 1)
    ids = tok.encode("Amen.", bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.encode("Amen.", bos=False, eos=False) == ids[1:-1]
    assert tok.encode("", bos=True, eos=True) == [tok.bos_id, tok.eos_id]
    assert tok.decode([tok.bos_id]) == "<|begin_of_text|>"


def test_special_tokens_not_produced_from_text(tok: Tokenizer):
    text = "<|begin_of_text|>hello<|end_of_text|><|eot_id|><|reserved_special_token_7|>"
    ids = tok.encode(text, bos=False, eos=False)
    assert max(ids) < tok.num_base_tokens
    assert tok.decode(ids) == text


def test_vocab_size_and_special_token_layout(tok: Tokenizer):
    assert tok.num_base_tokens == 2000
    assert tok.n_words == 2000 + 256
    assert len(SPECIAL_TOKENS) == len(set(SPECIAL_TOKENS)) == 256
    base = tok.num_base_tokens
    expected = {
        "<|begin_of_text|>": 0,
        "<|end_of_text|>": 1,
        "<|reserved_special_token_0|>": 2,
        "<|finetune_right_pad_id|>": 4,
        "<|reserved_special_token_2|>": 5,
        "<|start_header_id|>": 6,
        "<|eot_id|>": 9,
        "<|python_tag|>": 10,
        "<|reserved_special_token_3|>": 11,
        "<|reserved_special_token_247|>": 255,
    }
    assert {name: tok.special_tokens[name] - base for name in expected} == expected


def test_shipped_file_merge_ranks():
    ranks = load_bpe_ranks(KJV_BPE)
    assert [t for t, r in sorted(ranks.items(), key=lambda item: item[1])[:256]] == single_bytes()
    for token, rank in ranks.items():
        if len(token) > 1:
            assert any(
                ranks.get(token[:i], rank) < rank and ranks.get(token[i:], rank) < rank
                for i in range(1, len(token))
            ), token


def test_hand_made_bpe_file(tmp_path: Path):
    merges = [b"th", b"the", b" the", b"ee", b"thee"]  # ranks 256..260
    tok = Tokenizer(write_bpe(tmp_path / "tiny.tiktoken", single_bytes() + merges))
    assert tok.n_words == 256 + len(merges) + 256
    assert tok.encode("the", bos=False, eos=False) == [256 + merges.index(b"the")]
    # Lowest rank merges first: " t h e e" -> " th e e" -> " the e" -> " the" + "e", never "thee".
    assert tok.encode(" thee", bos=True, eos=False) == [tok.bos_id, 256 + merges.index(b" the"), ord("e")]
    assert tok.decode(tok.encode("thee the, théé!", bos=False, eos=False)) == "thee the, théé!"


def test_llama3_sized_vocab(tmp_path: Path):
    """A file with Llama 3's 128000 base tokens gives its ids: 128256 words, BOS 128000, <|eot_id|> 128009."""
    pairs = [bytes(p) for p in itertools.product(range(256), repeat=2)]
    triples = [p + bytes([c]) for p in pairs[: (128_000 - 256 - len(pairs)) // 256 + 1] for c in range(256)]
    tokens = (single_bytes() + pairs + triples)[:128_000]
    tok = Tokenizer(write_bpe(tmp_path / "tokenizer.model", tokens))
    assert tok.n_words == 128_256
    assert (tok.bos_id, tok.eos_id, tok.special_tokens["<|eot_id|>"]) == (128_000, 128_001, 128_009)
    text = "Llama 3 vocabulary, 128k tokens ✓"
    assert tok.decode(tok.encode(text, bos=False, eos=False)) == text


def test_missing_file(tmp_path: Path):
    path = tmp_path / "nope.tiktoken"
    with pytest.raises(FileNotFoundError, match="model.tokenizer_path") as err:
        Tokenizer(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize(
    "content",
    [
        "",
        "not base64!! 0\n",
        "AA== zero\n",
        "AA== 0 extra\n",
        "AA== 0\nAA== 1\n",  # duplicate token
        "AA== 0\nAQ== 2\n",  # gap in ranks
        '{"model": {"type": "BPE"}}\n',  # an HF tokenizer.json
    ],
)
def test_malformed_file(tmp_path: Path, content: str):
    path = tmp_path / "bad.tiktoken"
    path.write_text(content)
    with pytest.raises(ValueError, match="Malformed tokenizer file"):
        Tokenizer(path)
