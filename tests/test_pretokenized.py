"""Pre-tokenized data: scripts/pretokenize.py's output and the memory-mapped loader that reads it."""

import copy
import hashlib
import json
import os
import resource
import runpy
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import datasets  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from launch import TINY_JOB, losses, read_records, run_train_in_process  # noqa: E402
from test_data import global_batches, rank_loaders  # noqa: E402

from torchtitan.datasets.build import DataSource  # noqa: E402
from torchtitan.datasets.pretokenized import DamagedShard, TokenWindows, WindowOrder  # noqa: E402
from torchtitan.datasets.tokenizer import Tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KJV_HF = ROOT / "assets/tokenizer/kjv_bpe_hf"
SEQ_LEN = 8
WINDOW = SEQ_LEN + 1
DOCS = [f"Document {i}: " + "and it came to pass " * (i % 7 + 1) for i in range(40)]
LAYOUTS = [(1, 4), (2, 2), (4, 1), (1, 2, 2), (2, 1, 2)]  # (ranks, batch, micro-batches)


pytestmark = pytest.mark.usefixtures("hf_cache")


def write_jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


def pretokenize(data: Path, output: Path, *extra: str) -> int:
    run = runpy.run_path(str(ROOT / "scripts" / "pretokenize.py"))["run"]
    job = ["--job.config_file", str(ROOT / "train_configs" / "debug_model.toml")]
    return run([*job, "--training.dataset_path", str(data), "--output", str(output), *extra])


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("pretokenized")
    assert pretokenize(write_jsonl(tmp / "docs.jsonl", DOCS), tmp / "docs", "--docs-per-shard", "7") == 0
    return tmp / "docs"


def stream(tok) -> list[int]:
    return [t for d in DOCS for t in tok.encode(d, bos=True, eos=True)]


def loaders(tok, folder: Path, layout: tuple[int, ...], seed=0, shuffle=False, infinite=True):
    source = DataSource("docs", str(folder), seed=seed, shuffle=shuffle)
    return rank_loaders(tok, source, layout, SEQ_LEN, infinite=infinite)


def reference(tok, first: int, count: int, order=lambda i: i) -> torch.Tensor:
    tokens = torch.tensor(stream(tok))
    return torch.stack(
        [tokens[order(w) * WINDOW : (order(w) + 1) * WINDOW] for w in range(first, first + count)]
    )


def all_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_output_is_the_same_for_any_number_of_workers(tok, folder, tmp_path):
    assert (
        pretokenize(folder.parent / "docs.jsonl", tmp_path / "one", "--docs-per-shard", "7", "--workers", "1")
        == 0
    )
    files = sorted(p.name for p in folder.iterdir())
    assert files == sorted(p.name for p in (tmp_path / "one").iterdir())
    for name in files:
        assert (folder / name).read_bytes() == (tmp_path / "one" / name).read_bytes(), name

    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["version"] == 1 and manifest["dtype"] == "uint16"
    sha = hashlib.sha256((ROOT / "assets/tokenizer/kjv_bpe.tiktoken").read_bytes()).hexdigest()
    assert (
        manifest["tokenizer"]["sha256"] == sha and manifest["tokenizer"]["vocab_size"] == tok.n_words == 2256
    )
    assert manifest["source"]["split"] == "train" and manifest["source"]["dataset_path"].endswith(
        "docs.jsonl"
    )
    assert [s["num_documents"] for s in manifest["shards"]] == [7, 7, 7, 7, 7, 5]
    shards = [np.fromfile(folder / s["tokens"], dtype=np.uint16) for s in manifest["shards"]]
    assert [len(s) for s in shards] == [s["num_tokens"] for s in manifest["shards"]]
    assert np.concatenate(shards).tolist() == stream(tok) and manifest["num_tokens"] == len(stream(tok))
    # The offsets mark each document's BOS.
    for shard, entry in zip(shards, manifest["shards"]):
        offsets = np.load(folder / entry["offsets"])
        assert offsets[0] == 0 and offsets[-1] == len(shard) and len(offsets) == entry["num_documents"] + 1
        assert (shard[offsets[:-1]] == tok.bos_id).all()


