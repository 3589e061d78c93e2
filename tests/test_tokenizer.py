import base64
import itertools
import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import processors

from torchtitan.config.options import ConfigError
from torchtitan.config.parser import parse_args
from torchtitan.datasets.hf_tokenizer import HFTokenizer
from torchtitan.datasets.tokenizer import SPECIAL_TOKENS, Tokenizer, build_tokenizer, load_bpe_ranks
from torchtitan.models import build_model_args

REPO_ROOT = Path(__file__).resolve().parents[1]
KJV_BPE = REPO_ROOT / "assets/tokenizer/kjv_bpe.tiktoken"
KJV_HF = REPO_ROOT / "assets/tokenizer/kjv_bpe_hf"


def write_bpe(path: Path, tokens: list[bytes]) -> Path:
    path.write_text("".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens)))
    return path


def single_bytes() -> list[bytes]:
    return [bytes([b]) for b in range(256)]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(KJV_BPE)


ROUND_TRIP_TEXTS = [
    "",
    "In the beginning God created the heaven and the earth.",
    "Ünïcödé façade, ἐν ἀρχῇ ἦν ὁ λόγος, 日本語のテキスト, שָׁלוֹם",
    "emoji 👍🏽 family 👨‍👩‍👧 flags 🇫🇷🇯🇵",
    " " * 30_000 + "x" + "\n" * 30_000 + "\t \r\n" * 1000 + "y",
    "a" * 60_000 + "." * 30_000,
    "don't WE'LL they'RE 12345678 3.14159 \x00\x01\x7f",
]
ROUND_TRIP_IDS = ["empty", "ascii", "unicode", "emoji", "whitespace_runs", "long_words", "misc"]


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS, ids=ROUND_TRIP_IDS)
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


# Hugging Face tokenizer.json (hf_tokenizer.py): the bundled Qwen3-style folder and variants of it.


def corpus(splits: tuple[str, ...] = ("train", "validation")) -> list[str]:
    """The documents of the bundled corpus (by default every one)."""
    files = [REPO_ROOT / "assets/corpus/kjv" / f"{split}.jsonl" for split in splits]
    return [json.loads(line)["text"] for path in files for line in path.read_text().splitlines()]


def reference(folder: Path):
    """transformers' own fast tokenizer for the folder, loaded offline."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)


def hf_folder(folder: Path, backend: Backend, config: dict | None) -> Path:
    folder.mkdir()
    backend.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def llama3_style(special: tuple[str, ...] = ("<|begin_of_text|>", "<|end_of_text|>")) -> Backend:
    """The bundled BPE with Llama 3's special tokens (ids 2000, 2001) and a post-processor that puts BOS
    before every text, as Llama 3's tokenizer.json does."""
    bundled = Backend.from_file(str(KJV_HF / "tokenizer.json"))
    backend = Backend(bundled.model)
    backend.normalizer, backend.pre_tokenizer, backend.decoder = (
        bundled.normalizer,
        bundled.pre_tokenizer,
        bundled.decoder,
    )
    backend.add_special_tokens(list(special))
    backend.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A",
        pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", 2000)],
    )
    return backend


def test_hf_tokenizer_training_is_deterministic(tmp_path: Path):
    """scripts/train_tokenizer.py --format hf: the same corpus gives the same files, which read as a
    Qwen3-style tokenizer (the special tokens after the learned ones, no BOS)."""
    from scripts import train_tokenizer

    held_out = [REPO_ROOT / "assets/corpus/kjv/validation.jsonl"]
    for run in ("a", "b"):
        train_tokenizer.write_hf_folder(train_tokenizer.train_qwen_style(held_out, 300), tmp_path / run)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    tok = HFTokenizer(tmp_path / "a")
    assert (tok.n_words, tok.bos_id, tok.eos_id, tok.pad_id) == (303, None, 300, 300)


def test_build_tokenizer_picks_the_reader():
    assert type(build_tokenizer(KJV_BPE)) is Tokenizer
    for path in (KJV_HF, KJV_HF / "tokenizer.json", str(KJV_HF)):
        tok = build_tokenizer(path)
        assert type(tok) is HFTokenizer and tok.model_path == str(KJV_HF / "tokenizer.json")


