"""Packed token streams: the documents dealt to one row of the global batch, tokenized and cut into windows.

Document i of a map-style dataset belongs to stream ``i % num_streams``, so a stream's n-th document is
document ``stream + num_streams * n``; a streaming dataset deals its files to groups of streams instead
(`StreamingDocuments`), so that a rank opens only the files its streams read. A rank tokenizes the documents
of its own streams only; nothing here depends on how many ranks there are. `TextStreams` is what a text
dataset and a mixture's text source hold.
"""

from collections import deque
from collections.abc import Callable, Iterator
from itertools import chain
from typing import Protocol

import datasets
import torch

from torchtitan.datasets.layout import warn_relooped


class TextTokenizer(Protocol):
    def encode(self, s: str, bos: bool, eos: bool) -> list[int]: ...


def too_small(name: str, num_docs: int, num_streams: int) -> ValueError:
    return ValueError(
        f"Dataset {name!r} has {num_docs} documents, fewer than the {num_streams} sequences of a global "
        "batch (each row of a global batch reads its own documents): use more data or a smaller global batch"
    )


class MapDocuments:
    """A map-style dataset: random access to any stream's n-th document."""

    def __init__(self, name: str, ds: datasets.Dataset, num_streams: int):
        if len(ds) < num_streams:
            raise too_small(name, len(ds), num_streams)
        self.ds = ds
        self.num_streams = num_streams

    def reset(self, starts: dict[int, tuple[int, int]]) -> None:
        """Nothing to do: documents are read by index."""

    def get(self, stream: int, epoch: int, n: int) -> str | None:
        """Document n of `stream` in `epoch`, or None past the stream's last document."""
        i = stream + self.num_streams * n
        return self.ds[i]["text"] if i < len(self.ds) else None

    def epoch_texts(self, streams: set[int]) -> Iterator[tuple[int, str]]:
        """(stream, document) for every document of `streams` in an epoch; the others are not read."""
        for i in range(len(self.ds)):
            if i % self.num_streams in streams:
                yield i % self.num_streams, self.ds[i]["text"]


class _GroupReader:
    """Where one group's reading stands: its epoch, the index of the next document among the group's, and
    the open iterator over its files (None until the next document is wanted)."""

    def __init__(self, streams: range, epoch: int, index: int):
        self.streams = streams
        self.epoch, self.index = epoch, index
        self.texts: Iterator[str] | None = None