def test_tokenizer_without_bos(hf_tok, tok, folder, tmp_path):
    """A Qwen3-style tokenizer folder (no BOS): every document ends with EOS, nothing begins it; the
    manifest records the folder's tokenizer.json and its sha256; the loader reads the windows of that
    stream; one tokenizer's shards are refused with the other."""
    docs = folder.parent / "docs.jsonl"
    assert (
        pretokenize(docs, tmp_path / "hf", "--model.tokenizer_path", str(KJV_HF), "--docs-per-shard", "7")
        == 0
    )
    manifest = json.loads((tmp_path / "hf" / "manifest.json").read_text())
    sha = hashlib.sha256((KJV_HF / "tokenizer.json").read_bytes()).hexdigest()
    assert manifest["tokenizer"] == {
        "path": str(KJV_HF / "tokenizer.json"),
        "sha256": sha,
        "vocab_size": 2003,
    }
    shards = [np.fromfile(tmp_path / "hf" / s["tokens"], dtype=np.uint16) for s in manifest["shards"]]
    assert np.concatenate(shards).tolist() == stream(hf_tok)
    for shard, entry in zip(shards, manifest["shards"]):
        offsets = np.load(tmp_path / "hf" / entry["offsets"])
        assert (shard[offsets[1:] - 1] == hf_tok.eos_id).all()
        assert (shard == hf_tok.eos_id).sum() == entry["num_documents"]
    steps = len(stream(hf_tok)) // WINDOW // 4
    expected = [reference(hf_tok, 4 * k, 4) for k in range(steps)]
    assert all_equal(global_batches(loaders(hf_tok, tmp_path / "hf", (2, 2)), steps), expected)
    for other, shards_of in ((hf_tok, folder), (tok, tmp_path / "hf")):
        with pytest.raises(ValueError, match="was tokenized with another tokenizer"):
            loaders(other, shards_of, (1, 4))


def test_train_with_a_tokenizer_without_bos(tmp_path, capsys):
    """train.py with the bundled Hugging Face tokenizer folder: a mixture of its pre-tokenized shards and
    text, validated on text; the logs name each source and the data validated."""
    with open(ROOT / "assets/corpus/kjv/train.jsonl") as f:
        chapters = [json.loads(line)["text"] for _, line in zip(range(30), f)]
    hf = ["--model.tokenizer_path", str(KJV_HF)]
    text = write_jsonl(tmp_path / "kjv.jsonl", chapters)
    assert pretokenize(text, tmp_path / "data", *hf, "--workers", "1") == 0
    job = [*TINY_JOB, *hf, "--training.steps", "1", "--training.mixture", f"{tmp_path / 'data'}:1,{text}:1"]
    job += ["--validation.enable", "true", "--validation.dataset_path", str(text), "--validation.steps", "1"]
    assert run_train_in_process(*job, "--job.dump_folder", str(tmp_path / "run")) == 0
    assert list(losses(tmp_path / "run")) == [1]
    assert [r["step"] for r in read_records(tmp_path / "run") if "validation_loss" in r] == [1]
    out = capsys.readouterr().out
    assert f"Data for training: mixture of {tmp_path / 'data'} (weight 1), {text} (weight 1)\n" in out
    assert f"Data for validation: {text}\n" in out and f" tokens of {text}, " in out


def test_interrupted_run_leaves_nothing_and_existing_output_is_refused(folder, tmp_path, capsys, monkeypatch):
    def fail(self, s, bos, eos):
        raise ValueError("interrupted")

    monkeypatch.setattr(Tokenizer, "encode", fail)  # in the forked workers too
    assert pretokenize(folder.parent / "docs.jsonl", tmp_path / "out", "--docs-per-shard", "7") == 2
    assert "interrupted" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []

    before = sorted(p.name for p in folder.iterdir())
    assert pretokenize(folder.parent / "docs.jsonl", folder) == 2
    assert capsys.readouterr().err.endswith(
        f"error: --output: {folder} exists; pretokenize.py only creates a new folder\n"
    )
    assert sorted(p.name for p in folder.iterdir()) == before


