"""Mixtures (training.mixture): rows drawn from several sources by weight, the same on every layout."""

import copy
import json
import os
import shutil
import zlib
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import datasets  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from conftest import TEXT_DOCS, TOKEN_DOCS
from launch import TINY_JOB, read_metrics, run_train_in_process  # noqa: E402
from test_data import all_equal, global_batches, rank_loaders, reference_batches, token_stream  # noqa: E402

from torchtitan.config.options import ConfigError, TrainingConfig  # noqa: E402
from torchtitan.config_rules import mixture_sources  # noqa: E402
from torchtitan.datasets.build import DataSource  # noqa: E402
from torchtitan.datasets.layout import micro_batch_rows  # noqa: E402
from torchtitan.datasets.loader import DataLoader  # noqa: E402
from torchtitan.datasets.mixture import (  # noqa: E402
    MixtureDataset,
    PretokenizedSource,
    Source,
    TextSource,
    row_choices,
)
from torchtitan.datasets.pretokenized import TokenWindows, read_manifest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SEQ_LEN = 16
LAYOUTS = [(1, 4), (2, 2), (4, 1), (1, 2, 2), (2, 1, 2)]  # (ranks, batch, micro-batches)

pytestmark = pytest.mark.usefixtures("hf_cache")


def mixture_loaders(tok, layout, mixture) -> list[DataLoader]:
    return rank_loaders(tok, DataSource("kjv", mixture=mixture), layout, SEQ_LEN)


def streaming_mixture_loaders(tok, layout, text: Path, tokens: Path) -> list[DataLoader]:
    """The text source read as a streaming dataset (the hub path), next to the pre-tokenized one."""
    world, batch, accum = (*layout, 1)[:3]
    out = []
    for rank in range(world):
        rows = [row for group in micro_batch_rows(batch, world, rank, accum) for row in group]
        ds = datasets.load_dataset("json", data_files=str(text), split="train", streaming=True)
        windows = TokenWindows(tokens, read_manifest(tokens, tok.model_path, tok.n_words), SEQ_LEN + 1)
        mixture = [
            Source("text", 2.0, TextSource("text", ds, tok, SEQ_LEN + 1, world * batch * accum, rows)),
            Source("tokens", 1.0, PretokenizedSource("tokens", windows, seed=0, shuffle=False)),
        ]
        out.append(DataLoader(MixtureDataset(mixture, SEQ_LEN, batch, world, rank, accum), batch))
    return out


def test_row_choices_follow_the_weights():
    choices = row_choices(seed=0, step=0, global_batch=20000, weights=[3.0, 1.0, 0.0])
    fractions = np.bincount(choices, minlength=3) / choices.size
    assert abs(fractions[0] - 0.75) < 0.02 and abs(fractions[1] - 0.25) < 0.02 and fractions[2] == 0
    again = row_choices(seed=0, step=0, global_batch=20000, weights=[3.0, 1.0, 0.0])
    assert np.array_equal(choices, again)
    for other in [row_choices(1, 0, 20000, [3.0, 1.0, 0.0]), row_choices(0, 1, 20000, [3.0, 1.0, 0.0])]:
        assert not np.array_equal(choices, other)
    assert set(row_choices(0, 3, 1000, [0.0, 0.0, 2.0]).tolist()) == {2}


def test_rows_follow_the_definition(tok, text_and_tokens):
    """Row j of step k: the text source's stream j, one window per pick; the pre-tokenized source's n-th
    window, n counting its earlier picks in row order. Computed here without the loader."""
    text, tokens = text_and_tokens
    steps, S = 20, 4
    got = global_batches(mixture_loaders(tok, (2, 2), [(str(text), 2.0), (str(tokens), 1.0)]), steps)
    text_windows = reference_batches(tok, TEXT_DOCS, S, steps, seq_len=SEQ_LEN)
    stream = token_stream(tok, TOKEN_DOCS)
    num_windows = len(stream) // (SEQ_LEN + 1)
    picks, taken = [0] * S, 0
    for k in range(steps):
        rows = []
        for j, source in enumerate(row_choices(0, k, S, [2.0, 1.0])):
            if source == 0:
                rows.append(text_windows[picks[j]][j])
                picks[j] += 1
            else:
                w = taken % num_windows
                rows.append(torch.tensor(stream[w * (SEQ_LEN + 1) : (w + 1) * (SEQ_LEN + 1)]))
                taken += 1
        assert torch.equal(got[k], torch.stack(rows)), k
    assert taken > num_windows  # the pre-tokenized source went into its second epoch


