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

from torchtitan.config.parser import parse_args  # noqa: E402
from torchtitan.config.paths import resolve_path  # noqa: E402
from torchtitan.config_rules import validation_batch_size  # noqa: E402
from torchtitan.datasets.build import DataSource, build_dataset  # noqa: E402
from torchtitan.datasets.layout import BatchLayout  # noqa: E402
from torchtitan.datasets.loader import DataLoader  # noqa: E402
from torchtitan.datasets.sources import load_text_dataset  # noqa: E402
from torchtitan.datasets.text import TextDataset as HuggingFaceDataset  # noqa: E402
from torchtitan.datasets.tokenizer import Tokenizer, build_tokenizer  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
SEQ_LEN = 32
DOCS = [f"Document {i}: " + "and it came to pass " * (i % 7 + 1) for i in range(40)]


pytestmark = pytest.mark.usefixtures("hf_cache")


@pytest.fixture(scope="module")
def docs_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("docs") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    return path


def rank_loaders(
    tok, source: DataSource, layout: tuple[int, ...], seq_len: int, num_workers: int = 0, **kwargs
) -> list[DataLoader]:
    """One loader of `source` per rank of a (dp_world_size, batch_size[, grad_accum_steps]) layout."""
    world, batch, accum = (*layout, 1)[:3]
    return [
        DataLoader(
            build_dataset(source, tok, seq_len, BatchLayout(batch, world, rank, accum), **kwargs),
            batch,
            num_workers,
        )
        for rank in range(world)
    ]


def loaders(tok, layout: tuple[int, ...], dataset="kjv", path=None, seq_len=SEQ_LEN, **kwargs):
    """One loader per rank of a (dp_world_size, batch_size[, grad_accum_steps]) layout."""
    return rank_loaders(tok, DataSource(dataset, path), layout, seq_len, **kwargs)


def docs_loaders(tok, layout: tuple[int, ...], docs_file: Path, streaming: bool, **kwargs):
    """Loaders over DOCS as a map-style or a streaming HF dataset (the C4 code path), one per rank."""
    world, batch, accum = (*layout, 1)[:3]
    out = []
    for rank in range(world):
        # One source per rank, as in separate processes: a streaming HF dataset has its own reader.
        dataset = HuggingFaceDataset(
            "docs", docs_source(docs_file, streaming), tok, SEQ_LEN, batch, world, rank, accum, **kwargs
        )
        out.append(DataLoader(dataset, batch))
    return out


def docs_source(docs_file: Path, streaming: bool) -> datasets.Dataset | datasets.IterableDataset:
    if streaming:
        return datasets.load_dataset("json", data_files=str(docs_file), split="train", streaming=True)
    return load_text_dataset("docs", str(docs_file))


def global_batches(rank_loaders, steps: int, accum: int = 1) -> list[torch.Tensor]:
    """The next `steps` global batches as windows (input plus last label): for each of the `accum`
    micro-batches of a step, the ranks' rows in rank order."""
    iters = [iter(dl) for dl in rank_loaders]
    out = []
    for _ in range(steps):
        parts = [next(it) for _ in range(accum) for it in iters]
        out.append(torch.cat([torch.cat([b.inputs, b.labels[:, -1:]], dim=1) for b in parts]))
    return out


def token_stream(tok, docs: list[str]) -> list[int]:
    return [t for d in docs for t in tok.encode(d, bos=True, eos=True)]


def reference_batches(
    tok, docs: list[str], num_streams: int, steps: int, seq_len=SEQ_LEN
) -> list[torch.Tensor]:
    """The definition, computed without the loader: row j of global batch k is window k of stream j, the
    BOS/doc/EOS tokens of documents j, j + S, j + 2S, ... (S = num_streams), epoch after epoch."""
    return stream_batches(tok, [docs[j::num_streams] for j in range(num_streams)], steps, seq_len)


