"""Keep tests offline and out of the home folder; subprocesses inherit these variables."""

import os
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