@pytest.mark.parametrize("streaming", [False, True], ids=["map", "streaming"])
def test_batches_are_the_same_on_every_layout(tok, text_and_tokens, streaming):
    text, tokens = text_and_tokens
    mixture = [(str(text), 2.0), (str(tokens), 1.0), ("kjv", 1.0)]
    reference = None
    for layout in LAYOUTS:
        if streaming:
            rank_loaders = streaming_mixture_loaders(tok, layout, text, tokens)
        else:
            rank_loaders = mixture_loaders(tok, layout, mixture)
        batches = global_batches(rank_loaders, 8, (*layout, 1)[2])
        reference = reference or batches
        assert all_equal(batches, reference), layout


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_resume(tok, text_and_tokens, tmp_path):
    """Bit for bit on the same layout, also mid-step; exact on other layouts through a DCP round trip,
    where each rank saves its own text streams; the tokens per source are counted on every rank."""
    text, tokens = text_and_tokens
    mixture = [(str(text), 2.0), (str(tokens), 1.0)]
    expected = global_batches(mixture_loaders(tok, (1, 4), mixture), 10)

    (dl,) = mixture_loaders(tok, (1, 2, 2), mixture)
    it = iter(dl)
    for _ in range(7):  # three steps and a half
        next(it)
    (resumed,) = mixture_loaders(tok, (1, 2, 2), mixture)
    resumed.load_state_dict(copy.deepcopy(dl.state_dict()))
    assert all_equal(global_batches([resumed], 1, 1), [torch.cat(expected[3].split(2)[1:])])

    before = mixture_loaders(tok, (2, 2), mixture)
    global_batches(before, 5)
    rows = sum(before[0].tokens_by_source().values()) // SEQ_LEN
    assert before[0].tokens_by_source() == before[1].tokens_by_source() and rows == 5 * 4
    state = copy.deepcopy(before[0].state_dict())
    for key, entry in before[1].state_dict()["dataset_state"].items():
        if isinstance(entry, dict) and "global_batch_4" in entry:
            state["dataset_state"][key]["global_batch_4"].update(copy.deepcopy(entry["global_batch_4"]))
    dcp.save({"dataloader": state}, checkpoint_id=tmp_path)
    for layout in [(4, 1), (1, 2, 2)]:
        after = mixture_loaders(tok, layout, mixture)
        for loader in after:
            dcp.load({"dataloader": loader}, checkpoint_id=tmp_path)
        assert all_equal(global_batches(after, 5, (*layout, 1)[2]), expected[5:]), layout


def test_sources_must_stay_weights_may_change(tok, text_and_tokens):
    text, tokens = text_and_tokens
    (dl,) = mixture_loaders(tok, (1, 4), [(str(text), 2.0), (str(tokens), 1.0)])
    global_batches([dl], 2)
    state = dl.state_dict()
    (reweighted,) = mixture_loaders(tok, (1, 4), [(str(text), 1.0), (str(tokens), 5.0)])
    reweighted.load_state_dict(copy.deepcopy(state))
    assert sum(reweighted.tokens_by_source().values()) == 2 * 4 * SEQ_LEN
    for changed in (
        [(str(tokens), 1.0), (str(text), 2.0)],
        [(str(text), 2.0), (str(tokens), 1.0), ("kjv", 1.0)],
    ):
        (other,) = mixture_loaders(tok, (1, 4), changed)
        with pytest.raises((ValueError, KeyError), match="another list of sources|source_2"):
            other.load_state_dict(copy.deepcopy(state))
    (single,) = mixture_loaders(tok, (1, 4), [])
    with pytest.raises(ValueError, match="exclude_from_loading dataloader"):
        (mixed,) = mixture_loaders(tok, (1, 4), [(str(text), 2.0)])
        mixed.load_state_dict(copy.deepcopy(single.state_dict()))


@pytest.mark.parametrize(
    "mixture, message",
    [
        (["kjv:-1"], "training.mixture: 'kjv:-1' has weight -1; weights must be >= 0"),
        (
            ["kjv:0", "c4:0"],
            "training.mixture: every weight is 0; give at least one source a positive weight",
        ),
        (["kjv:x"], "training.mixture: 'kjv:x' has weight 'x', not a number; write 'source:weight'"),
        (["kjv:1", "kjv:2"], "training.mixture: 'kjv' is listed twice; give each source once"),
    ],
)
def test_bad_weights(mixture, message):
    training = TrainingConfig()
    training.mixture = mixture
    with pytest.raises(ConfigError) as error:
        mixture_sources(training)
    assert str(error.value) == message


