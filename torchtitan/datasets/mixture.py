"""Mixtures (`training.mixture`): each row of every global batch drawn from one of several sources, by weight.

Global row j of optimizer step k comes from source ``choice(k, j)``: a uniform number hashed from
``training.seed``, k and j, looked up in the weights' cumulative distribution. The choice is a function of
(seed, step, row) only, so every layout with the same global batch size S sees the same batches, and every
rank can compute the whole step's choices (S hashes) without talking to the others.

What a row reads from its source:
- text (a registered name or local files): the next window of that source's stream j, as the single-source
  text loader deals documents (document i to stream ``i % S``). A stream advances only when its row picks
  its source, and a rank tokenizes only its own rows' documents.
- pre-tokenized: the source's n-th window of the run, n counting the rows that took it in earlier steps and
  in earlier rows of this step; epochs follow each other without a gap (window ``order(n % W)`` of epoch
  ``n // W``, W windows, `order` seeded and new each epoch when `training.shuffle_windows`).

The state: the step, the micro-batches done in it and the rows each source gave so far (the same on every
rank), the four integers of each text stream of this rank, and a fingerprint of the source list. The
weights may change between runs (the rows already taken stay taken); the sources may not.
"""

import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import datasets
import numpy as np
import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset

from torchtitan.datasets.pretokenized import TokenWindows, WindowOrder, splitmix64
from torchtitan.datasets.streams import (
    MapDocuments,
    PackedStream,
    StreamingDocuments,
    TextTokenizer,
    micro_batch_rows,
)
from torchtitan.logging import logger

_MIXTURE_SALT = 0x6D69787475726521  # keeps the row choices apart from other uses of the seed


def _splitmix64_array(x: np.ndarray) -> np.ndarray:
    """splitmix64 of every element of a uint64 array (it wraps around, as the scalar one masks)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def row_choices(seed: int, step: int, global_batch: int, weights: list[float]) -> np.ndarray:
    """The source index of each of the `global_batch` rows of optimizer step `step` (0-based)."""
    key = splitmix64(splitmix64(seed ^ _MIXTURE_SALT) ^ step)
    bits = _splitmix64_array(np.uint64(key) ^ np.arange(global_batch, dtype=np.uint64))
    uniform = (bits >> np.uint64(11)).astype(np.float64) * 2.0**-53  # [0, 1)
    cumulative = np.cumsum(weights, dtype=np.float64) / sum(weights)
    cumulative[-1] = 1.0  # rounding must not leave a gap at the top
    return np.searchsorted(cumulative, uniform, side="right")


def fingerprint(names: list[str]) -> int:
    """Identifies the list of sources (as given) in the checkpoint."""
    return zlib.crc32("\n".join(names).encode())


class TextSource:
    """A text source of a mixture: S packed streams (document i to stream i % S), of which this rank keeps
    its own rows'."""

    def __init__(
        self,
        name: str,
        ds: datasets.Dataset | datasets.IterableDataset,
        tokenizer: TextTokenizer,
        window: int,
        num_streams: int,
        rows: list[int],
    ):
        self.name = name
        if isinstance(ds, datasets.Dataset):
            self._documents = MapDocuments(name, ds, num_streams)
        else:
            self._documents = StreamingDocuments(name, ds, num_streams, rows)
        self._streams = {s: PackedStream(s, self._documents, tokenizer, window, self._on_epoch) for s in rows}
        self._warned_epoch = 0

    def _on_epoch(self, epoch: int) -> None:
        if epoch > self._warned_epoch:
            self._warned_epoch = epoch
            logger.warning(f"Mixture source {self.name!r} is being re-looped: starting epoch {epoch}")

    def read(self, row: int, n: int) -> torch.Tensor:
        """Row `row`'s next window (its stream's); `n` is not needed."""
        return self._streams[row].next_window()

    def keep_rows(self, rows: set[int]) -> None:
        self._streams = {s: stream for s, stream in self._streams.items() if s in rows}
        self._documents.reset({s: (stream.epoch, stream.doc) for s, stream in self._streams.items()})

    def state(self) -> dict[str, torch.Tensor]:
        return {f"stream_{s}": stream.state() for s, stream in self._streams.items()}

    def load(self, state: dict[str, torch.Tensor]) -> None:
        for s, stream in self._streams.items():
            stream.load(state[f"stream_{s}"])
        self._documents.reset({s: (stream.epoch, stream.doc) for s, stream in self._streams.items()})


class PretokenizedSource:
    """A pre-tokenized source of a mixture: its n-th row is window ``order(n % W)`` of epoch ``n // W``."""

    def __init__(self, name: str, windows: TokenWindows, seed: int, shuffle: bool):
        self.name = name
        self._windows = windows
        self._seed, self._shuffle = seed, shuffle
        self._epoch, self._order = 0, self._order_of(0)

    def _order_of(self, epoch: int) -> Callable[[int], int]:
        if self._shuffle:
            return WindowOrder(self._windows.num_windows, self._seed, epoch)
        return lambda w: w

    def read(self, row: int, n: int) -> torch.Tensor:
        """The source's n-th window of the run; a rank reads its rows' in increasing n."""
        epoch, w = divmod(n, self._windows.num_windows)
        if epoch != self._epoch:
            if epoch > self._epoch:
                logger.warning(f"Mixture source {self.name!r} is being re-looped: starting epoch {epoch}")
            self._epoch, self._order = epoch, self._order_of(epoch)
        return torch.from_numpy(self._windows.read(self._order(w)).astype(np.int64))