def stream_batches(tok, stream_docs: list[list[str]], steps: int, seq_len=SEQ_LEN) -> list[torch.Tensor]:
    """Row j of global batch k is window k of the BOS/doc/EOS tokens of `stream_docs[j]`, epoch after
    epoch."""
    window = seq_len + 1
    rows = []
    for docs in stream_docs:
        tokens: list[int] = []
        while len(tokens) < steps * window:
            for d in docs:
                tokens += tok.encode(d, bos=True, eos=True)
                if len(tokens) >= steps * window:
                    break
        rows.append(torch.tensor(tokens[: steps * window]).view(steps, window))
    return [torch.stack([r[k] for r in rows]) for k in range(steps)]


def all_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def kjv_docs() -> list[str]:
    with open(REPO_ROOT / "assets/corpus/kjv/train.jsonl") as f:
        return [json.loads(line)["text"] for line in f]


def merged_state(rank_loaders) -> dict:
    """The ranks' loader states merged, as DCP merges the keys every rank saves."""
    state = copy.deepcopy(rank_loaders[0].state_dict())
    for dl in rank_loaders[1:]:
        for key, streams in dl.state_dict()["dataset_state"].items():
            state["dataset_state"][key].update(copy.deepcopy(streams))
    return state


class CountingTokenizer:
    """Counts the tokens it encodes."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.count = 0

    def encode(self, s: str, bos: bool, eos: bool) -> list[int]:
        ids = self.tok.encode(s, bos=bos, eos=eos)
        self.count += len(ids)
        return ids


def test_windows_and_label_shift(tok):
    (dl,) = loaders(tok, (1, 4))
    batch = next(iter(dl))
    x, y = batch.inputs, batch.labels
    assert batch.positions is None and x.shape == y.shape == (4, SEQ_LEN) and x.dtype == y.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_stream_is_bos_doc_eos_concatenated(tok):
    """With a global batch of one, the single stream is every document with BOS/EOS, in order."""
    expected = token_stream(tok, kjv_docs()[:3])
    n_windows = len(expected) // (SEQ_LEN + 1)
    windows = torch.cat(global_batches(loaders(tok, (1, 1)), n_windows)).flatten().tolist()
    assert windows == expected[: len(windows)]
    assert windows[0] == tok.bos_id
    assert [tok.eos_id, tok.bos_id] in [windows[i : i + 2] for i in range(len(windows) - 1)]
    assert tok.decode(windows[1:]).startswith("Genesis 1\n\nIn the beginning God created the heaven")


def test_stream_without_bos_is_doc_eos_concatenated(hf_tok):
    """A tokenizer without BOS (Qwen3-style): documents are separated by EOS alone."""
    first = hf_tok.encode(kjv_docs()[0], bos=False, eos=False)
    expected = token_stream(hf_tok, kjv_docs()[:3])
    assert expected[: len(first) + 1] == [*first, hf_tok.eos_id]
    n_windows = len(expected) // (SEQ_LEN + 1)
    windows = torch.cat(global_batches(loaders(hf_tok, (1, 1)), n_windows)).flatten().tolist()
    assert windows == expected[: len(windows)] and windows.count(hf_tok.eos_id) == 2
    assert hf_tok.decode(windows).startswith("Genesis 1\n\nIn the beginning God created the heaven")
    assert "<|endoftext|>Genesis 2\n\n" in hf_tok.decode(windows)


def test_rows_are_streams_of_dealt_documents(tok):
    """Global row j reads documents j, j + S, ...: row 1 of the first batch starts with chapter 2."""
    steps = 40  # past the first chapter of every stream
    batches = global_batches(loaders(tok, (2, 2)), steps)
    assert all_equal(batches, reference_batches(tok, kjv_docs(), 4, steps))
    assert tok.decode(batches[0][1, 1:].tolist()).startswith("Genesis 2\n\n")


LAYOUTS = [(1, 4), (2, 2), (4, 1), (1, 2, 2), (2, 1, 2), (1, 1, 4)]  # (ranks, batch, micro-batches)


@pytest.mark.parametrize("streaming", [False, True], ids=["map", "streaming"])
def test_layout_invariance(tok, docs_file, streaming):
    """Every layout with a global batch of 4 gives the reference batches, across epochs (40 documents of
    ~25 tokens: each stream re-loops every ~8 windows)."""
    steps = 20
    reference = reference_batches(tok, DOCS, 4, steps)
    for layout in LAYOUTS:
        batches = global_batches(docs_loaders(tok, layout, docs_file, streaming), steps, (*layout, 1)[2])
        for k in range(steps):
            assert torch.equal(batches[k], reference[k]), (layout, k)


def dealt_to_streams(files: list[list[str]], num_streams: int) -> list[list[str]]:
    """Each stream's documents from a streaming source's files, by the definition: G = min(F, S) groups,
    file f and stream s in group f % G and s % G, a group's documents (its files in order) dealt in turn to
    its streams."""
    groups = min(len(files), num_streams)
    out = []
    for s in range(num_streams):
        members = range(s % groups, num_streams, groups)
        docs = [d for f in files[s % groups :: groups] for d in f]
        out.append(docs[members.index(s) :: len(members)])
    return out


def sharded_loaders(tok, layout: tuple[int, ...], paths: list[Path], read: list[str] | None = None):
    """Loaders over a streaming source of several files, one per rank; `read` collects what is read."""
    world, batch, accum = (*layout, 1)[:3]
    out = []
    for rank in range(world):
        ds = datasets.load_dataset("json", data_files=[str(p) for p in paths], split="train", streaming=True)
        if read is not None:
            ds = ds.map(lambda example: read.append(example["text"]) or example)
        out.append(DataLoader(HuggingFaceDataset("docs", ds, tok, SEQ_LEN, batch, world, rank, accum), batch))
    return out


@pytest.mark.parametrize("sizes", [(9, 3, 8, 5, 10, 5), (20, 12, 8)], ids=["6_files", "3_files"])
def test_streaming_files_dealt_to_groups_of_streams(tok, tmp_path, sizes):
    """A streaming source's files go to groups of streams (6 files: one group per stream; 3 files, fewer
    than the 4 streams: streams 0 and 3 share file 0): every layout gives the same batches, across epochs,
    a state saved on one layout resumes on the others, and a rank reads only its groups' files."""
    files = [DOCS[sum(sizes[:f]) : sum(sizes[: f + 1])] for f in range(len(sizes))]
    paths = [tmp_path / f"part-{f}.jsonl" for f in range(len(files))]
    for path, docs in zip(paths, files):
        path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    steps, resumed_at = 16, 7
    reference = stream_batches(tok, dealt_to_streams(files, 4), steps)
    for layout in LAYOUTS:
        batches = global_batches(sharded_loaders(tok, layout, paths), steps, (*layout, 1)[2])
        assert all_equal(batches, reference), layout

    before = sharded_loaders(tok, (2, 2), paths)
    global_batches(before, resumed_at)
    state = merged_state(before)
    for layout in [(1, 4), (4, 1), (1, 2, 2)]:
        after = sharded_loaders(tok, layout, paths)
        for dl in after:
            dl.load_state_dict(copy.deepcopy(state))
        assert all_equal(global_batches(after, steps - resumed_at, (*layout, 1)[2]), reference[resumed_at:])

    read: list[str] = []
    global_batches(sharded_loaders(tok, (4, 1), paths, read)[:1], steps)
    own = set(dealt_to_streams(files, 4)[0])
    assert own <= set(read) and set(read) <= {d for f in files[:: min(len(files), 4)] for d in f}