def test_weights_parse():
    training = TrainingConfig()
    training.mixture = ["kjv:3", "/data/a:b/tokens:0.5", "c4"]
    assert mixture_sources(training) == [("kjv", 3.0), ("/data/a:b/tokens", 0.5), ("c4", 1.0)]


def test_train_on_a_mixture(text_and_tokens, tmp_path):
    """train.py on a mixture given on the command line, data in 2 worker processes: the tokens per source
    in metrics.jsonl add up to the tokens trained; resumed with no workers it goes on bit for bit."""
    text, tokens = text_and_tokens
    mixture = ["--training.mixture", f"{text}:2,{tokens}:1,kjv:1", "--training.batch_size", "2"]
    job = [*TINY_JOB, *mixture, "--training.steps", "4", "--checkpoint.enable_checkpoint", "true"]
    job += ["--checkpoint.interval", "2"]
    assert (
        run_train_in_process(*job, "--training.data_workers", "2", "--job.dump_folder", str(tmp_path / "a"))
        == 0
    )
    step_2 = Path("checkpoint", "step-2")
    shutil.copytree(tmp_path / "a" / step_2, tmp_path / "b" / step_2)
    assert (
        run_train_in_process(*job, "--training.data_workers", "0", "--job.dump_folder", str(tmp_path / "b"))
        == 0
    )
    straight, resumed = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert [r["step"] for r in resumed] == [3, 4]
    assert [(r["loss"], r["source_tokens"]) for r in resumed] == [
        (r["loss"], r["source_tokens"]) for r in straight[2:]
    ]
    for record in straight:
        counts = record["source_tokens"]
        assert list(counts) == [str(text), str(tokens), "kjv"]
        assert sum(counts.values()) == record["step"] * 2 * 64


def test_resume_notices_a_changed_source(text_and_tokens, tmp_path, capsys):
    """A source whose content changed since the checkpoint (a pre-tokenized folder made again: its shard
    checksums; a text file's size or time) stops the resume in one line, exit code 2, before step 1 and
    without touching the dump folder."""
    text = Path(shutil.copy(text_and_tokens[0], tmp_path))
    tokens = shutil.copytree(text_and_tokens[1], tmp_path / "tokens")
    job = [*TINY_JOB, "--training.mixture", f"{text}:2,{tokens}:1", "--training.data_workers", "0"]
    job += ["--checkpoint.enable_checkpoint", "true", "--job.dump_folder", str(tmp_path / "dump")]
    assert run_train_in_process(*job, "--training.steps", "1") == 0
    dump = {path: path.read_bytes() for path in (tmp_path / "dump").rglob("*") if path.is_file()}
    manifest = (tokens / "manifest.json").read_text()
    remade = json.loads(manifest)
    remade["shards"][0]["crc32"] += 1

    def edit_text() -> None:
        (tokens / "manifest.json").write_text(manifest)
        text.write_text(text.read_text() + json.dumps({"text": "and one more"}) + "\n")

    for change in (lambda: (tokens / "manifest.json").write_text(json.dumps(remade)), edit_text):
        change()
        capsys.readouterr()
        assert run_train_in_process(*job, "--training.steps", "2") == 2
        err = capsys.readouterr().err
        assert [line for line in err.splitlines() if "error" in line.lower()] == [
            "error: training.mixture: the checkpoint's data state is of another list of sources, or a source "
            "changed since (a text source's file sizes or modification times, a pre-tokenized source's shard "
            "checksums); give the same sources in the same order, unchanged (the weights may change), or "
            "start the data afresh with --checkpoint.exclude_from_loading dataloader"
        ], err
        assert {path: path.read_bytes() for path in (tmp_path / "dump").rglob("*") if path.is_file()} == dump


def test_checkpoint_of_names_only_fingerprint_resumes(tok, text_and_tokens):
    """A mixture checkpoint saved before the sources' content was fingerprinted still resumes."""
    (dl,) = mixture_loaders(tok, (1, 4), [(str(path), 1.0) for path in text_and_tokens])
    global_batches([dl], 1)
    state = copy.deepcopy(dl.state_dict())
    state["dataset_state"]["mixture"][3] = zlib.crc32("\n".join(str(p) for p in text_and_tokens).encode())
    (resumed,) = mixture_loaders(tok, (1, 4), [(str(path), 1.0) for path in text_and_tokens])
    resumed.load_state_dict(state)
    assert resumed.state_dict()["dataset_state"]["mixture"][0] == 1