class StreamingDocuments:
    """A streaming dataset, read in order from the start of each epoch, its files (shards) dealt to groups
    of streams so that a rank opens only the files that hold its streams' documents.

    With F files and S streams there are G = min(F, S) groups: file f and stream s belong to group
    ``f % G`` and ``s % G``, and a group's documents (its files in order) are dealt in turn to its streams.
    At F >= S every stream reads files of its own; a source with fewer files than streams shares each file
    among S / G streams (read by each of their ranks, skipped where not theirs); with one file (G = 1),
    document i goes to stream ``i % S`` as with map-style data. The dealing depends only on F and S, never
    on the layout.

    Documents of this rank's streams are queued (raw text, tokenized only when their stream reaches them),
    the others are skipped over. Streams consume documents at slightly different rates, so the queues hold,
    untokenized, the documents dealt to the faster streams of a group while the slowest one catches up.
    Resuming skips each group to the earliest document its streams need: that costs reading, not tokenizing.
    """

    def __init__(self, name: str, ds: datasets.IterableDataset, num_streams: int, streams: list[int]):
        self.name = name
        self.ds = ds
        self.num_streams = num_streams
        self.num_groups = min(ds.n_shards, num_streams)
        self.reset({s: (0, 0) for s in streams})

    def _group_streams(self, group: int) -> range:
        return range(group, self.num_streams, self.num_groups)

    def _group_documents(self, group: int) -> datasets.IterableDataset:
        """The documents of files ``group, group + G, ...``, in order: only those files are opened."""
        if self.num_groups == 1:
            return self.ds
        return self.ds.shard(num_shards=self.num_groups, index=group, contiguous=False)

    def _too_small(self, group: int, num_docs: int) -> ValueError:
        if self.num_groups == 1:
            return too_small(self.name, num_docs, self.num_streams)
        files = [str(f) for f in range(group, self.ds.n_shards, self.num_groups)]
        shown = ", ".join(files[:3]) + (", ..." if len(files) > 3 else "")
        return ValueError(
            f"Dataset {self.name!r} deals its {self.ds.n_shards} files to {self.num_groups} groups of the "
            f"{self.num_streams} sequences of a global batch, and group {group} (file {shown}) has "
            f"{num_docs} documents, fewer than its {len(self._group_streams(group))} sequences: use more "
            "data or a smaller global batch"
        )

    def reset(self, starts: dict[int, tuple[int, int]]) -> None:
        """Read on from `starts` (stream -> (epoch, n)); each group skips to the first document its streams
        need."""
        self._starts = starts
        self._queues: dict[int, deque[tuple[int, int, str | None]]] = {s: deque() for s in starts}
        self._readers: dict[int, _GroupReader] = {}
        for group in sorted({s % self.num_groups for s in starts}):
            streams = self._group_streams(group)
            epoch, first = min(
                (e, streams.index(s) + len(streams) * n) for s, (e, n) in starts.items() if s in streams
            )
            self._readers[group] = _GroupReader(streams, epoch, first)

    def _read_one(self, group: int) -> None:
        """Queue the group's next document for its stream if it is one of ours; at the end of an epoch,
        queue an end-of-epoch marker (text None) for every stream of the group."""
        reader = self._readers[group]
        if reader.texts is None:
            ds = self._group_documents(group)
            ds.set_epoch(reader.epoch)
            ds = ds.skip(reader.index) if reader.index else ds
            # In batches: a rank reads its groups' every document, so reading costs as much as tokenizing.
            reader.texts = chain.from_iterable(batch["text"] for batch in ds.iter(batch_size=256))
        text = next(reader.texts, None)
        streams = reader.streams
        if text is None:
            if reader.index < len(streams):
                raise self._too_small(group, reader.index)
            for s in streams:
                if s in self._queues and reader.epoch >= self._starts[s][0]:
                    self._queues[s].append((reader.epoch, -1, None))
            reader.epoch, reader.index, reader.texts = reader.epoch + 1, 0, None
            return
        s, n = streams[reader.index % len(streams)], reader.index // len(streams)
        if s in self._queues and (reader.epoch, n) >= self._starts[s]:
            self._queues[s].append((reader.epoch, n, text))
        reader.index += 1

    def get(self, stream: int, epoch: int, n: int) -> str | None:
        queue = self._queues[stream]
        while not queue:
            self._read_one(stream % self.num_groups)
        got_epoch, got_n, text = queue.popleft()
        assert got_epoch == epoch and got_n in (n, -1), (stream, epoch, n, got_epoch, got_n)
        return text

    def epoch_texts(self, streams: set[int]) -> Iterator[tuple[int, str]]:
        """(stream, document) for every document of `streams` in an epoch; only their groups' files are
        read, the other documents there skipped."""
        for group in sorted({s % self.num_groups for s in streams}):
            ds = self._group_documents(group)
            ds.set_epoch(0)
            group_streams = self._group_streams(group)
            num_docs = 0
            for i, example in enumerate(ds):
                s = group_streams[i % len(group_streams)]
                if s in streams:
                    yield s, example["text"]
                num_docs = i + 1
            if num_docs < len(group_streams):
                raise self._too_small(group, num_docs)


