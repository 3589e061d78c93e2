"""Text data -> packed ``(input_ids, labels)`` windows for pre-training.

There is one packed stream per row of the global batch (S = global batch size in sequences). Document i
of the dataset is dealt to stream ``i % S``; each stream tokenizes its documents with BOS/EOS,
concatenates them (over epochs) and cuts windows of ``seq_len + 1`` tokens. Every optimizer step takes one
window from every stream, and global row j comes from stream j, so global batch k holds the same windows in
the same order for any layout with the same global batch (1 rank x batch 4 == 2 ranks x batch 2 == 4 x 1,
with or without gradient accumulation). A rank tokenizes only the documents of its own streams.

The checkpointed state is four integers per stream (epoch, document, token offset, windows taken), keyed
by stream: a rank saves and loads only its own streams, so a run resumes on any layout with the same global
batch size. A different global batch size deals the documents differently and cannot resume the data.
"""

from collections.abc import Callable, Iterator
from typing import Any

import datasets
import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset

from torchtitan.datasets.layout import Batch, BatchLayout, worker_share
from torchtitan.datasets.streams import TextStreams, TextTokenizer
from torchtitan.logging import logger


class StreamsDataset(IterableDataset, Stateful):
    """A data-parallel rank's micro-batches, global row j of every step from stream j of `streams` (this
    rank's streams of the global batch, text's or chat's: streams.py), laid out as layout.py says; the
    state, saved and loaded, is the streams'. What a row's window becomes is the subclass's `_batch`."""

    def __init__(self, dataset_name: str, streams: TextStreams, seq_len: int, layout: BatchLayout):
        self.dataset_name = dataset_name
        self.seq_len = seq_len
        # This rank's streams, one list per micro-batch of an optimizer step.
        self._groups = layout.micro_batch_rows()
        self._streams = streams
        self._finite_steps: int | None = None  # whole global batches in a finite pass; None: never ends

    def __iter__(self) -> Iterator[Batch]:
        while True:
            # The step being filled; after a state taken mid-step, its first micro-batches are done.
            step = min(stream.windows for stream in self._streams.streams.values())
            if self._finite_steps is not None and step >= self._finite_steps:
                # The incomplete last global batch is dropped; the next pass starts from the beginning.
                self.load_state_dict(self._fresh_state())
                return
            for group in self._groups:
                if self._streams.streams[group[0]].windows > step:
                    continue
                yield self._batch(group)

    def _batch(self, rows: list[int]) -> Batch:
        """The micro-batch of streams `rows`."""
        raise NotImplementedError

    def keep_share(self, worker: int, num_workers: int) -> None:
        """Keep rows ``worker, worker + num_workers, ...`` of each micro-batch (data loading workers)."""
        self._groups = worker_share(self._groups, worker, num_workers)
        self._streams.keep_rows({s for group in self._groups for s in group})

    def _fresh_state(self) -> dict[str, Any]:
        return {self._streams.state_key: self._streams.fresh_state()}

    def state_dict(self) -> dict[str, Any]:
        """Four int64 per stream of this rank, under a key naming the global batch size they belong to:
        ranks of the same data-parallel rank hold identical entries, and a rank of another layout with the
        same global batch finds its streams among the saved ones."""
        return {self._streams.state_key: self._streams.state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        key = self._streams.state_key
        streams = state_dict.get(key)
        if streams is None:
            raise ValueError(
                f"The data loader state was saved for another global batch size or by an older loader "
                f"(it holds {', '.join(state_dict) or 'nothing'}; this run needs {key}): the data "
                "streams depend on the global batch size; keep the saved one, or start the data afresh with "
                "--checkpoint.exclude_from_loading dataloader"
            )
        self._streams.load(streams)


class TextDataset(StreamsDataset):
    """Packed ``(input_ids, labels)`` rows of one data-parallel rank, from its own streams of one text
    dataset (`ds`, map-style or streaming).

    There is one stream per row of the global batch (``grad_accum_steps * batch_size * dp_world_size``
    rows per optimizer step), laid out as layout.py says, so a rank only tokenizes the documents of its own
    ``grad_accum_steps * b`` streams and global row j of every step comes from stream j whatever the layout.
    """

    def __init__(
        self,
        dataset_name: str,
        ds: datasets.Dataset | datasets.IterableDataset,
        tokenizer: TextTokenizer,
        seq_len: int,
        batch_size: int,
        dp_world_size: int = 1,
        dp_rank: int = 0,
        grad_accum_steps: int = 1,
        infinite: bool = True,
        min_over_ranks: Callable[[int], int] | None = None,
    ):
        if min(seq_len, batch_size, grad_accum_steps) < 1:
            raise ValueError(
                f"seq_len ({seq_len}), batch_size ({batch_size}) and grad_accum_steps ({grad_accum_steps}) "
                "must be positive"
            )
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, dp_world_size={dp_world_size})")
        layout = BatchLayout(batch_size, dp_world_size, dp_rank, grad_accum_steps)
        streams = TextStreams(dataset_name, ds, tokenizer, seq_len + 1, layout.global_batch, layout.rows())
        super().__init__(dataset_name, streams, seq_len, layout)
        if not infinite:
            self._finite_steps = self._count_finite_steps(layout, min_over_ranks)

    def _count_finite_steps(self, layout: BatchLayout, min_over_ranks: Callable[[int], int] | None) -> int:
        """Whole global batches in one pass: as many as the shortest stream has windows, the same on every
        rank so that all stop after the same batch. Counted once, here: with `min_over_ranks` (the least of
        a number over the data-parallel ranks, an all-reduce) a rank tokenizes only its own streams'
        documents to count; without it, every stream's (one more tokenization of the whole pass)."""
        rows = layout.rows() if min_over_ranks is not None else list(range(layout.global_batch))
        steps = min(self._streams.tokens_per_stream(rows).values()) // (self.seq_len + 1)
        if min_over_ranks is not None:
            steps = min_over_ranks(steps)
        if steps == 0:
            logger.warning(
                f"Dataset {self.dataset_name!r} has a stream shorter than one window ({self.seq_len + 1} "
                "tokens): no batches produced"
            )
        return steps

    def _batch(self, rows: list[int]) -> Batch:
        """The micro-batch of streams `rows`: their next windows, inputs and labels shifted by one."""
        return Batch.of_windows(torch.stack([self._streams.next_window(s) for s in rows]))
