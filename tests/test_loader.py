"""Data loading in worker processes (training.data_workers): the same batches and the same state as on
the training thread, for every kind of data, so that checkpoints resume exactly with workers on."""

import copy
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import datasets  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from launch import ROOT  # noqa: E402
from test_data import all_equal, global_batches, rank_loaders  # noqa: E402

from torchtitan.datasets import loader  # noqa: E402
from torchtitan.datasets.build import DataSource  # noqa: E402
from torchtitan.datasets.loader import DataLoader, _init_worker, worker_failures_in_one_line  # noqa: E402
from torchtitan.datasets.text import TextDataset as HuggingFaceDataset  # noqa: E402
from torchtitan.errors import DataLoaderError  # noqa: E402

SEQ_LEN = 16
KINDS = ["text", "streaming", "pretokenized", "mixture"]

pytestmark = pytest.mark.usefixtures("hf_cache")


def kind_loaders(tok, kind: str, text_and_tokens, layout, num_workers: int) -> list[DataLoader]:
    text, tokens = text_and_tokens
    world, batch, accum = (*layout, 1)[:3]
    if kind == "streaming":
        out = []
        for rank in range(world):
            ds = datasets.load_dataset("json", data_files=str(text), split="train", streaming=True)
            dataset = HuggingFaceDataset("text", ds, tok, SEQ_LEN, batch, world, rank, accum)
            out.append(DataLoader(dataset, batch, num_workers))
        return out
    path = {"text": str(text), "pretokenized": str(tokens), "mixture": None}[kind]
    mixture = [(str(text), 1.0), (str(tokens), 1.0), ("kjv", 1.0)] if kind == "mixture" else []
    return rank_loaders(tok, DataSource("kjv", path, mixture), layout, SEQ_LEN, num_workers)


def flat(state: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        out.update(flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key: value})
    return out


def same_state(a: dict, b: dict) -> bool:
    fa, fb = flat(a), flat(b)
    return fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa)


def take(loader: DataLoader, count: int) -> list:
    it = iter(loader)
    return [next(it) for _ in range(count)]


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
@pytest.mark.parametrize("kind", KINDS)
def test_workers_give_the_same_batches_and_state(tok, text_and_tokens, kind):
    """2 and 3 workers (uneven shares at batch 4; capped at one per row at batch 2) against none, on three
    layouts of the same global batch; the state after 5 micro-batches (mid-step) is the same, key for key."""
    for layout in [(1, 4), (2, 2), (1, 2, 2)]:
        accum = (*layout, 1)[2]
        reference = global_batches(kind_loaders(tok, kind, text_and_tokens, layout, 0), 6, accum)
        for workers in (2, 3):
            rank_loaders = kind_loaders(tok, kind, text_and_tokens, layout, workers)
            assert all_equal(global_batches(rank_loaders, 6, accum), reference), (layout, workers)
    (plain,) = kind_loaders(tok, kind, text_and_tokens, (1, 2, 2), 0)
    (threaded,) = kind_loaders(tok, kind, text_and_tokens, (1, 2, 2), 2)
    take(plain, 5)
    take(threaded, 5)
    assert same_state(plain.state_dict(), threaded.state_dict())


@pytest.mark.parametrize("kind", ["text", "mixture"])
def test_resume_across_worker_counts(tok, text_and_tokens, kind):
    """A state taken with workers resumes without, and the reverse, bit for bit."""
    (straight,) = kind_loaders(tok, kind, text_and_tokens, (1, 2, 2), 0)
    expected = take(straight, 9)[5:]
    for saved_with, resumed_with in [(2, 0), (0, 2), (2, 1)]:
        (before,) = kind_loaders(tok, kind, text_and_tokens, (1, 2, 2), saved_with)
        take(before, 5)
        (after,) = kind_loaders(tok, kind, text_and_tokens, (1, 2, 2), resumed_with)
        after.load_state_dict(copy.deepcopy(before.state_dict()))
        got = take(after, 4)
        for batch, ex in zip(got, expected, strict=True):
            assert torch.equal(batch.inputs, ex.inputs), (saved_with, resumed_with)
            assert torch.equal(batch.labels, ex.labels), (saved_with, resumed_with)


def _signal_self_then_exit(trainer_pid: int) -> None:
    _init_worker(trainer_pid, multiprocessing.Event(), 0)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        os.kill(os.getpid(), sig)


def _worker_of_a_dying_trainer(pid_file: str) -> None:
    """A trainer that starts a worker and is killed: the worker must go with it."""
    worker = multiprocessing.get_context("fork").Process(target=_init_then_sleep, args=(os.getpid(),))
    worker.start()
    Path(pid_file).write_text(str(worker.pid))
    os.kill(os.getpid(), signal.SIGKILL)


