"""The data loader of a job: text (text.py), pre-tokenized (pretokenized.py) or a mixture (mixture.py),
picked from where the data is; every kind lays its rows out as layout.py says."""

from collections.abc import Callable

from torchtitan.config_manager import TrainingConfig
from torchtitan.config_rules import mixture_sources
from torchtitan.datasets.layout import BatchLayout
from torchtitan.datasets.loader import DataLoader
from torchtitan.datasets.mixture import MixtureDataset, PretokenizedSource, Source, TextSource
from torchtitan.datasets.pretokenized import PretokenizedDataset, TokenWindows, is_pretokenized, read_manifest
from torchtitan.datasets.registry import DATASETS
from torchtitan.datasets.sources import load_text_dataset, resolve_data_path
from torchtitan.datasets.streams import TextTokenizer
from torchtitan.datasets.text import TextDataset
from torchtitan.errors import bad_input


def _mixture_reader(
    source: str,
    split: str,
    tokenizer: TextTokenizer,
    seq_len: int,
    layout: BatchLayout,
    seed: int,
    shuffle: bool,
    vocab_size: int | None,
) -> TextSource | PretokenizedSource:
    """A mixture source: a registered name, else a path (pre-tokenized folder, or text files)."""
    if source not in DATASETS and is_pretokenized(folder := resolve_data_path(source)):
        manifest = read_manifest(folder, tokenizer.model_path, vocab_size or tokenizer.n_words)
        return PretokenizedSource(source, TokenWindows(folder, manifest, seq_len + 1), seed, shuffle)
    ds = load_text_dataset(source, None if source in DATASETS else source, split)
    return TextSource(source, ds, tokenizer, seq_len + 1, layout.global_batch, layout.rows())


def build_data_loader(
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
    min_over_ranks: Callable[[int], int] | None = None,
    timeout: float = 0,
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
    (loader.py), each stopping the job if it makes no batch for `timeout` seconds (0: no limit); the
    loader's state is the same with or without them.

    `min_over_ranks` (the least of a number over the data-parallel ranks: an all-reduce) lets a finite pass
    of text data be counted from this rank's own streams (text.py); without it every rank tokenizes every
    stream once to count.
    """
    layout = BatchLayout(batch_size, dp_world_size, dp_rank, grad_accum_steps)
    if mixture:
        sources = [
            Source(
                name,
                weight,
                _mixture_reader(name, split, tokenizer, seq_len, layout, seed, shuffle, vocab_size),
            )
            for name, weight in mixture
        ]
        dataset = MixtureDataset(sources, seq_len, batch_size, dp_world_size, dp_rank, grad_accum_steps, seed)
    elif dataset_path is not None and is_pretokenized(folder := resolve_data_path(dataset_path)):
        manifest = read_manifest(folder, tokenizer.model_path, vocab_size or tokenizer.n_words)
        dataset = PretokenizedDataset(
            folder,
            manifest,
            seq_len,
            layout,
            infinite=infinite,
            seed=seed,
            shuffle=shuffle,
        )
    else:
        ds = load_text_dataset(dataset_name, dataset_path, split)
        dataset = TextDataset(
            dataset_name,
            ds,
            tokenizer,
            seq_len,
            batch_size,
            dp_world_size,
            dp_rank,
            grad_accum_steps,
            infinite,
            min_over_ranks,
        )
    return DataLoader(dataset, batch_size, num_workers, prefetch, pin_memory, timeout)


def build_training_data_loader(
    training: TrainingConfig, tokenizer: TextTokenizer, layout: BatchLayout, vocab_size: int, pin_memory: bool
) -> DataLoader:
    """This rank's training data, as the `[training]` section says (its dataset, dataset_path or mixture,
    seed, shuffle_windows, seq_len, data_workers, data_prefetch and data_timeout_seconds); a bad source is
    one line naming the option (errors.py)."""
    mixture = mixture_sources(training)
    option = "mixture" if mixture else "dataset_path" if training.dataset_path else "dataset"
    with bad_input(f"training.{option}"):
        return build_data_loader(
            training.dataset,
            training.dataset_path,
            tokenizer,
            layout.batch_size,
            training.seq_len,
            layout.dp_world_size,
            layout.dp_rank,
            layout.grad_accum_steps,
            seed=training.seed,
            shuffle=training.shuffle_windows,
            vocab_size=vocab_size,
            mixture=mixture,
            num_workers=training.data_workers,
            prefetch=training.data_prefetch,
            pin_memory=pin_memory,
            timeout=training.data_timeout_seconds,
        )
