"""Text datasets -> packed ``(input_ids, labels)`` windows for pre-training.

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

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import datasets
import torch
from datasets.data_files import DataFilesDict, EmptyDatasetError, get_data_patterns
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset

from torchtitan.datasets.loader import DataLoader
from torchtitan.datasets.mixture import MixtureDataset, PretokenizedSource, Source, TextSource
from torchtitan.datasets.pretokenized import PretokenizedDataset, TokenWindows, is_pretokenized, read_manifest
from torchtitan.datasets.registry import DATASETS, DatasetSpec
from torchtitan.datasets.streams import (
    MapDocuments,
    PackedStream,
    StreamingDocuments,
    TextTokenizer,
    micro_batch_rows,
    too_small,
)
from torchtitan.logging import logger

REPO_ROOT = Path(__file__).resolve().parents[2]


# File suffix -> HF `datasets` builder. Compressed copies (e.g. C4's *.json.gz shards) work too.
_BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
_COMPRESSIONS = {".gz", ".bz2", ".xz", ".zst"}


def _builder_for(path: Path) -> str | None:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in _COMPRESSIONS:
        suffixes.pop()
    return _BUILDERS.get(suffixes[-1]) if suffixes else None


def _resolve_local_path(path: str) -> Path:
    """Relative paths are tried against the CWD, then the repository root."""
    candidates = [Path(path)] if Path(path).is_absolute() else [Path.cwd() / path, REPO_ROOT / path]
    for candidate in candidates:
        if candidate.exists():
            return candidate
    tried = " or ".join(str(c) for c in candidates)
    raise FileNotFoundError(f"Dataset path not found: {tried} (check training.dataset_path)")


def _split_files(folder: Path, split: str) -> list[Path]:
    """Files of `split` in a folder, using HF's naming conventions (train*.jsonl, *-validation-*, ...).

    A folder without split names in its file names is one "train" split.
    """
    try:
        files_by_split = DataFilesDict.from_patterns(get_data_patterns(str(folder)), base_path=str(folder))
    except EmptyDatasetError:
        files_by_split = DataFilesDict()
    if split not in files_by_split:
        found = ", ".join(sorted(str(s) for s in files_by_split)) or "none"
        raise ValueError(f"No files for split {split!r} in {folder} (splits found: {found})")
    return [Path(f) for f in files_by_split[split] if _builder_for(Path(f))]


def _load_local(path: Path, split: str) -> datasets.Dataset:
    files = [path] if path.is_file() else _split_files(path, split)
    builders = {_builder_for(f) for f in files}
    if not files or None in builders:
        raise ValueError(f"Dataset path {path} holds no .txt, .json, .jsonl or .parquet files")
    if len(builders) > 1:
        raise ValueError(f"Dataset path {path} mixes file types {sorted(builders)}; keep one type per folder")
    if all(f.stat().st_size == 0 for f in files):
        raise ValueError(f"Dataset path {path} is empty")
    builder = builders.pop()
    # A .txt file is one document; json/parquet rows are documents.
    options = {"sample_by": "document"} if builder == "text" else {}
    return datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train", **options)


def load_text_dataset(
    dataset_name: str, dataset_path: str | None = None, split: str = "train"
) -> datasets.Dataset | datasets.IterableDataset:
    """Load a registered dataset, or local files at `dataset_path`, as a dataset with one "text" column.

    `dataset_path` (a .txt/.json/.jsonl/.parquet file, or a folder of them) overrides where the data is read
    from; with it, `dataset_name` may also be a name of your own.
    """
    spec = DATASETS.get(dataset_name)
    if spec is None and dataset_path is None:
        raise ValueError(
            f"Unknown dataset {dataset_name!r}. Known datasets: {', '.join(sorted(DATASETS))}. "
            "To train on your own files, set training.dataset_path to a .txt/.json/.jsonl/.parquet file "
            "or a folder of them."
        )
    spec = spec or DatasetSpec(path=dataset_path, local=True)
    split = spec.split or split
    if dataset_path is not None:
        ds = _load_local(_resolve_local_path(dataset_path), split)
    elif spec.local:
        ds = _load_local(REPO_ROOT / spec.path, split)
    else:
        ds = datasets.load_dataset(spec.path, name=spec.config, split=split, streaming=spec.streaming)

    if isinstance(ds, datasets.Dataset) and len(ds) == 0:
        raise ValueError(f"Dataset {dataset_name!r} ({dataset_path or spec.path}, split {split!r}) is empty")
    if ds.column_names is not None and spec.text_field not in ds.column_names:
        raise ValueError(
            f"Dataset {dataset_name!r} has no {spec.text_field!r} field "
            f"(columns: {', '.join(ds.column_names)})"
        )
    ds = ds.select_columns([spec.text_field])
    if spec.text_field != "text":
        ds = ds.rename_column(spec.text_field, "text")
    return ds


class HuggingFaceDataset(IterableDataset, Stateful):
    """Packed ``(input_ids, labels)`` rows of one data-parallel rank, from its own streams.

    There is one stream per row of the global batch (``grad_accum_steps * batch_size * dp_world_size``
    rows per optimizer step). Micro-batch m of rank r holds streams ``m * D * b + r * b + [0, b)`` (D ranks,
    per-rank batch b), so a rank only tokenizes the documents of its own ``grad_accum_steps * b`` streams and
    global row j of every step comes from stream j whatever the layout.
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
    ):
        if min(seq_len, batch_size, grad_accum_steps) < 1:
            raise ValueError(
                f"seq_len ({seq_len}), batch_size ({batch_size}) and grad_accum_steps ({grad_accum_steps}) "
                "must be positive"
            )
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, dp_world_size={dp_world_size})")
        self.dataset_name = dataset_name
        self.seq_len = seq_len
        self.infinite = infinite
        self.num_streams = grad_accum_steps * batch_size * dp_world_size
        # This rank's streams, one list per micro-batch of an optimizer step.
        self._groups = micro_batch_rows(batch_size, dp_world_size, dp_rank, grad_accum_steps)
        mine = [s for group in self._groups for s in group]
        if isinstance(ds, datasets.Dataset):
            self._documents = MapDocuments(dataset_name, ds, self.num_streams)
        else:
            self._documents = StreamingDocuments(dataset_name, ds, self.num_streams, mine)
        self._streams = {
            s: PackedStream(s, self._documents, tokenizer, seq_len + 1, self._on_epoch) for s in mine
        }
        self._tokenizer = tokenizer
        self._warned_epoch = 0
        self._num_steps: int | None = None  # of a finite pass, counted on first use

    def _on_epoch(self, epoch: int) -> None:
        if epoch > self._warned_epoch:
            self._warned_epoch = epoch
            logger.warning(f"Dataset {self.dataset_name!r} is being re-looped: starting epoch {epoch}")

    def _finite_steps(self) -> int:
        """Whole global batches in one pass: as many as the shortest stream has windows. Every rank counts
        all streams (one extra tokenization of the pass) so that all stop after the same batch."""
        if self._num_steps is None:
            tokens, num_docs = [0] * self.num_streams, 0
            for i, text in enumerate(self._documents.all_texts()):
                tokens[i % self.num_streams] += len(self._tokenizer.encode(text, bos=True, eos=True))
                num_docs = i + 1
            if num_docs < self.num_streams:
                raise too_small(self.dataset_name, num_docs, self.num_streams)
            self._num_steps = min(tokens) // (self.seq_len + 1)
            if self._num_steps == 0:
                logger.warning(
                    f"Dataset {self.dataset_name!r} has a stream shorter than one window ({self.seq_len + 1} "
                    "tokens): no batches produced"
                )
        return self._num_steps

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            # The step being filled; after a state taken mid-step, its first micro-batches are done.
            step = min(stream.windows for stream in self._streams.values())
            if not self.infinite and step >= self._finite_steps():
                # The incomplete last global batch is dropped; the next pass starts from the beginning.
                self.load_state_dict(self._fresh_state())
                return
            for group in self._groups:
                if self._streams[group[0]].windows > step:
                    continue
                batch = torch.stack([self._streams[s].next_window() for s in group])
                yield batch[:, :-1], batch[:, 1:]

    def keep_share(self, worker: int, num_workers: int) -> None:
        """Keep rows ``worker, worker + num_workers, ...`` of each micro-batch (data loading workers)."""
        self._groups = [group[worker::num_workers] for group in self._groups]
        kept = {s for group in self._groups for s in group}
        self._streams = {s: stream for s, stream in self._streams.items() if s in kept}
        self._documents.reset({s: (stream.epoch, stream.doc) for s, stream in self._streams.items()})

    def _key(self) -> str:
        return f"global_batch_{self.num_streams}"

    def _fresh_state(self) -> dict[str, Any]:
        return {self._key(): {f"stream_{s}": torch.zeros(4, dtype=torch.long) for s in self._streams}}

    def state_dict(self) -> dict[str, Any]:
        """Four int64 per stream of this rank, under a key naming the global batch size they belong to:
        ranks of the same data-parallel rank hold identical entries, and a rank of another layout with the
        same global batch finds its streams among the saved ones."""
        return {self._key(): {f"stream_{s}": stream.state() for s, stream in self._streams.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        streams = state_dict.get(self._key())
        if streams is None:
            raise ValueError(
                f"The data loader state was saved for another global batch size or by an older loader "
                f"(it holds {', '.join(state_dict) or 'nothing'}; this run needs {self._key()}): the data "
                "streams depend on the global batch size; keep the saved one, or start the data afresh with "
                "--checkpoint.exclude_from_loading dataloader"
            )
        for s, stream in self._streams.items():
            stream.load(streams[f"stream_{s}"])
        self._documents.reset({s: (stream.epoch, stream.doc) for s, stream in self._streams.items()})


def _mixture_reader(
    source: str,
    split: str,
    tokenizer: TextTokenizer,
    seq_len: int,
    num_streams: int,
    rows: list[int],
    seed: int,
    shuffle: bool,
    vocab_size: int | None,
) -> TextSource | PretokenizedSource:
    """A mixture source: a registered name, else a path (pre-tokenized folder, or text files)."""
    if source not in DATASETS and is_pretokenized(folder := _resolve_local_path(source)):
        manifest = read_manifest(folder, tokenizer.model_path, vocab_size or tokenizer.n_words)
        return PretokenizedSource(source, TokenWindows(folder, manifest, seq_len + 1), seed, shuffle)
    ds = load_text_dataset(source, None if source in DATASETS else source, split)
    return TextSource(source, ds, tokenizer, seq_len + 1, num_streams, rows)


def build_hf_data_loader(
    dataset_name: str,
    dataset_path: str | None,
    tokenizer: TextTokenizer,
    batch_size: int,
    seq_len: int,
    dp_world_size: int,
    dp_rank: int,
    grad_accum_steps: int = 1,
    infinite: bool = True,
    split: str = "train",
    seed: int = 0,
    shuffle: bool = False,
    vocab_size: int | None = None,
    mixture: list[tuple[str, float]] | None = None,
    num_workers: int = 0,
    prefetch: int = 2,
    pin_memory: bool = False,
) -> DataLoader:
    """One data-parallel rank's loader of ``(input_ids, labels)`` batches, both ``(batch_size, seq_len)``.

    `batch_size` is per rank; each optimizer step takes `grad_accum_steps` batches. The windows depend only
    on the global batch size: row j of global batch k is window k of stream j, so the loader's state taken
    between steps can be loaded under any layout with the same global batch size.

    A `dataset_path` folder with a manifest.json is pre-tokenized data (pretokenized.py), read by memory map
    and checked against `tokenizer`'s file and the model's `vocab_size` (default: the tokenizer's); `seed`
    and `shuffle` order its windows. Its state resumes under any layout and global batch size.

    `mixture` ((source, weight) pairs: registered names, text files or folders, pre-tokenized folders)
    draws every row from one of them by weight instead (mixture.py); `dataset_name` and `dataset_path`
    are then unused.

    `num_workers` processes make the batches, `prefetch` each ahead, in pinned memory with `pin_memory`
    (loader.py); the loader's state is the same with or without them.
    """
    if mixture:
        rows = [
            row
            for group in micro_batch_rows(batch_size, dp_world_size, dp_rank, grad_accum_steps)
            for row in group
        ]
        num_streams = grad_accum_steps * batch_size * dp_world_size
        sources = [
            Source(
                name,
                weight,
                _mixture_reader(
                    name, split, tokenizer, seq_len, num_streams, rows, seed, shuffle, vocab_size
                ),
            )
            for name, weight in mixture
        ]
        dataset = MixtureDataset(sources, seq_len, batch_size, dp_world_size, dp_rank, grad_accum_steps, seed)
        return DataLoader(dataset, batch_size, num_workers, prefetch, pin_memory)
    if dataset_path is not None and is_pretokenized(folder := _resolve_local_path(dataset_path)):
        manifest = read_manifest(folder, tokenizer.model_path, vocab_size or tokenizer.n_words)
        pretokenized = PretokenizedDataset(
            folder,
            manifest,
            seq_len,
            batch_size,
            dp_world_size,
            dp_rank,
            grad_accum_steps,
            infinite=infinite,
            seed=seed,
            shuffle=shuffle,
        )
        return DataLoader(pretokenized, batch_size, num_workers, prefetch, pin_memory)
    ds = load_text_dataset(dataset_name, dataset_path, split)
    dataset = HuggingFaceDataset(
        dataset_name,
        ds,
        tokenizer,
        seq_len,
        batch_size,
        dp_world_size,
        dp_rank,
        grad_accum_steps=grad_accum_steps,
        infinite=infinite,
    )
    return DataLoader(dataset, batch_size, num_workers, prefetch, pin_memory)
