"""The data loader: a dataset's micro-batches, made in worker processes ahead of the training step.

The datasets (text streams, pre-tokenized, mixture) yield whole micro-batches and keep all their position
in `state_dict()`. With N workers (`training.data_workers`), worker w makes rows ``w, w + N, ...`` of every
micro-batch (`keep_share`), so tokenizing is shared and each text stream lives in one worker only. Each
part travels with its worker's state taken right after it was made; the loader joins the N parts of a
micro-batch and merges the N states. Its state is therefore that of the last micro-batch training took,
never of the ones prefetched, and it has the same keys as without workers: a checkpoint resumes exactly,
with or without workers, on any layout the dataset allows.

A worker that dies, or makes no batch within the loader's timeout (`training.data_timeout_seconds`), ends
the job in one line naming it and exit code 6 (errors.py); the relaunch resumes from the last checkpoint.
"""

import atexit
import contextlib
import ctypes
import functools
import itertools
import multiprocessing
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Iterator
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event
from typing import Any, Protocol, TypeVar

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import IterableDataset, get_worker_info

from torchtitan.datasets.layout import Batch
from torchtitan.datasets.mixture import MixtureDataset
from torchtitan.errors import DataLoaderError


class ShardableDataset(Protocol):
    def __iter__(self) -> Iterator[Batch]: ...
    def keep_share(self, worker: int, num_workers: int) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


PR_SET_PDEATHSIG = 1  # linux/prctl.h
T = TypeVar("T")

# Set when the trainer's interpreter exits: from then on its workers obey SIGTERM, which multiprocessing's
# own exit handler sends them (registered earlier, so it runs after this one).
_trainer_exiting = multiprocessing.Event()
atexit.register(_trainer_exiting.set)

# torch's words for a dead worker, from its SIGCHLD handler or its check while awaiting a batch.
_DEAD_WORKER = re.compile(r"DataLoader worker \(pid(?:\(s\))? (\d+)")
# Every data worker started in this process, by pid, with its index: to name a dead one.
_workers: dict[int, tuple[int, BaseProcess]] = {}


class _Expired(BaseException):
    """The data loader's timer went off (DataLoader._on_time); not an Exception, so that no `except
    Exception` on the way (a retrying reader, torch's fetch) takes it for an error of its own."""


def _expire(signum: int, frame: Any) -> None:
    raise _Expired


@contextlib.contextmanager
def worker_failures_in_one_line() -> Iterator[None]:
    """torch reports a dead worker by a RuntimeError raised wherever the trainer's main thread is (its
    SIGCHLD handler runs there), not only while a batch is awaited: inside this context it becomes a
    DataLoaderError naming the worker and how it died. A worker killed after queueing a batch, before the
    trainer fetched the batch's tensors from it (shared by file descriptor, through the worker's own
    socket), fails the fetch with a broken connection instead, which torch lets through when the worker
    is not yet seen dead: that also becomes the worker's DataLoaderError."""
    try:
        yield
    except (RuntimeError, ConnectionError, EOFError) as e:
        pid = _failed_worker(e)
        if pid is None:
            raise
        raise _worker_died(pid) from e


