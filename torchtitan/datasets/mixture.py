"""Mixtures (`training.mixture`): each row of every global batch drawn from one of several sources, by weight.

Global row j of optimizer step k comes from source ``choice(k, j)``: a uniform number hashed from
``training.seed``, k and j, looked up in the weights' cumulative distribution. The choice is a function of
(seed, step, row) only, so every layout with the same global batch size S sees the same batches, and every
rank can compute the whole step's choices (S hashes) without talking to the others.

What a row reads from its source:
- text (a registered name or local files): the next window of that source's stream j, as the single-source
  text loader deals documents (document i to stream ``i % S``). A stream advances only when its row picks
  its source, and a rank tokenizes only its own rows' documents.
- chat (chat.enable; every source is conversations): the next window of whole conversations of that
  source's stream j (chat_data.py), with its labels and positions.
- pre-tokenized: the source's n-th window of the run, n counting the rows that took it in earlier steps and
  in earlier rows of this step; epochs follow each other without a gap (window ``order(n % W)`` of epoch
  ``n // W``, W windows, `order` seeded and new each epoch when `training.shuffle_windows`).

The state: the step, the micro-batches done in it and the rows each source gave so far (the same on every
rank), the four integers of each text stream of this rank, and a fingerprint of the source list and of each
source's content (its shard checksums, or its files' sizes and modification times). The weights may change
between runs (the rows already taken stay taken); the sources may not.
"""

import functools
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset

from torchtitan.config.options import ConfigError
from torchtitan.datasets.chat_data import ChatStreams
from torchtitan.datasets.layout import Batch, BatchLayout, StepCursor, warn_relooped
from torchtitan.datasets.pretokenized import TokenWindows, WindowOrder, splitmix64
from torchtitan.datasets.streams import TextStreams
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


def fingerprint(names: list[str], contents: list[str]) -> int:
    """Identifies the list of sources (as given) and their content in the checkpoint; a checkpoint saved
    before contents were fingerprinted holds that of the names alone (no `contents`)."""
    return zlib.crc32("\n".join(names + contents).encode())


class TextSource(TextStreams):
    """A text source of a mixture: S packed streams (streams.py), of which this rank keeps its own rows'."""

    what = "Mixture source"

    def read(self, row: int, n: int) -> torch.Tensor:
        """Row `row`'s next window (its stream's); `n` is not needed."""
        return self.next_window(row)


class ChatSource(ChatStreams):
    """A chat source of a mixture (chat.enable): S streams of windows of whole conversations
    (chat_data.py); a row reads its stream's next window, its input ids, labels and positions stacked."""

    what = "Mixture source"

    def read(self, row: int, n: int) -> torch.Tensor:
        return torch.stack(self.next_window(row))


class PretokenizedSource:
    """A pre-tokenized source of a mixture: its n-th row is window ``order(n % W)`` of epoch ``n // W``."""

    def __init__(self, name: str, windows: TokenWindows, seed: int, shuffle: bool):
        if windows.num_windows == 0:
            raise ValueError(
                f"source {name!r} holds {windows.num_tokens} tokens, fewer than one window of seq_len + 1 = "
                f"{windows.window}: give it more data or leave it out"
            )
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
                warn_relooped(f"Mixture source {self.name!r}", epoch)
            self._epoch, self._order = epoch, self._order_of(epoch)
        return torch.from_numpy(self._windows.read(self._order(w)).astype(np.int64))


