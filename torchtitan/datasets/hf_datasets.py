"""Text datasets -> packed ``(input_ids, labels)`` windows for pre-training.

Documents are tokenized with BOS/EOS, concatenated into one token stream and cut into windows of
``seq_len + 1`` tokens. The stream of windows is global: every data-parallel rank walks all of it and keeps
only its own slice of each global batch, so global batch k holds the same windows in the same order for any
layout (1 rank x batch 4 == 2 ranks x batch 2). The checkpointed state describes a position in that global
stream, so a run can resume on a different number of ranks or per-rank batch size without repeating or
skipping a window.
"""

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import datasets
import torch
from datasets.data_files import DataFilesDict, EmptyDatasetError, get_data_patterns
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from torchtitan.logging import logger

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class DatasetSpec:
    """Where a named dataset lives and how to read it."""

    path: str  # hub id, or a folder/file relative to the repository root when `local`
    local: bool = False
    config: str | None = None  # hub config name, e.g. "en" for C4
    split: str | None = None  # pins the split (validation aliases); None uses the caller's split
    streaming: bool = False
    text_field: str = "text"


DATASETS: dict[str, DatasetSpec] = {
    "kjv": DatasetSpec(path="assets/corpus/kjv", local=True),
    "kjv_validation": DatasetSpec(path="assets/corpus/kjv", local=True, split="validation"),
    "c4": DatasetSpec(path="allenai/c4", config="en", streaming=True),
}

# File suffix -> HF `datasets` builder. Compressed copies (e.g. C4's *.json.gz shards) work too.
_BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
_COMPRESSIONS = {".gz", ".bz2", ".xz", ".zst"}


class TextTokenizer(Protocol):
    def encode(self, s: str, bos: bool, eos: bool) -> list[int]: ...


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


class _MapDocuments:
    """Documents of a map-style dataset; a position is the index of the next document."""

    def __init__(self, ds: datasets.Dataset):
        self.ds = ds

    def valid_position(self, position: Any) -> bool:
        return isinstance(position, int) and 0 <= position <= len(self.ds)

    def documents(self, position: int | None, epoch: int) -> Iterator[tuple[str, int]]:
        for i in range(position or 0, len(self.ds)):
            yield self.ds[i]["text"], i + 1


class _StreamingDocuments:
    """Documents of a streaming HF dataset; a position is the HF dataset's own state_dict."""

    def __init__(self, ds: datasets.IterableDataset):
        self.ds = ds
        # HF resumes from the last loaded state whenever its epoch matches, so a fresh pass loads this one.
        self.start_state = ds.state_dict()

    def valid_position(self, position: Any) -> bool:
        return isinstance(position, dict)

    def documents(self, position: dict | None, epoch: int) -> Iterator[tuple[str, dict]]:
        self.ds.load_state_dict(position if position is not None else self.start_state)
        self.ds.set_epoch(epoch)
        for example in self.ds:
            yield example["text"], self.ds.state_dict()


