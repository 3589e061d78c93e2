"""Where text documents come from: a registered dataset (registry.py) or local files, read with Hugging Face
`datasets` as a dataset with one "text" column (map-style, or streaming for a hub dataset that streams)."""

import contextlib
import itertools
import json
from collections.abc import Iterator
from pathlib import Path

import datasets
from datasets.data_files import DataFilesDict, EmptyDatasetError, get_data_patterns

from torchtitan.config.paths import REPO_ROOT, path_candidates, resolve_path
from torchtitan.datasets.registry import DATASETS, DatasetSpec

# File suffix -> HF `datasets` builder. Compressed copies (e.g. C4's *.json.gz shards) work too.
_BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
_COMPRESSIONS = {".gz", ".bz2", ".xz", ".zst"}


def _builder_for(path: Path) -> str | None:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in _COMPRESSIONS:
        suffixes.pop()
    return _BUILDERS.get(suffixes[-1]) if suffixes else None


def resolve_data_path(path: str) -> Path:
    """A local data file or folder, found as every path option is (`resolve_path`), made absolute."""
    resolved = Path(resolve_path(path)).absolute()
    if not resolved.exists():
        tried = " or ".join(str(Path(c).absolute()) for c in path_candidates(path))
        raise FileNotFoundError(f"Dataset path not found: {tried} (check training.dataset_path)")
    return resolved


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


def _local_files(path: Path, split: str) -> list[Path]:
    """The data files a local source reads: the file itself, or the split's files in a folder."""
    return [path] if path.is_file() else _split_files(path, split)


def _load_local(path: Path, split: str) -> datasets.Dataset:
    files = _local_files(path, split)
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
    # Local files: the "Generating train split" bar tells nothing (a hub download keeps its bars).
    try:
        with quiet_progress_bars():
            return datasets.load_dataset(
                builder, data_files=[str(f) for f in files], split="train", **options
            )
    except Exception as e:
        if builder == "json" and (bad := _first_bad_json_line(files)) is not None:
            raise ValueError(bad) from e
        raise


def _jsonl_lines(path: Path) -> Iterator[tuple[int, str]]:
    """A .jsonl file's non-blank lines with their 1-based numbers (its rows, in order)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        yield from ((n, line) for n, line in enumerate(f, 1) if line.strip())


def _first_bad_json_line(files: list[Path]) -> str | None:
    """Where the first line of .jsonl `files` that is no JSON object is, and why (`datasets` says only
    "row N"); None where every line is one (the error is elsewhere)."""
    for path in (f for f in files if f.suffix == ".jsonl"):
        for n, line in _jsonl_lines(path):
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                return f"{path} line {n}: not valid JSON ({e.msg} at column {e.colno})"
            if not isinstance(row, dict):
                return f"{path} line {n}: a row must be a JSON object, got {type(row).__name__}"
    return None


def row_location(files: list[Path], index: int) -> str:
    """Where row `index` (0-based, over `files` in order) of a local dataset is: file and 1-based line for
    .jsonl files, else its 1-based row number."""
    if files and all(f.suffix == ".jsonl" for f in files):
        rows = ((path, n) for path in files for n, _ in _jsonl_lines(path))
        if (found := next(itertools.islice(rows, index, None), None)) is not None:
            return f"{found[0]} line {found[1]}"
    return f"row {index + 1}" + (f" of {', '.join(str(f) for f in files)}" if files else "")


@contextlib.contextmanager
def quiet_progress_bars() -> Iterator[None]:
    """`datasets`' progress bars off, for work on local files that takes no time worth showing."""
    bars_were_on = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if bars_were_on:
            datasets.enable_progress_bars()


def _local_path(spec: DatasetSpec | None, dataset_path: str | None) -> Path | None:
    """Where a local source's files are (None: a hub dataset)."""
    if dataset_path is not None:
        return resolve_data_path(dataset_path)
    return Path(REPO_ROOT) / spec.path if spec is not None and spec.local else None


def source_files(dataset_name: str, dataset_path: str | None = None, split: str = "train") -> list[Path]:
    """The local files `load_text_dataset` reads for the same arguments; none for a hub dataset (what
    tells that a source changed, mixture.py)."""
    spec = DATASETS.get(dataset_name)
    local = _local_path(spec, dataset_path)
    return [] if local is None else _local_files(local, (spec.split if spec else None) or split)


def load_rows(
    dataset_name: str, dataset_path: str | None = None, split: str = "train"
) -> tuple[datasets.Dataset | datasets.IterableDataset, DatasetSpec]:
    """A registered dataset, or local files at `dataset_path`, with all its columns, and its spec.

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
    local = _local_path(spec, dataset_path)
    if local is not None:
        ds = _load_local(local, split)
    else:
        ds = datasets.load_dataset(spec.path, name=spec.config, split=split, streaming=spec.streaming)

    if isinstance(ds, datasets.Dataset) and len(ds) == 0:
        raise ValueError(f"Dataset {dataset_name!r} ({dataset_path or spec.path}, split {split!r}) is empty")
    return ds, spec


def load_text_dataset(
    dataset_name: str, dataset_path: str | None = None, split: str = "train"
) -> datasets.Dataset | datasets.IterableDataset:
    """`load_rows`' dataset as one "text" column (the spec's text field)."""
    ds, spec = load_rows(dataset_name, dataset_path, split)
    if ds.column_names is not None and spec.text_field not in ds.column_names:
        raise ValueError(
            f"Dataset {dataset_name!r} has no {spec.text_field!r} field "
            f"(columns: {', '.join(ds.column_names)})"
        )
    ds = ds.select_columns([spec.text_field])
    if spec.text_field != "text":
        ds = ds.rename_column(spec.text_field, "text")
    return ds