def test_layout_invariance_kjv(tok):
    steps = 6
    reference = global_batches(loaders(tok, (1, 4)), steps)
    for layout in [(2, 2), (4, 1), (1, 2, 2)]:
        batches = global_batches(loaders(tok, layout), steps, (*layout, 1)[2])
        assert all_equal(batches, reference), layout


@pytest.mark.parametrize("streaming", [False, True], ids=["map", "streaming"])
def test_each_rank_tokenizes_its_share(tok, streaming):
    """Simulated DP 4 and 8 (a rank each, batch 1 or 2): a rank tokenizes at most 1.25x the tokens it
    yields (the old global stream tokenized DP x). The first documents are read ahead, so run a while."""
    kjv = REPO_ROOT / "assets/corpus/kjv/train.jsonl"
    seq_len, steps = 128, 60
    for world, batch in [(4, 2), (8, 1)]:
        for rank in range(world):
            counter = CountingTokenizer(tok)
            if streaming:
                ds = datasets.load_dataset("json", data_files=str(kjv), split="train", streaming=True)
            else:
                ds = load_text_dataset("kjv")
            dataset = HuggingFaceDataset("kjv", ds, counter, seq_len, batch, world, rank)
            it = iter(DataLoader(dataset, batch))
            yielded = sum(next(it).inputs.numel() for _ in range(steps))
            assert yielded == steps * batch * seq_len
            assert counter.count <= 1.25 * yielded, (world, rank, counter.count / yielded)