def test_bundled_hf_tokenizer(hf_tok: HFTokenizer):
    """Qwen3-style: no BOS, <|endoftext|> ends documents and pads; 2000 learned tokens, 3 special ones."""
    assert (hf_tok.n_words, hf_tok.bos_id, hf_tok.eos_id, hf_tok.pad_id) == (2003, None, 2000, 2000)
    assert hf_tok.decode([2000, 2001, 2002]) == "<|endoftext|><|im_start|><|im_end|>"
    ids = hf_tok.encode("Amen.", bos=True, eos=True)
    assert ids == hf_tok.encode("Amen.", bos=False, eos=False) + [hf_tok.eos_id]
    assert hf_tok.encode("", bos=True, eos=True) == [hf_tok.eos_id]
    config = json.loads((KJV_HF / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == (None, *["<|endoftext|>"] * 2)


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS, ids=ROUND_TRIP_IDS)
def test_hf_round_trip(hf_tok: HFTokenizer, text: str):
    ids = hf_tok.encode(text, bos=False, eos=False)
    assert all(0 <= i < 2000 for i in ids)
    assert hf_tok.decode(ids) == text


def test_hf_ids_are_transformers_ids(hf_tok: HFTokenizer):
    """Every document of the corpus: our ids are transformers', which adds nothing with
    add_special_tokens=True for a tokenizer without BOS, as encode(bos=True) does; they decode back."""
    docs = corpus()
    framed = [hf_tok.encode(doc, bos=True, eos=True) for doc in docs]
    assert all(ids[-1] == hf_tok.eos_id for ids in framed)
    plain = [ids[:-1] for ids in framed]
    assert [hf_tok.encode(doc, bos=False, eos=False) for doc in docs[:50]] == plain[:50]  # bos: nothing
    theirs = reference(KJV_HF)
    assert (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id) == (None, 2000, 2000)
    assert theirs(docs, add_special_tokens=True)["input_ids"] == plain
    assert theirs(docs, add_special_tokens=False)["input_ids"] == plain
    assert [hf_tok.decode(ids) for ids in plain] == docs
    # Special tokens in text are text, as transformers' split_special_tokens=True has them.
    text = "<|endoftext|> and <|im_start|>"
    ids = hf_tok.encode(text, bos=False, eos=False)
    assert max(ids) < 2000 and hf_tok.decode(ids) == text
    assert theirs(text, split_special_tokens=True)["input_ids"] == ids
    assert theirs(text)["input_ids"][0] == 2000  # what we avoid: a document boundary made by its text


@pytest.mark.parametrize("with_config", [True, False], ids=["folder with config", "tokenizer.json alone"])
def test_bos_post_processor_ids_are_transformers_ids(tmp_path: Path, with_config: bool):
    """A Llama 3 style tokenizer.json whose post-processor adds BOS: transformers' add_special_tokens=True
    is our bos=True. Its tokenizer_config.json names BOS and EOS; without it, the post-processor gives
    BOS and EOS is the token named <|end_of_text|>."""
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"} if with_config else None
    folder = hf_folder(tmp_path / "llama", llama3_style(), config)
    tok = HFTokenizer(folder if with_config else folder / "tokenizer.json")
    assert (tok.n_words, tok.bos_id, tok.eos_id, tok.pad_id) == (2002, 2000, 2001, None)
    docs = corpus(("validation",))  # the same merges encode every document in the test above
    theirs = reference(folder)
    assert theirs(docs, add_special_tokens=True)["input_ids"] == [
        tok.encode(doc, bos=True, eos=False) for doc in docs
    ]
    plain = [tok.encode(doc, bos=False, eos=False) for doc in docs]
    assert theirs(docs, add_special_tokens=False)["input_ids"] == plain
    assert [tok.decode(ids) for ids in plain] == docs
    assert tok.encode("Amen.", bos=True, eos=True) == [2000, *tok.encode("Amen.", bos=False, eos=False), 2001]


@pytest.mark.parametrize(
    "config, special",
    [
        ({"bos_token": {"content": "<|im_start|>", "special": True}, "eos_token": {"content": "<|im_end|>"}},
         (2001, 2002, None)),
        ({"bos_token": "<|im_start|>", "add_bos_token": False, "pad_token": None}, (None, 2000, None)),
        ({}, (None, 2000, None)),
        (None, (None, 2000, None)),
    ],
    ids=["AddedToken dicts", "add_bos_token false", "no keys: tokenizer.json", "no config"],
)  # fmt: skip
def test_special_tokens_from_the_files(tmp_path: Path, config: dict | None, special: tuple):
    """(BOS, EOS, pad) of the bundled tokenizer.json beside another tokenizer_config.json, or none."""
    tok = HFTokenizer(hf_folder(tmp_path / "tok", Backend.from_file(str(KJV_HF / "tokenizer.json")), config))
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == special


def test_truncation_and_padding_in_tokenizer_json_are_off(tmp_path: Path, hf_tok: HFTokenizer):
    """A tokenizer.json saved with truncation and padding on: documents are still encoded whole, and its
    padding names the pad token."""
    backend = Backend.from_file(str(KJV_HF / "tokenizer.json"))
    backend.enable_truncation(max_length=4)
    backend.enable_padding(pad_id=2002, pad_token="<|im_end|>", length=64)
    tok = HFTokenizer(hf_folder(tmp_path / "tok", backend, None) / "tokenizer.json")
    text = "In the beginning God created the heaven and the earth."
    assert tok.encode(text, bos=False, eos=True) == hf_tok.encode(text, bos=False, eos=True)
    assert 4 < len(tok.encode(text, bos=False, eos=True)) < 64 and tok.pad_id == 2002


def test_hf_vocab_larger_than_model_vocab_size_is_refused():
    job = parse_args(["--model.tokenizer_path", str(KJV_HF), "--model.vocab_size", "2000"])
    with pytest.raises(
        ConfigError, match="model.vocab_size: 2000 is smaller than the tokenizer's 2003 tokens"
    ):
        build_model_args(job, build_tokenizer(job.model.tokenizer_path).n_words)
    assert build_model_args(parse_args(["--model.vocab_size", "2048"]), 2003).vocab_size == 2048


def write(folder: Path, name: str, content: str) -> Path:
    folder.mkdir(exist_ok=True)
    (folder / name).write_text(content)
    return folder


def bundled_with_config(tmp_path: Path, config: dict | str) -> Path:
    folder = hf_folder(tmp_path / "tok", Backend.from_file(str(KJV_HF / "tokenizer.json")), None)
    return write(folder, "tokenizer_config.json", config if isinstance(config, str) else json.dumps(config))


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda tmp: write(tmp / "t", "tokenizer.json", "{not json"), ValueError,
         r"is not a tokenizer.json: not JSON \(.*\); set model.tokenizer_path to"),
        (lambda tmp: write(tmp / "t", "tokenizer.json", '{"model": {"type": "BPE"}}'), ValueError,
         r"is not a tokenizer.json `tokenizers` can read \(.*\); set model.tokenizer_path to"),
        (lambda tmp: write(tmp / "t", "tokenizer_config.json", "{}"), FileNotFoundError,
         "holds no tokenizer.json; set model.tokenizer_path to"),
        (lambda tmp: bundled_with_config(tmp, "{oops"), ValueError, "tokenizer_config.json is not JSON"),
        (lambda tmp: bundled_with_config(tmp, {"eos_token": None}), ValueError,
         "has no EOS token .* set eos_token in tokenizer_config.json"),
        (lambda tmp: bundled_with_config(tmp, {"eos_token": "</s>"}), ValueError,
         "eos_token '</s>' is not a token of its tokenizer.json; fix eos_token in it"),
        (lambda tmp: bundled_with_config(tmp, {"bos_token": 7}), ValueError,
         "bos_token must be a token string"),
        (lambda tmp: hf_folder(tmp / "t", llama3_style(("<|begin_of_text|>",)), None), ValueError,
         "has no EOS token"),
    ],
    ids=["not JSON", "not a tokenizer", "no tokenizer.json", "config not JSON", "EOS null", "EOS unknown",
         "BOS not a token", "no EOS at all"],
)  # fmt: skip
def test_bad_hf_tokenizer(tmp_path: Path, make, error: type, message: str):
    with pytest.raises(error, match=message):
        build_tokenizer(make(tmp_path))
