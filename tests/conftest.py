"""Keep tests offline and out of the home folder; subprocesses inherit these variables."""

import json
import os
import runpy
import tempfile
from pathlib import Path

import pytest

_home = tempfile.mkdtemp(prefix="titan-tests-home-")
os.environ["WANDB_MODE"] = "disabled"
os.environ["WANDB_DIR"] = _home
os.environ["HF_HOME"] = os.path.join(_home, "hf")
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TIKTOKEN_CACHE_DIR"] = ""


@pytest.fixture(scope="module")
def hf_cache(tmp_path_factory: pytest.TempPathFactory):
    """HF's dataset cache in a temporary folder; `datasets` reads the location at call time."""
    import datasets

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf_cache")))
        yield


@pytest.fixture(scope="module")
def tok():
    """The bundled tokenizer."""
    from torchtitan.datasets.tokenizer import Tokenizer

    return Tokenizer(Path(__file__).resolve().parents[1] / "assets/tokenizer/kjv_bpe.tiktoken")


TEXT_DOCS = [f"Text {i}: " + "and it came to pass " * (i % 5 + 1) for i in range(30)]
TOKEN_DOCS = [f"Token {i}: " + "in the beginning " * (i % 3 + 2) for i in range(10)]


@pytest.fixture(scope="module")
def text_and_tokens(tmp_path_factory: pytest.TempPathFactory, hf_cache) -> tuple[Path, Path]:
    """A text file (TEXT_DOCS) and a pre-tokenized folder (TOKEN_DOCS): two kinds of mixture source."""
    root = Path(__file__).resolve().parents[1]
    tmp = tmp_path_factory.mktemp("sources")
    text, tokens = tmp / "text.jsonl", tmp / "tokens.jsonl"
    text.write_text("".join(json.dumps({"text": d}) + "\n" for d in TEXT_DOCS))
    tokens.write_text("".join(json.dumps({"text": d}) + "\n" for d in TOKEN_DOCS))
    run = runpy.run_path(str(root / "scripts" / "pretokenize.py"))["run"]
    job = ["--job.config_file", str(root / "train_configs" / "debug_model.toml")]
    assert run([*job, "--training.dataset_path", str(tokens), "--output", str(tmp / "tokens")]) == 0
    return text, tmp / "tokens"
