import copy
import gzip
import json
import logging
import os
import re
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import datasets  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

from torchtitan.datasets.hf_datasets import HuggingFaceDataset, build_hf_data_loader, load_text_dataset  # noqa: E402
from torchtitan.datasets.tokenizer import Tokenizer  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
SEQ_LEN = 32
DOCS = [f"Document {i}: " + "and it came to pass " * (i % 7 + 1) for i in range(40)]


@pytest.fixture(autouse=True, scope="module")
def hf_cache(tmp_path_factory: pytest.TempPathFactory):
    """Keep HF's dataset cache out of the user's home; `datasets` reads the location at call time."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf_cache")))
        yield


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(REPO_ROOT / "assets/tokenizer/kjv_bpe.tiktoken")


@pytest.fixture(scope="module")
def docs_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("docs") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    return path


def loaders(tok, layout: tuple[int, int], dataset="kjv", path=None, seq_len=SEQ_LEN, **kwargs):
    """One loader per rank of a (dp_world_size, batch_size) layout."""
    world, batch = layout
    return [
        build_hf_data_loader(dataset, path, tok, batch, seq_len, world, rank, **kwargs)
        for rank in range(world)
    ]


def global_batches(rank_loaders, steps: int) -> list[torch.Tensor]:
    """The next `steps` global batches as windows (input plus last label), ranks concatenated in order."""
    iters = [iter(dl) for dl in rank_loaders]
    out = []
    for _ in range(steps):
        parts = [next(it) for it in iters]
        out.append(torch.cat([torch.cat([x, y[:, -1:]], dim=1) for x, y in parts]))
    return out


def token_stream(tok, docs: list[str]) -> list[int]:
    return [t for d in docs for t in tok.encode(d, bos=True, eos=True)]


def test_windows_and_label_shift(tok):
    (dl,) = loaders(tok, (1, 4))
    x, y = next(iter(dl))
    assert x.shape == y.shape == (4, SEQ_LEN) and x.dtype == y.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_stream_is_bos_doc_eos_concatenated(tok):
    with open(REPO_ROOT / "assets/corpus/kjv/train.jsonl") as f:
        first_docs = [json.loads(next(f))["text"] for _ in range(3)]
    expected = token_stream(tok, first_docs)
    n_windows = len(expected) // (SEQ_LEN + 1)
    windows = torch.cat(global_batches(loaders(tok, (1, 1)), n_windows)).flatten().tolist()
    assert windows == expected[: len(windows)]
    assert windows[0] == tok.bos_id
    assert [tok.eos_id, tok.bos_id] in [windows[i : i + 2] for i in range(len(windows) - 1)]
    assert tok.decode(windows[1:]).startswith("Genesis 1\n\nIn the beginning God created the heaven")


def test_layout_invariance(tok):
    steps = 6
    reference = global_batches(loaders(tok, (1, 4)), steps)
    for layout in [(2, 2), (4, 1)]:
        batches = global_batches(loaders(tok, layout), steps)
        for k in range(steps):
            assert torch.equal(batches[k], reference[k]), (layout, k)


def test_layout_invariance_across_epochs(tok, docs_file):
    """Re-looping continues the same global stream on every layout."""
    steps = 40  # the 40 short documents hold ~13 global batches of 4 windows
    reference = global_batches(loaders(tok, (1, 4), path=str(docs_file)), steps)
    batches = global_batches(loaders(tok, (2, 2), path=str(docs_file)), steps)
    assert all(torch.equal(a, b) for a, b in zip(batches, reference))


def test_resume(tok):
    (dl,) = loaders(tok, (1, 4))
    it = iter(dl)
    for _ in range(5):
        next(it)
    state = copy.deepcopy(dl.state_dict())
    expected = [next(it) for _ in range(4)]

    (resumed,) = loaders(tok, (1, 4))
    resumed.load_state_dict(state)
    got = [batch for batch, _ in zip(resumed, range(4))]
    for (x, y), (ex, ey) in zip(got, expected):
        assert torch.equal(x, ex) and torch.equal(y, ey)


def docs_loaders(tok, layout: tuple[int, int], streaming: bool) -> list[StatefulDataLoader]:
    """Loaders over DOCS held in memory, as a map-style or a streaming HF dataset (the C4 code path)."""
    world, batch = layout
    out = []
    for rank in range(world):
        # One source per rank, as in separate processes: a streaming HF dataset tracks its own position.
        ds = datasets.Dataset.from_dict({"text": DOCS})
        if streaming:
            ds = ds.to_iterable_dataset(num_shards=4)
        dataset = HuggingFaceDataset("docs", ds, tok, SEQ_LEN, batch, world, rank)
        out.append(StatefulDataLoader(dataset, batch_size=batch))
    return out


@pytest.mark.parametrize("streaming", [False, True], ids=["map", "streaming"])
def test_reshard_on_resume(tok, streaming):
    """Save on 2 ranks x 2, resume on 1 x 4, 4 x 1 and 1 x 8: the global stream goes on unchanged."""
    steps_before, steps_after = 7, 6  # 76 windows of the global stream: crosses the end of the data
    stream = torch.cat(
        global_batches(docs_loaders(tok, (1, 1), streaming), 4 * (steps_before + 2 * steps_after))
    )

    before = docs_loaders(tok, (2, 2), streaming)
    assert torch.equal(torch.cat(global_batches(before, steps_before)), stream[: 4 * steps_before])
    states = [dl.dataset.state_dict() for dl in before]
    info = {"dp_world_size", "dp_rank", "batch_size"}
    assert {k: v for k, v in states[0].items() if k not in info} == {
        k: v for k, v in states[1].items() if k not in info
    }
    for layout in [(1, 4), (4, 1), (1, 8)]:
        after = docs_loaders(tok, layout, streaming)
        for dl in after:
            dl.dataset.load_state_dict(copy.deepcopy(states[0]))
        start = 4 * steps_before
        n = layout[0] * layout[1] * steps_after
        assert torch.equal(torch.cat(global_batches(after, steps_after)), stream[start : start + n]), layout


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("streaming", [False, True], ids=["map", "streaming"])
def test_dcp_checkpoint_reshard(tok, streaming, tmp_path: Path):
    """The loader state survives torch.distributed.checkpoint, loaded into fresh loaders of another layout."""
    before = docs_loaders(tok, (2, 2), streaming)
    global_batches(before, 5)
    dcp.save({"dataloader": before[1]}, checkpoint_id=tmp_path)
    after = docs_loaders(tok, (4, 1), streaming)
    for dl in after:
        dcp.load({"dataloader": dl}, checkpoint_id=tmp_path)
    stream = torch.cat(global_batches(docs_loaders(tok, (1, 1), streaming), 4 * 8))
    assert torch.equal(torch.cat(global_batches(after, 3)), stream[4 * 5 :])


def test_reshard_stateful_dataloader(tok):
    """Same through StatefulDataLoader state dicts, as the checkpointer sees them."""
    before = loaders(tok, (2, 2))
    global_batches(before, 3)
    state = before[1].state_dict()
    expected = torch.cat(global_batches(loaders(tok, (1, 1)), 4 * 5)[12:])
    for layout in [(1, 4), (4, 1)]:
        after = loaders(tok, layout)
        for dl in after:
            dl.load_state_dict(state)
        assert torch.equal(torch.cat(global_batches(after, 2)), expected[:8]), layout


def test_infinite_relooping(tok, docs_file, caplog):
    stream = token_stream(tok, DOCS)
    window = SEQ_LEN + 1
    n_windows = 2 * len(stream) // window + 3  # well into the third epoch
    # The trainer's logger may not propagate to the root logger that caplog listens on.
    titan_logger = logging.getLogger("torchtitan")
    titan_logger.addHandler(caplog.handler)
    try:
        windows = torch.cat(global_batches(loaders(tok, (1, 1), path=str(docs_file)), n_windows))
    finally:
        titan_logger.removeHandler(caplog.handler)
    assert windows.flatten().tolist() == (stream * 3)[: n_windows * window]
    assert "re-looped" in caplog.text


def test_finite_stops_and_restarts(tok, docs_file):
    (dl,) = loaders(tok, (1, 4), path=str(docs_file), infinite=False)
    n_tokens = len(token_stream(tok, DOCS))
    first = [x for x, _ in dl]
    assert len(first) == n_tokens // (4 * (SEQ_LEN + 1))  # the incomplete last global batch is dropped
    second = [x for x, _ in dl]
    assert all(torch.equal(a, b) for a, b in zip(first, second)) and len(first) == len(second)


def test_kjv_validation_split():
    train = load_text_dataset("kjv")
    validation = load_text_dataset("kjv_validation")
    assert len(train) > 1000 and 10 < len(validation) < len(train) / 20
    assert validation[0]["text"].startswith("Genesis 50\n\n")
    assert not set(validation["text"]) & set(train["text"])
    assert len(load_text_dataset("kjv", split="validation")) == len(validation)


def test_local_formats(tmp_path: Path):
    docs = ["First doc.\n\nWith a blank line.", "Second ✓ doc", "Third"]
    (tmp_path / "a.jsonl").write_text(
        "".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs))
    )
    (tmp_path / "b.json").write_text(json.dumps([{"text": d} for d in docs]))
    with gzip.open(tmp_path / "c.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps({"text": d}) + "\n" for d in docs))
    datasets.Dataset.from_dict({"text": docs, "n": [1, 2, 3]}).to_parquet(str(tmp_path / "d.parquet"))
    txt_dir = tmp_path / "txt"
    txt_dir.mkdir()
    for i, d in enumerate(docs):
        (txt_dir / f"doc{i}.txt").write_text(d)
    (txt_dir / "README.md").write_text("ignored")

    for name in ["a.jsonl", "b.json", "c.jsonl.gz", "d.parquet"]:
        ds = load_text_dataset("my_data", str(tmp_path / name))
        assert ds["text"] == docs and ds.column_names == ["text"], name
    assert sorted(load_text_dataset("my_data", str(txt_dir))["text"]) == sorted(docs)
    assert load_text_dataset("my_data", str(txt_dir / "doc0.txt"))["text"] == docs[:1]


def test_local_folder_splits(tok, tmp_path: Path):
    for split in ["train", "validation"]:
        (tmp_path / f"{split}.jsonl").write_text(json.dumps({"text": f"{split} text"}) + "\n")
    assert load_text_dataset("c4", str(tmp_path))["text"] == ["train text"]
    assert load_text_dataset("c4", str(tmp_path), split="validation")["text"] == ["validation text"]
    assert load_text_dataset("kjv_validation", str(tmp_path))["text"] == ["validation text"]
    with pytest.raises(ValueError, match="No files for split 'test'"):
        load_text_dataset("c4", str(tmp_path), split="test")
    (dl,) = loaders(tok, (1, 1), "c4", str(tmp_path), seq_len=2, infinite=False)
    assert tok.decode(torch.cat([torch.cat([x[0], y[0, -1:]]) for x, y in dl]).tolist()).startswith(
        "<|begin_of_text|>train text"
    )


def test_unknown_dataset():
    with pytest.raises(
        ValueError, match="Unknown dataset 'nope'.*c4, kjv, kjv_validation.*training.dataset_path"
    ):
        load_text_dataset("nope")


def test_missing_path(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "missing"))):
        load_text_dataset("kjv", str(tmp_path / "missing"))


@pytest.mark.parametrize("content", ["", '{"title": "no text field"}\n'])
def test_empty_or_textless_dataset(tmp_path: Path, content: str):
    (tmp_path / "data.jsonl").write_text(content)
    with pytest.raises(ValueError, match="is empty|no 'text' field"):
        load_text_dataset("my_data", str(tmp_path / "data.jsonl"))
