"""The data loader of a job: text (text.py), pre-tokenized (pretokenized.py) or a mixture (mixture.py),
picked from where the data is; every kind lays its rows out as layout.py says."""

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchtitan.config.options import ChatConfig, TrainingConfig
from torchtitan.config_rules import mixture_sources
from torchtitan.datasets.chat_data import ChatDataset, build_chat_dataset, chat_encoder, load_chat_dataset
from torchtitan.datasets.chat_shards import PretokenizedChats
from torchtitan.datasets.layout import BatchLayout
from torchtitan.datasets.loader import DataLoader
from torchtitan.datasets.mixture import ChatSource, MixtureDataset, PretokenizedSource, Source, TextSource
from torchtitan.datasets.pretokenized import (
    PretokenizedDataset,
    TokenWindows,
    file_stats,
    is_pretokenized,
    read_manifest,
)
from torchtitan.datasets.registry import DATASETS
from torchtitan.datasets.sources import load_text_dataset, resolve_data_path, source_files
from torchtitan.datasets.streams import TextTokenizer
from torchtitan.datasets.text import TextDataset
from torchtitan.errors import bad_input
from torchtitan.logging import logger


@dataclass(frozen=True)
class DataSource:
    """What a loader reads: the registered dataset `dataset`, or local files or a pre-tokenized folder at
    `path`, or a `mixture` of (source, weight) pairs (registered names, text files or folders, pre-tokenized
    folders: mixture.py; `dataset` and `path` are then unused); the `split`; and, for pre-tokenized data,
    the order of its windows (`seed`, `shuffle`)."""

    dataset: str
    path: str | None = None
    mixture: list[tuple[str, float]] = field(default_factory=list)
    split: str = "train"
    seed: int = 0
    shuffle: bool = False

    def label(self) -> str:
        """What the data is, for the logs: each mixture source with its weight, else the path read (the
        registered name only where no path overrides it)."""
        if self.mixture:
            return "mixture of " + ", ".join(f"{name} (weight {weight:g})" for name, weight in self.mixture)
        return self.path or self.dataset


def _mixture_source(
    name: str,
    weight: float,
    source: DataSource,
    tokenizer: TextTokenizer,
    seq_len: int,
    layout: BatchLayout,
    vocab_size: int | None,
) -> Source:
    """Mixture source `name`: a registered name, else a path (pre-tokenized folder, or text files)."""
    if name not in DATASETS and is_pretokenized(folder := resolve_data_path(name)):
        manifest = _text_manifest(folder, tokenizer, vocab_size)
        windows = TokenWindows(folder, manifest, seq_len + 1)
        reader = PretokenizedSource(name, windows, source.seed, source.shuffle)
        return Source(name, weight, reader, windows.contents())
    path = None if name in DATASETS else name
    ds = load_text_dataset(name, path, source.split)
    reader = TextSource(name, ds, tokenizer, seq_len + 1, layout.global_batch, layout.rows())
    return Source(name, weight, reader, file_stats(source_files(name, path, source.split)))


def _text_manifest(folder: Path, tokenizer: TextTokenizer, vocab_size: int | None) -> dict[str, Any]:
    """A pre-tokenized folder's manifest, refused where it holds conversations: their masks and
    samples are read only with chat.enable."""
    manifest = read_manifest(folder, tokenizer.model_path, vocab_size or tokenizer.n_words)
    if "chat" in manifest:
        raise ValueError(
            f"{folder} holds pre-tokenized conversations (written with chat.enable): set chat.enable = true "
            "to train them with their loss masks"
        )
    return manifest


def _mixture(sources: list[Source], seq_len: int, layout: BatchLayout, seed: int) -> MixtureDataset:
    """The mixture of `sources`, its rows this rank's share of `layout`'s batches."""
    rank = (layout.batch_size, layout.dp_world_size, layout.dp_rank, layout.grad_accum_steps)
    return MixtureDataset(sources, seq_len, *rank, seed)