def limit_file_size() -> None:
    """A write past 256 bytes fails with EFBIG, as on a full disk (no root needed for a small file system;
    CPython ignores SIGXFSZ, which would otherwise kill the process)."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (256, 256))


def test_full_disk_names_the_output_and_stale_temporaries_are_removed(folder, tmp_path):
    """The script, as a user runs it, under a file-size limit: one line naming --output and the OS error,
    exit 2, nothing left behind. The temporary folder of a killed run (its pid is gone) is removed
    first; a live run's (this process's) is kept. The dataset's cache is the `folder` fixture's, so the
    first write past the limit is a shard's."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    output = tmp_path / "out"
    stale, live = Path(f"{output}.tmp-{dead.pid}"), Path(f"{output}.tmp-{os.getpid()}")
    for tmp in (stale, live):
        tmp.mkdir()
        (tmp / "shard_00000.bin").write_bytes(b"partial")
    job = ["--job.config_file", str(ROOT / "train_configs" / "debug_model.toml"), "--workers", "1"]
    job += ["--training.dataset_path", str(folder.parent / "docs.jsonl"), "--output", str(output)]
    env = dict(os.environ, HF_DATASETS_CACHE=datasets.config.HF_DATASETS_CACHE)
    script = [sys.executable, str(ROOT / "scripts" / "pretokenize.py"), *job]
    done = subprocess.run(script, capture_output=True, text=True, env=env, preexec_fn=limit_file_size)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1] == (
        f"error: --output: cannot write {output}: File too large (EFBIG); its temporary folder is removed: "
        "free space there or choose another --output"
    )
    assert f"Removed {stale}, left by a pretokenize.py run that died (pid {dead.pid})" in done.stdout
    assert sorted(tmp_path.iterdir()) == [live]