def _init_then_sleep(trainer_pid: int) -> None:
    _init_worker(trainer_pid, multiprocessing.Event(), 0)
    time.sleep(60)


def alive(pid: int) -> bool:
    """Running, not a zombie waiting to be reaped."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "State:\tZ" not in status


def test_workers_ignore_preemption_signals_and_die_with_the_trainer(tmp_path):
    """A signal to the whole process group reaches the trainer, which saves after the step: its workers
    must outlive it until then; a killed trainer's workers die at once (they hold its sockets)."""
    worker = multiprocessing.get_context("fork").Process(target=_signal_self_then_exit, args=(os.getpid(),))
    worker.start()
    worker.join(30)
    assert worker.exitcode == 0

    trainer = multiprocessing.get_context("fork").Process(
        target=_worker_of_a_dying_trainer, args=(str(tmp_path / "pid"),)
    )
    trainer.start()
    trainer.join(30)
    pid = int((tmp_path / "pid").read_text())
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid), "the worker outlived its trainer"


@pytest.mark.parametrize("broken", [ConnectionResetError(104, "Connection reset by peer"), EOFError()])
def test_a_worker_killed_while_its_batch_is_fetched_is_named(monkeypatch, broken):
    """A worker killed after queueing a batch, before the trainer fetched the batch's tensors from it (by
    file descriptor, from the worker's socket): the fetch fails with a broken connection, which torch lets
    through while the worker is not yet seen dead (CI: 1 run in 15 of test_reliability's dead worker). It
    ends in the worker's one line all the same, also when torch's SIGCHLD handler names the worker while
    the trainer waits to see it dead; a broken connection with every worker alive stays as it is."""
    worker = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
    worker.start()
    monkeypatch.setattr(loader, "_workers", {worker.pid: (0, worker)})
    with pytest.raises(type(broken)), worker_failures_in_one_line():
        raise broken

    def dies_and_torch_names_it(seconds: float) -> None:
        os.kill(worker.pid, signal.SIGKILL)
        os.waitid(os.P_PID, worker.pid, os.WEXITED | os.WNOWAIT)
        raise RuntimeError(f"DataLoader worker (pid {worker.pid}) is killed by signal: Killed. ")

    monkeypatch.setattr(loader.time, "sleep", dies_and_torch_names_it)
    with pytest.raises(DataLoaderError) as error, worker_failures_in_one_line():
        raise broken
    assert str(error.value) == (
        f"data loading worker 0 (pid {worker.pid}) was killed by SIGKILL; launch again to resume from the "
        "last checkpoint"
    )


class _StallsAfterOneBatch:
    """A dataset whose reading hangs after its first batch."""

    def __iter__(self):
        yield torch.zeros(1, 2), torch.zeros(1, 2)
        time.sleep(60)


def test_a_stalled_read_on_the_training_thread_times_out():
    """With no workers the timeout interrupts the training thread's own read, in one line (exit code 6);
    a stalled worker is tested end to end in test_reliability.py."""
    batches = iter(DataLoader(_StallsAfterOneBatch(), 1, timeout=0.5))
    next(batches)
    start = time.monotonic()
    with pytest.raises(DataLoaderError) as error:
        next(batches)
    assert 0.5 <= time.monotonic() - start < 5
    assert str(error.value) == (
        "the training thread's data loading (training.data_workers = 0) made no batch within "
        "training.data_timeout_seconds = 0.5 s: it is stalled (stopped, or blocked reading its data); launch "
        "again to resume from the last checkpoint"
    )


def test_a_loader_left_open_does_not_hold_up_the_exit():
    """Workers ignore SIGTERM while the trainer runs, and multiprocessing stops them with SIGTERM at exit:
    a loader still open then (a generator in a reference cycle, with train.py's GC off) must not hang."""
    script = (
        "import sys; sys.path.insert(0, '.')\n"
        "from torchtitan.datasets.tokenizer import Tokenizer\n"
        "from torchtitan.datasets.build import DataSource, build_dataset\n"
        "from torchtitan.datasets.layout import BatchLayout\n"
        "from torchtitan.datasets.loader import DataLoader\n"
        "tok = Tokenizer('assets/tokenizer/kjv_bpe.tiktoken')\n"
        "batches = iter(DataLoader(build_dataset(DataSource('kjv'), tok, 16, BatchLayout(2)), 2, 2))\n"
        "next(batches)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, timeout=60, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]