class PackedStream:
    """One stream: its documents with BOS/EOS, concatenated over epochs and cut into windows.

    Its state is four integers: the epoch, the index of its current document among its own, the offset of
    the next token in that document's tokens, and the number of windows taken so far.
    """

    def __init__(
        self,
        index: int,
        documents: MapDocuments | StreamingDocuments,
        tokenizer: TextTokenizer,
        window: int,
        on_epoch: Callable[[int], None],
    ):
        self.index = index
        self._documents = documents
        self._tokenizer = tokenizer
        self._window = window
        self._on_epoch = on_epoch
        self.load(torch.zeros(4, dtype=torch.long))

    def state(self) -> torch.Tensor:
        return torch.tensor([self.epoch, self.doc, self.offset, self.windows], dtype=torch.long)

    def load(self, state: torch.Tensor) -> None:
        self.epoch, self.doc, self.offset, self.windows = (int(v) for v in state)
        self._tokens: list[int] | None = None  # the current document's, tokenized again after a load

    def _tokenize_current(self) -> list[int]:
        text = self._documents.get(self.index, self.epoch, self.doc)
        if text is None:  # past this stream's last document: the next epoch starts
            self.epoch, self.doc, self.offset = self.epoch + 1, 0, 0
            self._on_epoch(self.epoch)
            text = self._documents.get(self.index, self.epoch, self.doc)
        return self._tokenizer.encode(text, bos=True, eos=True)

    def next_window(self) -> torch.Tensor:
        out: list[int] = []
        while len(out) < self._window:
            if self._tokens is None:
                self._tokens = self._tokenize_current()
            take = self._tokens[self.offset : self.offset + self._window - len(out)]
            out += take
            self.offset += len(take)
            if len(out) < self._window:
                self.doc, self.offset, self._tokens = self.doc + 1, 0, None
        self.windows += 1
        return torch.tensor(out, dtype=torch.long)


class TextStreams:
    """A rank's packed streams of one text dataset: of the `num_streams` streams (document i to stream
    ``i % num_streams``, one per row of the global batch) it holds those of `rows`.

    Their state is four integers per stream, keyed ``stream_{row}``: a rank saves and loads only its own
    streams, so a layout with the same global batch finds its streams among the saved ones.
    """

    what = "Dataset"  # names the data in the warning logged when its streams start a new epoch

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
        self.num_streams = num_streams
        self._tokenizer = tokenizer
        if isinstance(ds, datasets.Dataset):
            self.documents: MapDocuments | StreamingDocuments = MapDocuments(name, ds, num_streams)
        elif isinstance(ds, datasets.IterableDataset):
            self.documents = StreamingDocuments(name, ds, num_streams, rows)
        else:  # documents of its own kind (pre-tokenized conversations: chat_shards.py)
            self.documents = ds
        self.streams = {s: self._make_stream(s, tokenizer, window) for s in rows}
        # The streams depend on how many there are: their state is saved under a key that says so.
        self.state_key = f"global_batch_{num_streams}"
        self._warned_epoch = 0

    def _make_stream(self, index: int, tokenizer: TextTokenizer, window: int) -> PackedStream:
        return PackedStream(index, self.documents, tokenizer, window, self._on_epoch)

    def _on_epoch(self, epoch: int) -> None:
        if epoch > self._warned_epoch:
            self._warned_epoch = epoch
            warn_relooped(f"{self.what} {self.name!r}", epoch)

    def tokens_per_stream(self, rows: list[int]) -> dict[int, int]:
        """The tokens of the documents of streams `rows` (this rank's or not) in one epoch, tokenizing those
        documents only: where a finite pass ends."""
        tokens = dict.fromkeys(rows, 0)
        for stream, text in self.documents.epoch_texts(set(rows)):
            tokens[stream] += len(self._tokenizer.encode(text, bos=True, eos=True))
        return tokens

    def next_window(self, row: int) -> torch.Tensor:
        return self.streams[row].next_window()

    def keep_rows(self, rows: set[int]) -> None:
        """Drop the other streams (a data loading worker keeps its share of the rows)."""
        self.streams = {s: stream for s, stream in self.streams.items() if s in rows}
        self._reset_documents()

    def state(self) -> dict[str, torch.Tensor]:
        return {f"stream_{s}": stream.state() for s, stream in self.streams.items()}

    def fresh_state(self) -> dict[str, torch.Tensor]:
        """The state of streams that have read nothing yet."""
        return {f"stream_{s}": torch.zeros_like(stream.state()) for s, stream in self.streams.items()}

    def load(self, state: dict[str, torch.Tensor]) -> None:
        for s, stream in self.streams.items():
            stream.load(state[f"stream_{s}"])
        self._reset_documents()

    def _reset_documents(self) -> None:
        self.documents.reset({s: (stream.epoch, stream.doc) for s, stream in self.streams.items()})