@dataclass
class Source:
    name: str  # as given in training.mixture
    weight: float
    reader: TextSource | PretokenizedSource


class MixtureDataset(IterableDataset, Stateful):
    """One data-parallel rank's ``(input_ids, labels)`` micro-batches, each ``(batch_size, seq_len)``, with
    every row drawn from one of `sources` by weight (module docstring). Micro-batch m of rank r holds
    global rows ``m * D * b + r * b + [0, b)``, as the single-source loaders."""

    def __init__(
        self,
        sources: list[Source],
        seq_len: int,
        batch_size: int,
        dp_world_size: int = 1,
        dp_rank: int = 0,
        grad_accum_steps: int = 1,
        seed: int = 0,
    ):
        """`sources`' text readers must hold the streams of this rank's rows (`micro_batch_rows`)."""
        self.sources = sources
        self.seq_len = seq_len
        self.seed = seed
        self.global_batch = grad_accum_steps * batch_size * dp_world_size
        self._micro_rows = micro_batch_rows(batch_size, dp_world_size, dp_rank, grad_accum_steps)
        self._fingerprint = fingerprint([s.name for s in sources])
        self.step, self.micro = 0, 0
        self.rows = np.zeros(len(sources), dtype=np.int64)

    def _weights(self) -> list[float]:
        return [s.weight for s in self.sources]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            choices = row_choices(self.seed, self.step, self.global_batch, self._weights())
            # A row's place among this step's rows of the same source: pre-tokenized sources count rows.
            rank_in_source = np.zeros(self.global_batch, dtype=np.int64)
            for i in range(len(self.sources)):
                picked = choices == i
                rank_in_source[picked] = np.arange(np.count_nonzero(picked))
            for m in range(self.micro, len(self._micro_rows)):
                batch = torch.stack(
                    [self._read(row, choices[row], rank_in_source[row]) for row in self._micro_rows[m]]
                )
                self.micro = m + 1
                if self.micro == len(self._micro_rows):  # the state taken after a step counts it
                    self.rows += np.bincount(choices, minlength=len(self.sources))
                    self.step, self.micro = self.step + 1, 0
                yield batch[:, :-1], batch[:, 1:]

    def keep_share(self, worker: int, num_workers: int) -> None:
        """Keep rows ``worker, worker + num_workers, ...`` of each micro-batch (data loading workers)."""
        self._micro_rows = [rows[worker::num_workers] for rows in self._micro_rows]
        kept = {row for rows in self._micro_rows for row in rows}
        for source in self.sources:
            if isinstance(source.reader, TextSource):
                source.reader.keep_rows(kept)

    def _read(self, row: int, source: int, rank_in_source: int) -> torch.Tensor:
        return self.sources[source].reader.read(row, int(self.rows[source]) + rank_in_source)

    def tokens_by_source(self, state: dict[str, Any]) -> dict[str, int]:
        """Tokens taken from each source up to `state` (rows x seq_len), over all ranks."""
        return {s.name: int(state[f"source_{i}"]["rows"]) * self.seq_len for i, s in enumerate(self.sources)}

    def _key(self) -> str:
        return f"global_batch_{self.global_batch}"

    def state_dict(self) -> dict[str, Any]:
        """Per source its rows taken and (text) this rank's streams, under a key naming the global batch
        size: the text streams depend on it."""
        state: dict[str, Any] = {
            "mixture": torch.tensor(
                [self.step, self.micro, self.global_batch, self._fingerprint], dtype=torch.long
            )
        }
        for i, source in enumerate(self.sources):
            entry: dict[str, Any] = {"rows": torch.tensor(int(self.rows[i]), dtype=torch.long)}
            if isinstance(source.reader, TextSource):
                entry[self._key()] = source.reader.state()
            state[f"source_{i}"] = entry
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "mixture" not in state_dict:
            raise ValueError(
                "The data loader state was not saved by a mixture (training.mixture); start the data afresh "
                "with --checkpoint.exclude_from_loading dataloader"
            )
        step, micro, global_batch, saved_fingerprint = (int(v) for v in state_dict["mixture"])
        if saved_fingerprint != self._fingerprint:
            raise ValueError(
                "training.mixture: the checkpoint's data state is of another list of sources; give the same "
                "sources in the same order (the weights may change), or start the data afresh with "
                "--checkpoint.exclude_from_loading dataloader"
            )
        if micro and global_batch != self.global_batch:
            raise ValueError(
                f"The data loader state was taken in the middle of an optimizer step of {global_batch} "
                f"sequences; resume it with that global batch size (this run's is {self.global_batch})"
            )
        self.step, self.micro = step, micro
        for i, source in enumerate(self.sources):
            entry = state_dict[f"source_{i}"]
            self.rows[i] = int(entry["rows"])
            if isinstance(source.reader, TextSource):
                source.reader.load(entry[self._key()])