def build_dataset(
    source: DataSource,
    tokenizer: TextTokenizer,
    seq_len: int,
    layout: BatchLayout,
    vocab_size: int | None = None,
    infinite: bool = True,
    min_over_ranks: Callable[[int], int] | None = None,
) -> TextDataset | PretokenizedDataset | MixtureDataset:
    """One data-parallel rank's ``(input_ids, labels)`` rows, ``seq_len`` tokens each, laid out as `layout`
    says: global row j of step k is the same whatever the layout, so its state taken between steps loads
    under any layout with the same global batch size (pre-tokenized data: any global batch size too).

    A pre-tokenized folder is read by memory map and checked against `tokenizer`'s file and the model's
    `vocab_size` (default: the tokenizer's). A finite pass (`infinite` False) of text data is counted from
    this rank's own streams given `min_over_ranks` (the least of a number over the data-parallel ranks:
    an all-reduce); without it every rank tokenizes every stream once to count (text.py).
    """
    if source.mixture:
        sources = [
            _mixture_source(name, weight, source, tokenizer, seq_len, layout, vocab_size)
            for name, weight in source.mixture
        ]
        return _mixture(sources, seq_len, layout, source.seed)
    if source.path is not None and is_pretokenized(folder := resolve_data_path(source.path)):
        manifest = _text_manifest(folder, tokenizer, vocab_size)
        return PretokenizedDataset(
            folder, manifest, seq_len, layout, infinite=infinite, seed=source.seed, shuffle=source.shuffle
        )
    ds = load_text_dataset(source.dataset, source.path, source.split)
    return TextDataset(
        source.label(),  # the warnings name the path read, not the name it overrides
        ds,
        tokenizer,
        seq_len,
        layout.batch_size,
        layout.dp_world_size,
        layout.dp_rank,
        layout.grad_accum_steps,
        infinite,
        min_over_ranks,
    )


def _chat_mixture(
    chat: ChatConfig, source: DataSource, tokenizer: Any, seq_len: int, layout: BatchLayout
) -> MixtureDataset:
    """A mixture of conversations (every source a chat source: registered, local files, or a pre-tokenized
    chat folder), its rows windows of whole conversations."""
    pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id
    sources = []
    for name, weight in source.mixture:
        encoder = chat_encoder(chat, tokenizer, seq_len)
        encoder.counts.name = name  # each source's conversations counted, and named, apart
        path = None if name in DATASETS else name
        try:
            if path is not None and is_pretokenized(folder := resolve_data_path(path)):
                manifest = read_manifest(folder, tokenizer.model_path, tokenizer.n_words)
                ds: Any = PretokenizedChats(name, folder, manifest, encoder, layout.global_batch)
                contents = "\n".join(f"{shard['tokens']} {shard['crc32']}" for shard in manifest["shards"])
                reader = ChatSource(name, ds, ds, seq_len, pad_id, layout.global_batch, layout.rows())
            else:
                ds = load_chat_dataset(name, path, source.split, chat.format)
                contents = file_stats(source_files(name, path, source.split))
                reader = ChatSource(name, ds, encoder, seq_len, pad_id, layout.global_batch, layout.rows())
            reader.check_trainable()
        except (ValueError, OSError) as e:
            raise ValueError(f"source {name}: {e}") from e
        sources.append(Source(name, weight, reader, contents))
    return _mixture(sources, seq_len, layout, source.seed)


def build_training_data_loader(
    training: TrainingConfig,
    tokenizer: TextTokenizer,
    layout: BatchLayout,
    vocab_size: int,
    pin_memory: bool,
    chat: ChatConfig | None = None,
) -> DataLoader:
    """This rank's training data, as the `[training]` section says (its dataset, dataset_path or mixture,
    seed, shuffle_windows, seq_len, data_workers, data_prefetch and data_timeout_seconds), conversations
    where `chat` is enabled (chat_data.py); a bad source is one line naming the option (errors.py)."""
    mixture = mixture_sources(training)
    option = "mixture" if mixture else "dataset_path" if training.dataset_path else "dataset"
    source = DataSource(
        training.dataset, training.dataset_path, mixture, seed=training.seed, shuffle=training.shuffle_windows
    )
    dataset: TextDataset | PretokenizedDataset | MixtureDataset | ChatDataset
    if chat is not None and chat.enable and mixture:
        with bad_input("training.mixture"):
            dataset = _chat_mixture(chat, source, tokenizer, training.seq_len, layout)
    elif chat is not None and chat.enable:
        dataset = build_chat_dataset(
            chat, training.dataset, training.dataset_path, tokenizer, training.seq_len, layout
        )
    else:
        with bad_input(f"training.{option}"):
            dataset = build_dataset(source, tokenizer, training.seq_len, layout, vocab_size)
    if not isinstance(dataset, ChatDataset):  # a chat dataset logs its own line (chat_data.py)
        logger.info(
            f"{'Chat data' if chat is not None and chat.enable else 'Data'} for training: {source.label()}"
        )
    return DataLoader(
        dataset,
        layout.batch_size,
        training.data_workers,
        training.data_prefetch,
        pin_memory,
        training.data_timeout_seconds,
    )