@dataclass
class Source:
    name: str  # as given in training.mixture
    weight: float
    reader: TextSource | PretokenizedSource | ChatSource
    # What identifies the source's content in the checkpoint: a pre-tokenized source's shard checksums
    # (`TokenWindows.contents`), a local text source's files' sizes and times (`file_stats`); "" for none.
    contents: str = ""


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
        """`sources`' text readers must hold the streams of this rank's rows (`BatchLayout.rows`)."""
        self.sources = sources
        self._chat = isinstance(sources[0].reader, ChatSource)  # chat.enable: every source is conversations
        self.seq_len = seq_len
        self.seed = seed
        self._cursor = StepCursor(BatchLayout(batch_size, dp_world_size, dp_rank, grad_accum_steps))
        self.global_batch = self._cursor.global_batch
        self._names = [s.name for s in sources]
        self._fingerprint = fingerprint(self._names, [s.contents for s in sources])
        self.step = 0
        self.rows = np.zeros(len(sources), dtype=np.int64)

    def _weights(self) -> list[float]:
        return [s.weight for s in self.sources]

    def __iter__(self) -> Iterator[Batch]:
        while True:
            choices = row_choices(self.seed, self.step, self.global_batch, self._weights())
            # A row's place among this step's rows of the same source: pre-tokenized sources count rows.
            rank_in_source = np.zeros(self.global_batch, dtype=np.int64)
            for i in range(len(self.sources)):
                picked = choices == i
                rank_in_source[picked] = np.arange(np.count_nonzero(picked))
            yield from self._cursor.rest_of_step(
                functools.partial(self._micro_batch, choices, rank_in_source),
                functools.partial(self._step_done, choices),
            )

    def _micro_batch(self, choices: np.ndarray, rank_in_source: np.ndarray, rows: list[int]) -> Batch:
        stacked = torch.stack([self._read(row, choices[row], rank_in_source[row]) for row in rows])
        # Chat rows stack their ids, labels and positions; text rows are windows of seq_len + 1 tokens.
        return Batch(*stacked.unbind(1)) if self._chat else Batch.of_windows(stacked)

    def _step_done(self, choices: np.ndarray) -> None:
        self.rows += np.bincount(choices, minlength=len(self.sources))
        self.step += 1

    def keep_share(self, worker: int, num_workers: int) -> None:
        """Keep rows ``worker, worker + num_workers, ...`` of each micro-batch (data loading workers)."""
        self._cursor.keep_share(worker, num_workers)
        kept = {row for rows in self._cursor.micro_rows for row in rows}
        for source in self.sources:
            if isinstance(source.reader, TextStreams):
                source.reader.keep_rows(kept)

    def _read(self, row: int, source: int, rank_in_source: int) -> torch.Tensor:
        return self.sources[source].reader.read(row, int(self.rows[source]) + rank_in_source)

    def tokens_by_source(self, state: dict[str, Any]) -> dict[str, int]:
        """Tokens taken from each source up to `state` (rows x seq_len), over all ranks."""
        return {s.name: int(state[f"source_{i}"]["rows"]) * self.seq_len for i, s in enumerate(self.sources)}

    def state_dict(self) -> dict[str, Any]:
        """Per source its rows taken and (text) this rank's streams, under a key naming the global batch
        size: the text streams depend on it."""
        state: dict[str, Any] = {
            "mixture": torch.tensor(
                [self.step, self._cursor.micro, self.global_batch, self._fingerprint], dtype=torch.long
            )
        }
        for i, source in enumerate(self.sources):
            entry: dict[str, Any] = {"rows": torch.tensor(int(self.rows[i]), dtype=torch.long)}
            if isinstance(source.reader, TextStreams):
                entry[source.reader.state_key] = source.reader.state()
            state[f"source_{i}"] = entry
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "mixture" not in state_dict:
            raise ValueError(
                "The data loader state was not saved by a mixture (training.mixture); start the data afresh "
                "with --checkpoint.exclude_from_loading dataloader"
            )
        step, micro, global_batch, saved_fingerprint = (int(v) for v in state_dict["mixture"])
        if saved_fingerprint == fingerprint(self._names, []):
            logger.info("training.mixture: the checkpoint predates fingerprints of the sources' content")
        elif saved_fingerprint != self._fingerprint:
            raise ConfigError(
                "training.mixture: the checkpoint's data state is of another list of sources, or a source "
                "changed since (a text source's file sizes or modification times, a pre-tokenized source's "
                "shard checksums); give the same sources in the same order, unchanged (the weights may "
                "change), or start the data afresh with --checkpoint.exclude_from_loading dataloader"
            )
        self._cursor.load(micro, global_batch)
        self.step = step
        for i, source in enumerate(self.sources):
            entry = state_dict[f"source_{i}"]
            self.rows[i] = int(entry["rows"])
            if isinstance(source.reader, TextStreams):
                source.reader.load(entry[source.reader.state_key])