def test_resume(tok):
    """A state taken after any batch, also in the middle of an optimizer step, continues bit for bit."""
    for layout, taken in [((1, 4), 5), ((1, 2, 2), 3)]:
        (dl,) = loaders(tok, layout)
        it = iter(dl)
        for _ in range(taken):
            next(it)
        state = copy.deepcopy(dl.state_dict())
        expected = [next(it) for _ in range(4)]

        (resumed,) = loaders(tok, layout)
        resumed.load_state_dict(state)
        got = [batch for batch, _ in zip(resumed, range(4))]
        for batch, ex in zip(got, expected, strict=True):
            assert torch.equal(batch.inputs, ex.inputs) and torch.equal(batch.labels, ex.labels), layout


@pytest.mark.parametrize("streaming", [False, True], ids=["map", "streaming"])
def test_reshard_on_resume(tok, docs_file, streaming):
    """Save on 2 ranks x 2, resume on other layouts with a global batch of 4: the streams go on unchanged
    (across the end of the data)."""
    steps_before, steps_after = 7, 6
    reference = reference_batches(tok, DOCS, 4, steps_before + steps_after)

    before = docs_loaders(tok, (2, 2), docs_file, streaming)
    assert all_equal(global_batches(before, steps_before), reference[:steps_before])
    states = [dl.dataset.state_dict() for dl in before]
    assert [sorted(s["global_batch_4"]) for s in states] == [
        ["stream_0", "stream_1"],
        ["stream_2", "stream_3"],
    ]
    assert all(
        v.dtype == torch.int64 and v.shape == (4,) for s in states for v in s["global_batch_4"].values()
    )
    merged = {"global_batch_4": {**states[0]["global_batch_4"], **states[1]["global_batch_4"]}}
    for layout in [(1, 4), (4, 1), (1, 2, 2), (2, 2)]:
        after = docs_loaders(tok, layout, docs_file, streaming)
        for dl in after:
            dl.dataset.load_state_dict(copy.deepcopy(merged))
        batches = global_batches(after, steps_after, (*layout, 1)[2])
        assert all_equal(batches, reference[steps_before:]), layout


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("streaming", [False, True], ids=["map", "streaming"])
def test_dcp_checkpoint_reshard(tok, docs_file, streaming, tmp_path: Path):
    """The loader states survive torch.distributed.checkpoint: saved by 2 ranks (their keys merged, as DCP
    does), loaded into fresh loaders of 4 ranks, each asking only for its own stream."""
    before = docs_loaders(tok, (2, 2), docs_file, streaming)
    global_batches(before, 5)
    dcp.save({"dataloader": merged_state(before)}, checkpoint_id=tmp_path)
    after = docs_loaders(tok, (4, 1), docs_file, streaming)
    for dl in after:
        dcp.load({"dataloader": dl}, checkpoint_id=tmp_path)
    assert all_equal(global_batches(after, 3), reference_batches(tok, DOCS, 4, 8)[5:])