@pytest.mark.parametrize("shuffle", [False, True], ids=["in order", "shuffled"])
def test_layout_invariance(tok, folder, shuffle):
    """Every layout with a global batch of 4 reads the same windows, across epochs."""
    n_windows = len(stream(tok)) // WINDOW
    steps = n_windows // 4 + 3
    expected = global_batches(loaders(tok, folder, (1, 4), shuffle=shuffle), steps)
    if not shuffle:
        assert all_equal(
            expected[: n_windows // 4], [reference(tok, 4 * k, 4) for k in range(n_windows // 4)]
        )
        assert torch.equal(expected[n_windows // 4], reference(tok, 0, 4))  # the next epoch
    for layout in LAYOUTS[1:]:
        batches = global_batches(loaders(tok, folder, layout, shuffle=shuffle), steps, (*layout, 1)[2])
        assert all_equal(batches, expected), layout


def test_shuffle_is_a_seeded_bijection(tok, folder):
    for n in [1, 2, 3, 17, 64, 1000]:
        assert sorted(WindowOrder(n, 0, 0)(i) for i in range(n)) == list(range(n))
    orders = {
        (seed, epoch): [WindowOrder(1000, seed, epoch)(i) for i in range(1000)]
        for seed in (0, 1)
        for epoch in (0, 1)
    }
    assert len({tuple(o) for o in orders.values()}) == 4
    # An epoch of the loader reads every window once (4 divides neither: the tail is dropped).
    n_windows = len(stream(tok)) // WINDOW
    steps = n_windows // 4
    windows = torch.cat(global_batches(loaders(tok, folder, (2, 2), shuffle=True, seed=3), steps))
    order = WindowOrder(n_windows, 3, 0)
    assert torch.equal(windows, reference(tok, 0, 4 * steps, order))
    assert len({order(i) for i in range(4 * steps)}) == 4 * steps
    other = torch.cat(global_batches(loaders(tok, folder, (2, 2), shuffle=True, seed=4), steps))
    assert not torch.equal(windows, other)


def test_nothing_is_tokenized(tok, folder, monkeypatch):
    (dl,) = loaders(tok, folder, (1, 4))

    def fail(self, s, bos, eos):
        raise AssertionError("tokenized during training")

    monkeypatch.setattr(Tokenizer, "encode", fail)
    assert len(global_batches([dl], 30)) == 30


def test_resume_on_any_layout_and_global_batch(tok, folder, tmp_path):
    n_windows = len(stream(tok)) // WINDOW
    taken = 5
    (dl,) = loaders(tok, folder, (1, 2, 2), shuffle=True)
    it = iter(dl)
    for _ in range(2 * taken):
        next(it)
    state = copy.deepcopy(dl.state_dict())
    assert state["dataset_state"]["pretokenized"].tolist() == [0, 4 * taken, 0, 4]
    expected = [
        torch.cat([torch.cat([b.inputs, b.labels[:, -1:]], 1) for b in (next(it), next(it))])
        for _ in range(6)
    ]

    (same,) = loaders(tok, folder, (1, 2, 2), shuffle=True)
    same.load_state_dict(copy.deepcopy(state))
    assert all_equal(global_batches([same], 6, 2), expected)

    dcp.save({"dataloader": state}, checkpoint_id=tmp_path / "ckpt")
    for layout in [(4, 1), (2, 2)]:
        after = loaders(tok, folder, layout, shuffle=True)
        for rank_loader in after:
            dcp.load({"dataloader": rank_loader}, checkpoint_id=tmp_path / "ckpt")
        assert all_equal(global_batches(after, 6), expected), layout

    # Another global batch size goes on from the next unconsumed window, in order here.
    (smaller,) = loaders(tok, folder, (1, 2))
    smaller.load_state_dict(copy.deepcopy(state))
    got = torch.cat(global_batches([smaller], 4))
    assert torch.equal(got, reference(tok, 4 * taken, 8))
    (larger,) = loaders(tok, folder, (1, 8))
    larger.load_state_dict(copy.deepcopy(state))
    first = 4 * taken if 4 * taken + 8 <= n_windows else 0
    assert torch.equal(next(iter(larger)).inputs, reference(tok, first, 8)[:, :-1])


def test_finite_pass_is_in_order_and_restarts(tok, folder):
    """Evaluation: one pass over the windows in order (no shuffle), the incomplete last batch dropped; the
    next pass starts again from the beginning."""
    steps = len(stream(tok)) // WINDOW // 4
    expected = [reference(tok, 4 * k, 4) for k in range(steps)]
    for layout in [(1, 4), (2, 2)]:
        rank_loaders = loaders(tok, folder, layout, infinite=False, shuffle=True)
        assert [len(list(dl)) for dl in rank_loaders] == [steps] * layout[0]
        assert all_equal(global_batches(rank_loaders, steps), expected), layout


def test_train_and_validate_from_pretokenized_data(tmp_path):
    """train.py on pre-tokenized training and validation data, resumed from a checkpoint bit for bit."""
    with open(ROOT / "assets/corpus/kjv/train.jsonl") as f:
        chapters = [json.loads(line)["text"] for _, line in zip(range(30), f)]
    assert pretokenize(write_jsonl(tmp_path / "kjv.jsonl", chapters), tmp_path / "data") == 0
    data = ["--training.dataset_path", str(tmp_path / "data"), "--training.shuffle_windows", "true"]
    data += ["--validation.enable", "true", "--validation.dataset_path", str(tmp_path / "data")]
    data += ["--validation.freq", "2", "--validation.steps", "2", "--checkpoint.enable_checkpoint", "true"]
    job = [*TINY_JOB, *data, "--training.steps", "4", "--checkpoint.interval", "2"]
    assert run_train_in_process(*job, "--job.dump_folder", str(tmp_path / "straight")) == 0
    step_2 = Path("checkpoint", "step-2")
    shutil.copytree(tmp_path / "straight" / step_2, tmp_path / "resumed" / step_2)
    assert run_train_in_process(*job, "--job.dump_folder", str(tmp_path / "resumed")) == 0
    straight, resumed = losses(tmp_path / "straight"), losses(tmp_path / "resumed")
    assert list(straight) == [1, 2, 3, 4] and list(resumed) == [3, 4]
    assert resumed == {step: straight[step] for step in (3, 4)}
    validation = [r for r in read_records(tmp_path / "straight") if "validation_loss" in r]
    assert [r["step"] for r in validation] == [2, 4] and validation[0]["validation_tokens"] == 2 * 8 * 64


def set_token(folder: Path, value: int, old_manifest: bool = False) -> None:
    """Token 3 of shard 0 made `value`, as a flipped byte would; with `old_manifest`, the manifest
    loses its checksums, as an older pretokenize.py wrote it."""
    path = folder / "shard-00000.bin"
    tokens = np.fromfile(path, dtype=np.uint16)
    tokens[3] = value
    path.write_bytes(tokens.tobytes())
    if old_manifest:
        manifest = json.loads((folder / "manifest.json").read_text())
        del manifest["checksum_tokens"]
        for shard in manifest["shards"]:
            del shard["crc32"], shard["checksums"]
        (folder / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    "value, old_manifest, workers, message",
    [
        (5, False, 1, "does not match its CRC32 checksum (block 0, tokens 0 to "),
        (65535, False, 0, "does not match its CRC32 checksum (block 0, tokens 0 to "),
        (65535, True, 0, "holds token id 65535, beyond the 2256 ids of the tokenizer it was made with"),
    ],
    ids=[
        "another valid id, in a data worker",
        "beyond the vocabulary",
        "beyond the vocabulary, no checksums",
    ],
)
def test_damaged_shard_is_one_line(folder, tmp_path, capsys, value, old_manifest, workers, message):
    """A shard whose bytes changed after pretokenize.py wrote it (its CRC32 differs), or that holds an id
    beyond the vocabulary (an IndexError in the embedding otherwise), stops train.py when first read, in
    one line naming the file (exit code 2), also from a data-loading worker; nothing is saved. The worker
    case runs train.py as a program: in this process, the failed worker would outlive the run by 10 s."""
    data = tmp_path / "data"
    shutil.copytree(folder, data)
    set_token(data, value, old_manifest)
    job = [*TINY_JOB, "--training.dataset_path", str(data), "--training.steps", "1"]
    job += ["--training.data_workers", str(workers), "--checkpoint.enable_checkpoint", "true"]
    job += ["--job.dump_folder", str(tmp_path / "dump")]
    if workers:
        result = subprocess.run(
            [sys.executable, str(ROOT / "train.py"), *job], capture_output=True, text=True
        )
        code, out, err = result.returncode, result.stdout, result.stderr
    else:
        code = run_train_in_process(*job)
        out, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert errors[0].startswith(f"error: {data}/shard-00000.bin ") and message in errors[0], err
    assert errors[0].endswith("restore it from a copy, or re-run scripts/pretokenize.py")
    assert ("has no shard checksums (an older pretokenize.py)" in out + err) == old_manifest
    assert not (tmp_path / "dump" / "checkpoint").exists()


def test_a_rank_checks_only_the_blocks_it_reads(folder, tmp_path):
    """Checksums cover blocks of the manifest's `checksum_tokens` (16 here), checked when first read: a
    damaged block stops only a read that touches it, so a rank reads at most the blocks around its own
    windows once more, never the whole dataset (whole-shard checks would fail at window 0)."""
    data = tmp_path / "data"
    shutil.copytree(folder, data)
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["checksum_tokens"] = 16
    for shard in manifest["shards"]:
        tokens = np.fromfile(data / shard["tokens"], dtype=np.uint16)
        crcs = [zlib.crc32(tokens[i : i + 16]) for i in range(0, len(tokens), 16)]
        np.save(data / shard["checksums"], np.array(crcs, dtype=np.uint32))
    path = data / "shard-00000.bin"
    tokens = np.fromfile(path, dtype=np.uint16)
    tokens[5 * 16 + 3] ^= 1  # block 5 of shard 0: tokens 80 to 95
    path.write_bytes(tokens.tobytes())
    windows = TokenWindows(data, manifest, WINDOW)
    later = manifest["shards"][0]["num_tokens"] // WINDOW + 1  # a window of shard 1
    for w in [*range(8), later]:  # tokens 0 to 71, and shard 1
        windows.read(w)
    with pytest.raises(
        DamagedShard, match=r"shard-00000.bin does not match its CRC32 checksum \(block 5, tokens 80 to 95\)"
    ):
        windows.read(8)  # tokens 72 to 80