class HuggingFaceDataset(IterableDataset, Stateful):
    """Packed ``(input_ids, labels)`` windows of one data-parallel rank, from the global token stream.

    Windows are produced a global batch (``batch_size * dp_world_size`` windows) at a time and this rank
    yields rows ``[dp_rank * batch_size, (dp_rank + 1) * batch_size)`` of each. The state is committed after
    each global batch, so ``state_dict()`` taken after a whole number of per-rank batches is the same on every
    rank and for every layout.
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
        infinite: bool = True,
    ):
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len ({seq_len}) and batch_size ({batch_size}) must be positive")
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, dp_world_size={dp_world_size})")
        self.dataset_name = dataset_name
        self._source = _MapDocuments(ds) if isinstance(ds, datasets.Dataset) else _StreamingDocuments(ds)
        self._tokenizer = tokenizer
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.dp_world_size = dp_world_size
        self.dp_rank = dp_rank
        self.infinite = infinite
        self._reset_state()

    def _reset_state(self) -> None:
        self._epoch = 0
        self._position: Any = None  # where the next document is read; None = start of the epoch
        self._token_buffer: list[int] = []  # tokens read but not yet cut into windows
        self._num_sequences = 0  # windows produced so far in the global stream

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        window = self.seq_len + 1
        global_tokens = window * self.batch_size * self.dp_world_size
        mine = slice(self.dp_rank * self.batch_size * window, (self.dp_rank + 1) * self.batch_size * window)
        epoch, position, buffer = self._epoch, self._position, list(self._token_buffer)

        while True:
            num_docs = 0
            for text, next_position in self._source.documents(position, epoch):
                num_docs += 1
                buffer.extend(self._tokenizer.encode(text, bos=True, eos=True))
                while len(buffer) >= global_tokens:
                    rows = torch.tensor(buffer[mine], dtype=torch.long).view(self.batch_size, window)
                    del buffer[:global_tokens]
                    self._epoch, self._position, self._token_buffer = epoch, next_position, list(buffer)
                    self._num_sequences += self.batch_size * self.dp_world_size
                    for row in rows:
                        yield row[:-1], row[1:]
            if num_docs == 0 and position is None:  # an empty epoch would loop forever
                raise ValueError(f"Dataset {self.dataset_name!r} yielded no documents")
            if not self.infinite:
                if self._num_sequences == 0:
                    logger.warning(
                        f"Dataset {self.dataset_name!r} has fewer tokens than one global batch "
                        f"({global_tokens}): no batches produced"
                    )
                # The incomplete last global batch is dropped so every rank runs the same number of steps;
                # the next pass starts from the beginning again.
                self._reset_state()
                return
            epoch, position = epoch + 1, None
            logger.warning(f"Dataset {self.dataset_name!r} is being re-looped: starting epoch {epoch}")

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self._epoch,
            # JSON keeps the structure fixed whatever the source (a streaming position is a nested dict):
            # DCP loads into the structure of a fresh loader's state_dict.
            "position": json.dumps(self._position),
            "token_buffer": list(self._token_buffer),
            "num_sequences": self._num_sequences,
            # For information only: the state is valid for any layout.
            "dp_world_size": self.dp_world_size,
            "dp_rank": self.dp_rank,
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        position = json.loads(state_dict["position"])
        if position is not None and not self._source.valid_position(position):
            raise ValueError(
                f"Data loader state does not fit dataset {self.dataset_name!r} (position {position!r}); "
                "was the checkpoint made with another dataset?"
            )
        self._epoch = state_dict["epoch"]
        self._position = position
        self._token_buffer = list(state_dict["token_buffer"])
        self._num_sequences = state_dict["num_sequences"]


def build_hf_data_loader(
    dataset_name: str,
    dataset_path: str | None,
    tokenizer: TextTokenizer,
    batch_size: int,
    seq_len: int,
    dp_world_size: int,
    dp_rank: int,
    infinite: bool = True,
    split: str = "train",
) -> StatefulDataLoader:
    """One data-parallel rank's loader of ``(input_ids, labels)`` batches, both ``(batch_size, seq_len)``.

    `batch_size` is per rank. The windows do not depend on the layout: global batch k is windows
    ``[k * B, (k + 1) * B)`` of the global stream (B = ``batch_size * dp_world_size``), and the loader's state
    taken between steps can be loaded under any other layout.
    """
    ds = load_text_dataset(dataset_name, dataset_path, split)
    dataset = HuggingFaceDataset(
        dataset_name, ds, tokenizer, seq_len, batch_size, dp_world_size, dp_rank, infinite=infinite
    )
    # A generator of its own: each iter() draws a seed from it, which would otherwise advance the global
    # RNG after the checkpointed RNG state is restored, and a resumed run's state would drift.
    return StatefulDataLoader(dataset, batch_size=batch_size, num_workers=0, generator=torch.Generator())