def test_reshard_stateful_dataloader(tok):
    """Same through the loaders' state dicts, as the checkpointer sees them."""
    before = loaders(tok, (2, 2))
    global_batches(before, 3)
    state = merged_state(before)
    expected = global_batches(loaders(tok, (1, 4)), 5)[3:]
    for layout in [(1, 4), (4, 1), (1, 2, 2)]:
        after = loaders(tok, layout)
        for dl in after:
            dl.load_state_dict(copy.deepcopy(state))
        assert all_equal(global_batches(after, 2, (*layout, 1)[2]), expected), layout


def test_other_global_batch_or_old_state_is_refused(tok):
    """The streams depend on the global batch size: a state saved for another one, or by the old
    global-stream loader, is refused with the option that starts the data afresh."""
    (dl,) = loaders(tok, (1, 4))
    next(iter(dl))
    state = dl.state_dict()
    old = {"epoch": 0, "position": "12", "token_buffer": [1, 2], "num_sequences": 4}
    for layout, dataset_state in [
        ((1, 8), state["dataset_state"]),
        ((2, 1), state["dataset_state"]),
        ((1, 4), old),
    ]:
        (other,) = loaders(tok, layout)[:1]
        with pytest.raises(
            ValueError, match="global batch size.*--checkpoint.exclude_from_loading dataloader"
        ):
            other.dataset.load_state_dict(copy.deepcopy(dataset_state))


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
    relooped = {r.getMessage() for r in caplog.records if "re-looped" in r.getMessage()}
    # Named by the path read, not by the registered name it overrides.
    assert relooped == {f"Dataset {str(docs_file)!r} is being re-looped: starting epoch {e}" for e in (1, 2)}


@pytest.mark.parametrize("streaming", [False, True], ids=["map", "streaming"])
def test_finite_stops_and_restarts(tok, docs_file, streaming):
    """One pass, as many global batches as the shortest stream has windows, the same on every rank;
    the next pass starts again from the beginning."""
    window = SEQ_LEN + 1
    shortest = min(len(token_stream(tok, DOCS[j::4])) for j in range(4)) // window
    longest = max(len(token_stream(tok, DOCS[j::4])) for j in range(4)) // window
    assert shortest < longest  # else this test could not tell the streams apart
    reference = reference_batches(tok, DOCS, 4, shortest)
    for layout in [(1, 4), (2, 2), (4, 1)]:
        rank_loaders = docs_loaders(tok, layout, docs_file, streaming, infinite=False)
        passes = [[[b.inputs for b in dl] for dl in rank_loaders] for _ in range(2)]
        for batches in passes:
            assert [len(b) for b in batches] == [shortest] * layout[0], layout
        assert all_equal(global_batches(rank_loaders, shortest), reference), layout
        assert all(all_equal(a, b) for a, b in zip(*passes)), layout


