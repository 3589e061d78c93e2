"""Keep tests offline and out of the home folder; subprocesses inherit these variables."""

import json
import os
import runpy
import tempfile
from pathlib import Path

import pytest
from torch._inductor.runtime import cache_dir_utils

_home = tempfile.mkdtemp(prefix="titan-tests-home-")
os.environ["WANDB_MODE"] = "disabled"
os.environ["WANDB_DIR"] = _home
os.environ["HF_HOME"] = os.path.join(_home, "hf")
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TIKTOKEN_CACHE_DIR"] = ""
# torch.compile in this process writes inductor's cache folder into os.environ on first use: set now,
# the environment of the commands the tests launch stays the fork server's (tests/launch.py).
cache_dir_utils.cache_dir()

LOSS_CURVE_TEST = "test_the_default_recipe_trains_its_stored_curve"
_loss_curve_run = pytest.StashKey[tuple]()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """test_loss_curve.py's test runs last: its run (below) has the whole suite's idle time to finish in."""
    items.sort(key=lambda item: item.name == LOSS_CURVE_TEST)


def pytest_collection_finish(session: pytest.Session) -> None:
    """test_loss_curve.py's run (100 steps of training) starts once it is collected, at the lowest CPU
    priority: it trains in the time the other tests leave a core idle (waiting on a timeout, a process's
    start-up, a rendezvous) instead of adding its minutes to the suite's. Its numerics do not depend
    on the time it takes."""
    if any(item.name == LOSS_CURVE_TEST for item in session.items):
        from scripts import loss_curve

        folder = Path(tempfile.mkdtemp(prefix="loss-curve-"))
        session.config.stash[_loss_curve_run] = (loss_curve.start(folder, niceness=19), folder)


def pytest_sessionfinish(session: pytest.Session) -> None:
    process, _ = session.config.stash.get(_loss_curve_run, (None, None))
    if process is not None and process.poll() is None:  # its test did not run (a failure under -x)
        process.kill()
        process.wait()


@pytest.fixture(autouse=True)
def forked_chaos_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """scripts/chaos.py's ranks are forked from the fork server (tests/launch.py's start_forked)."""
    from launch import start_forked

    from scripts import chaos

    monkeypatch.setattr(chaos.Job, "popen", staticmethod(start_forked))


@pytest.fixture
def default_recipe_curve(request: pytest.FixtureRequest, tmp_path: Path) -> dict:
    """The default recipe's curve (scripts/loss_curve.py): the run started at collection, or one
    started now."""
    from scripts import loss_curve

    started = request.config.stash.get(_loss_curve_run, None)
    process, folder = started or (loss_curve.start(tmp_path), tmp_path)
    return loss_curve.finish(process, folder)


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


@pytest.fixture(scope="module")
def hf_tok():
    """The bundled Hugging Face tokenizer folder: Qwen3-style, without BOS."""
    from torchtitan.datasets.hf_tokenizer import HFTokenizer

    return HFTokenizer(Path(__file__).resolve().parents[1] / "assets/tokenizer/kjv_bpe_hf")


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


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory):
    """`reference_run(global_batch, model=())`: the tiny job (launch.TINY_JOB, with the model options
    `model`) on 1 process with the whole global batch, validated at steps 5 and 10 on a global
    validation batch of 4 (launch.VALIDATION), made on first use, once per session:
    scripts/parity_matrix.py's reference, which test_parity's layouts, test_train's and test_pipeline's
    are compared with. Its per-step metrics, each with the
    validation loss of its step (None where there was no validation)."""
    from scripts.parity_matrix import run_reference

    folder, runs = tmp_path_factory.mktemp("reference_runs"), {}

    def get(global_batch: int, model: tuple[str, ...] = ()) -> list[dict]:
        if (global_batch, model) not in runs:
            metrics = run_reference(folder / str(len(runs)), global_batch, 10, model)
            assert [m["step"] for m in metrics] == list(range(1, 11))
            validation = {m["step"]: m["validation_loss"] for m in metrics}
            validation = {step: loss for step, loss in validation.items() if loss is not None}
            assert sorted(validation) == [5, 10]
            assert validation[10] < validation[5]  # it learns, on held-out data too
            assert metrics[-1]["loss"] < metrics[0]["loss"] - 0.5  # it trains
            runs[global_batch, model] = metrics
        return runs[global_batch, model]

    return get