def _failed_worker(error: BaseException, wait: float = 1.0) -> int | None:
    """The pid of the worker of this process whose death `error` reports: named by torch's RuntimeError,
    or, after a broken connection, the worker seen failed within `wait` seconds (its socket closes as it
    dies, a moment before its exit code is there to read; torch's SIGCHLD handler may name it first)."""
    if isinstance(error, RuntimeError):
        match = _DEAD_WORKER.search(str(error))
        return int(match[1]) if match is not None and int(match[1]) in _workers else None
    deadline = time.monotonic() + wait
    try:
        while True:
            # torch leaves a dead worker unreaped, or has reaped it through the process object.
            failed = [pid for pid, (_, process) in _workers.items() if process.exitcode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                return failed[0] if failed else None
            time.sleep(0.01)
    except RuntimeError as e:
        return _failed_worker(e)


def _worker_died(pid: int) -> DataLoaderError:
    index, process = _workers[pid]
    code = process.exitcode
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    return DataLoaderError(
        f"data loading worker {index} (pid {pid}) {how}; launch again to resume from the last checkpoint"
    )


def _init_worker(trainer_pid: int, trainer_exiting: Event, worker_id: int) -> None:
    """A preemption signal sent to the whole process group (or to every process of a SLURM step) must
    reach the trainer only: it saves after the step, and needs its workers until then; SIGTERM stops a
    worker only once the trainer is exiting. A worker dies with the trainer: forked, it holds copies of
    the trainer's sockets (its process group's), and outliving a killed trainer it would keep the other
    ranks from seeing the connection drop, so that they would wait for their timeout."""

    def on_sigterm(signum: int, frame: Any) -> None:
        if trainer_exiting.is_set():
            os._exit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    for sig in (signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != trainer_pid:  # the trainer died before prctl took effect
        os._exit(1)


class _WorkerShare(IterableDataset):
    """Runs in a worker: its share of every micro-batch, each with the state right after it."""

    def __init__(self, dataset: ShardableDataset, num_workers: int):
        self.dataset = dataset
        self.num_workers = num_workers

    def __iter__(self) -> Iterator[tuple[Batch, dict[str, Any]]]:
        self.dataset.keep_share(get_worker_info().id, self.num_workers)
        for batch in self.dataset:
            # As plain ints: a tensor (or an array, which the loader turns into one) per state entry would
            # cost a shared-memory segment per batch. All dataset states are int64 tensors.
            yield batch, _map_state(torch.Tensor.tolist, self.dataset.state_dict())


def _map_state(fn: Callable[[Any], Any], state: dict[str, Any]) -> dict[str, Any]:
    """`fn` of every value of a nested state dict."""
    return {
        key: _map_state(fn, value) if isinstance(value, dict) else fn(value) for key, value in state.items()
    }


def _merge(states: list[dict[str, Any]]) -> dict[str, Any]:
    """The union of the workers' states: each holds its own streams and the same shared counters."""
    merged: dict[str, Any] = {}
    for state in states:
        for key, value in state.items():
            if isinstance(value, dict):
                merged[key] = _merge([merged.get(key, {}), value])
            else:
                merged.setdefault(key, value)
    return merged


class DataLoader(Stateful):
    """`dataset`'s micro-batches, from `num_workers` processes (0: made on the calling thread), each
    preparing `prefetch` micro-batches ahead; `pin_memory` (CUDA) puts them in page-locked memory for
    non-blocking copies. There are at most `batch_size` workers: each makes some rows of every batch. A
    worker that makes no batch for `timeout` seconds (0: no limit) is reported as stalled."""

    def __init__(
        self,
        dataset: ShardableDataset,
        batch_size: int,
        num_workers: int = 0,
        prefetch: int = 2,
        pin_memory: bool = False,
        timeout: float = 0,
    ):
        self.dataset = dataset
        self.num_workers = min(num_workers, batch_size)
        self.prefetch = prefetch
        self.pin_memory = pin_memory
        self.timeout = timeout
        self._state: list[dict[str, Any]] | None = None  # the workers', after the last micro-batch taken

    def __iter__(self) -> Iterator[Batch]:
        if self.num_workers == 0:
            yield from self._on_time(
                iter(self.dataset), lambda i: "the training thread's data loading (training.data_workers = 0)"
            )
            return
        workers = TorchDataLoader(
            _WorkerShare(self.dataset, self.num_workers),
            batch_size=None,
            num_workers=self.num_workers,
            prefetch_factor=self.prefetch,
            pin_memory=self.pin_memory and self.num_workers == 1,
            worker_init_fn=functools.partial(_init_worker, os.getpid(), _trainer_exiting),
            # Its own generator: drawing the workers' base seed must not advance the checkpointed RNG.
            generator=torch.Generator(),
        )
        parts = iter(workers)
        # torch's worker processes, in index order (a private attribute: torch names a dead one by pid only).
        pids = [process.pid for process in parts._workers]
        _workers.update({process.pid: (w, process) for w, process in enumerate(parts._workers)})
        # The workers take turns: part i of the stream, part i mod N of a micro-batch, is worker i mod N's.
        parts = self._on_time(
            parts, lambda i: f"data loading worker {i % len(pids)} (pid {pids[i % len(pids)]})"
        )
        for first in parts:
            shares = [first] + [next(parts) for _ in range(self.num_workers - 1)]
            self._state = [s[1] for s in shares]  # merged when asked for: rarely, not every batch
            rows = zip(*(share.parts() for share, _ in shares))
            yield Batch(*(None if parts[0] is None else self._join(parts) for parts in rows))

    def _on_time(self, items: Iterator[T], maker: Callable[[int], str]) -> Iterator[T]:
        """`items`, each within `timeout` seconds, else a DataLoaderError naming `maker(i)`, what makes
        item i. A timer (SIGALRM, so on the main thread) interrupts whatever that thread waits on: torch's
        own timeout covers its queue only, not receiving a batch's tensors, which needs their worker to run
        (a stopped worker would hang it)."""
        for i in itertools.count():
            if self.timeout:
                previous = signal.signal(signal.SIGALRM, _expire)
                signal.setitimer(signal.ITIMER_REAL, self.timeout)
            try:
                item = next(items)
            except StopIteration:
                return
            except _Expired:
                raise DataLoaderError(
                    f"{maker(i)} made no batch within training.data_timeout_seconds = {self.timeout:g} s: "
                    "it is stalled (stopped, or blocked reading its data); launch again to resume from the "
                    "last checkpoint"
                ) from None
            finally:
                if self.timeout:
                    signal.setitimer(signal.ITIMER_REAL, 0)
                    signal.signal(signal.SIGALRM, previous)
            yield item

    def _join(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """Rows ``w, w + N, ...`` from part w."""
        if len(parts) == 1:
            return parts[0]
        rows = sum(p.shape[0] for p in parts)
        out = torch.empty((rows, *parts[0].shape[1:]), dtype=parts[0].dtype, pin_memory=self.pin_memory)
        for w, part in enumerate(parts):
            out[w :: len(parts)] = part
        return out

    def tokens_by_source(self) -> dict[str, int] | None:
        """A mixture's tokens taken from each source up to the last micro-batch taken; None otherwise."""
        if not isinstance(self.dataset, MixtureDataset):
            return None
        return self.dataset.tokens_by_source(self.state_dict()["dataset_state"])

    def state_dict(self) -> dict[str, Any]:
        """The dataset's position after the last micro-batch taken, under "dataset_state"."""
        if self.num_workers == 0 or self._state is None:
            return {"dataset_state": self.dataset.state_dict()}
        return {"dataset_state": _map_state(lambda v: torch.tensor(v, dtype=torch.long), _merge(self._state))}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Takes effect at the next `iter()`: workers start from a copy of the dataset."""
        self.dataset.load_state_dict(state_dict["dataset_state"])
        self._state = None