@pytest.mark.parametrize("streaming", [False, True], ids=["map", "streaming"])
def test_finite_pass_counted_from_a_ranks_own_streams(tok, docs_file, streaming):
    """Given the least over the ranks (the validator's all-reduce), rank 1 of 4 counts where a finite pass
    ends from its own stream: it tokenizes only its own documents, in the count and in every pass, and
    reads the batches of a rank that counted every stream."""
    window, own_docs = SEQ_LEN + 1, DOCS[1::4]
    shortest = min(len(token_stream(tok, DOCS[j::4])) for j in range(4)) // window
    reported: list[int] = []

    def min_over_ranks(steps: int) -> int:
        reported.append(steps)
        return shortest

    encoded: list[str] = []

    class CountingTokenizer:
        def encode(self, s: str, bos: bool, eos: bool) -> list[int]:
            encoded.append(s)
            return tok.encode(s, bos=bos, eos=eos)

    source = docs_source(docs_file, streaming)
    dataset = HuggingFaceDataset(
        "docs", source, CountingTokenizer(), SEQ_LEN, 1, 4, 1, infinite=False, min_over_ranks=min_over_ranks
    )
    passes = [[b.inputs for b in DataLoader(dataset, 1)] for _ in range(2)]
    assert reported == [len(token_stream(tok, own_docs)) // window]
    assert set(encoded) <= set(own_docs)
    reference = docs_loaders(tok, (4, 1), docs_file, streaming, infinite=False)[1]
    assert all(all_equal(p, [b.inputs for b in reference]) for p in passes)
    assert len(passes[0]) == shortest


@pytest.mark.parametrize("infinite", [True, False], ids=["infinite", "finite"])
@pytest.mark.parametrize("streaming", [False, True], ids=["map", "streaming"])
def test_too_small_for_the_global_batch(tok, tmp_path, streaming, infinite):
    path = tmp_path / "three.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS[:3]))
    with pytest.raises(ValueError, match="has 3 documents, fewer than the 4 sequences of a global batch"):
        for dl in docs_loaders(tok, (2, 2), path, streaming, infinite=infinite):
            next(iter(dl))


def test_streaming_group_too_small(tok, tmp_path):
    """3 files for 4 streams: file 0 alone feeds streams 0 and 3, and one document is too few."""
    paths = [tmp_path / f"part-{f}.jsonl" for f in range(3)]
    for path, docs in zip(paths, [DOCS[:1], DOCS[1:6], DOCS[6:11]]):
        path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    with pytest.raises(ValueError, match=r"group 0 \(file 0\) has 1 documents, fewer than its 2 sequences"):
        next(iter(sharded_loaders(tok, (1, 4), paths)[0]))


def test_kjv_validation_split():
    train = load_text_dataset("kjv")
    validation = load_text_dataset("kjv_validation")
    assert len(train) > 1000 and 10 < len(validation) < len(train) / 20
    assert validation[0]["text"].startswith("Genesis 50\n\n")
    assert not set(validation["text"]) & set(train["text"])
    assert len(load_text_dataset("kjv", split="validation")) == len(validation)


@pytest.mark.parametrize("nproc", [1, 2, 4, 8])
@pytest.mark.parametrize(
    "recipe", ["debug_model", "debug_model_muon", "qwen3_debug", "qwen3_moe_debug", "deepseek_v3_debug"]
)
def test_the_debug_recipes_evaluate_at_every_gpu_count(recipe, nproc):
    """The debug recipes' global validation batch fits the bundled held-out split at NGPU 1 to 8: every
    rank's first validation batch is whole (at 8 sequences per rank, NGPU 2 already had a row of one
    short chapter, and train.py refused the split at its start)."""
    job = parse_args(["--job.config_file", str(REPO_ROOT / "train_configs" / f"{recipe}.toml")])
    tok = build_tokenizer(resolve_path(job.model.tokenizer_path))
    batch_size, seq_len = validation_batch_size(job, nproc), job.training.seq_len
    source = DataSource(job.validation.dataset, split="validation")
    for rank in range(nproc):
        dataset = build_dataset(source, tok, seq_len, BatchLayout(batch_size, nproc, rank), infinite=False)
        assert next(iter(DataLoader(dataset, batch_size)), None) is not None, f"rank {rank} of {nproc}"


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
    assert tok.decode(
        torch.cat([torch.cat([b.inputs[0], b.labels[0, -1:]]) for b in dl]).tolist()
    ).startswith("<|begin_of_text|>train text")


def test_unknown_dataset():
    with pytest.raises(
        ValueError, match="Unknown dataset 'nope'.*c4, kjv, kjv_chat, kjv_validation.*training.dataset_path"
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
