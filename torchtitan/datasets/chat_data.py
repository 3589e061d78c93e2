"""Chat data -> packed ``(input_ids, labels, positions)`` windows for fine-tuning.

Conversations are dealt to the rows of the global batch as text documents are (streams.py: conversation i
to stream ``i % S``), so global row j of step k is the same whatever the data-parallel layout, and a
stream's state (epoch, conversation, sample, windows taken) resumes it. Unlike text, a sample (a whole
conversation, or one assistant turn's render where the template re-renders history: chat.py) is never cut
across windows: each window holds whole samples, in order, until the next one does not fit, and the rest
is padding. Each sample is a document: its tokens' positions count from 0, the label of its last token
and of padding is -100 (IGNORE_INDEX: no loss), as is every label that chat.loss_on does not train, so
that no target crosses a sample.
"""

import json
from collections.abc import Callable
from typing import Any

import datasets
import torch

from torchtitan.config.options import ChatConfig, ConfigError
from torchtitan.datasets.chat import ChatEncoder, Encoded, detect_format, to_messages
from torchtitan.datasets.chat_shards import PretokenizedChats
from torchtitan.datasets.chat_template import load_chat_template
from torchtitan.datasets.hf_tokenizer import HFTokenizer
from torchtitan.datasets.layout import IGNORE_INDEX, Batch, BatchLayout
from torchtitan.datasets.pretokenized import is_pretokenized, read_manifest
from torchtitan.datasets.sources import (
    load_rows,
    quiet_progress_bars,
    resolve_data_path,
    row_location,
    source_files,
)
from torchtitan.datasets.streams import MapDocuments, StreamingDocuments, TextStreams
from torchtitan.datasets.text import StreamsDataset
from torchtitan.errors import bad_input
from torchtitan.logging import logger


def load_chat_dataset(
    dataset_name: str, dataset_path: str | None, split: str, fmt: str
) -> datasets.Dataset | datasets.IterableDataset:
    """The conversations of a dataset as one "text" column, each a JSON list of role/content messages
    (what the streams deal out); a map-style dataset is converted, and so checked, whole here."""
    ds, _ = load_rows(dataset_name, dataset_path, split)
    columns = ds.column_names or list(next(iter(ds)))  # a streamed dataset may not know its columns
    fmt = detect_format(columns, fmt)

    def conversation(row: dict[str, Any], i: int) -> dict[str, str]:
        try:
            return {"text": json.dumps(to_messages(row, fmt))}
        except ValueError as e:  # named by file and line (found only then: it reads the files again)
            raise ValueError(
                f"{row_location(source_files(dataset_name, dataset_path, split), i)}: {e}"
            ) from None

    with quiet_progress_bars():
        return ds.map(conversation, with_indices=True, remove_columns=columns)


class ChatStream:
    """One row's conversations, each packed whole (each of its samples whole, where a conversation is one
    sample per assistant turn: chat.py). Its state is four integers: the epoch, the index of the next
    conversation to place among the stream's own, the index of its next sample, and the windows taken."""

    def __init__(
        self,
        index: int,
        documents: MapDocuments | StreamingDocuments,
        encoder: ChatEncoder,
        window: int,
        pad_id: int,
        on_epoch: Callable[[int], None],
    ):
        self.index = index
        self._documents = documents
        self._encoder = encoder
        self._window = window
        self._pad_id = pad_id
        self._on_epoch = on_epoch
        self.load(torch.zeros(4, dtype=torch.long))

    def state(self) -> torch.Tensor:
        return torch.tensor([self.epoch, self.doc, self.sample, self.windows], dtype=torch.long)

    def load(self, state: torch.Tensor) -> None:
        values = [int(v) for v in state]
        if len(values) == 3:  # saved before conversations had samples: epoch, doc, windows
            values.insert(2, 0)
        self.epoch, self.doc, self.sample, self.windows = values
        self._pending: list[Encoded] = []  # conversation `doc`'s samples from `sample` on, once encoded
        self._trained_in_epoch = self.doc > 0 or self.sample > 0

    def _encode_next(self) -> list[Encoded]:
        """The samples of conversation `doc`, the refused ones skipped (chat.py counts them)."""
        while True:
            text = self._documents.get(self.index, self.epoch, self.doc)
            if text is None:  # past this stream's last conversation: the next epoch starts
                if not self._trained_in_epoch:
                    raise ValueError(
                        f"no conversation dealt to row {self.index} of the global batch has a token to "
                        f"train on: {self._encoder.why_nothing()}"
                    )
                self.epoch, self.doc, self._trained_in_epoch = self.epoch + 1, 0, False
                self._on_epoch(self.epoch)
                continue
            encoded = self._encoder.encode_document(text)
            if encoded is not None:
                self._trained_in_epoch = True
                return encoded.samples()[self.sample :]
            self.doc += 1

    def check(self) -> None:
        """Find this row's first conversation to train (a ValueError naming why where it has none)."""
        self._pending = self._pending or self._encode_next()

    def next_window(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Input ids, labels and positions of the next window of whole samples."""
        ids: list[int] = []
        labels: list[int] = []
        positions: list[int] = []
        while True:
            self._pending = self._pending or self._encode_next()
            sample = self._pending[0]
            if ids and len(ids) + len(sample.ids) > self._window:
                break  # the first of the next window
            self._pending.pop(0)
            self.sample += 1
            if not self._pending:
                self.doc, self.sample = self.doc + 1, 0
            n = len(sample.ids)
            ids += sample.ids
            labels += [
                t if trained else IGNORE_INDEX for t, trained in zip(sample.ids[1:], sample.trained[1:])
            ]
            labels.append(IGNORE_INDEX)
            positions += range(n)
            if len(ids) == self._window:
                break
        padding = self._window - len(ids)
        self.windows += 1
        return (
            torch.tensor(ids + [self._pad_id] * padding, dtype=torch.long),
            torch.tensor(labels + [IGNORE_INDEX] * padding, dtype=torch.long),
            torch.tensor(positions + list(range(padding)), dtype=torch.long),
        )


class ChatStreams(TextStreams):
    """A rank's streams of conversations (streams.py's dealing, chat windows)."""

    what = "Chat dataset"

    def __init__(
        self,
        name: str,
        ds: Any,
        encoder: ChatEncoder,
        window: int,
        pad_id: int,
        num_streams: int,
        rows: list[int],
    ):
        self._pad_id = pad_id
        super().__init__(name, ds, encoder, window, num_streams, rows)
        # The chat streams' own state (ChatStream's): saved under a key of their own.
        self.state_key = f"chat_global_batch_{num_streams}"
        self._summed_epoch = 0

    def _make_stream(self, index: int, encoder: ChatEncoder, window: int) -> ChatStream:
        return ChatStream(index, self.documents, encoder, window, self._pad_id, self._on_epoch)

    def _on_epoch(self, epoch: int) -> None:
        """The new epoch's warning (the first stream's); the totals once each of this rank's streams
        has ended an epoch."""
        super()._on_epoch(epoch)
        ended = min(stream.epoch for stream in self.streams.values())
        if ended > self._summed_epoch and (counts := getattr(self._tokenizer, "counts", None)):
            self._summed_epoch = ended
            logger.info(f"{counts.summary()} (distinct conversations, to epoch {ended - 1}'s end)")

    def check_trainable(self) -> None:
        """Before training: each of this rank's rows has a conversation to train (else a ValueError
        naming why), the streams then as they were."""
        for stream in self.streams.values():
            stream.check()
        self.load(self.fresh_state())


class ChatDataset(StreamsDataset):
    """A data-parallel rank's micro-batches of chat data: its chat streams' rows and state (text.py's
    `StreamsDataset`), each row a window of whole conversations. It never ends (chat data has no finite
    pass yet)."""

    def __init__(
        self, dataset_name: str, ds: Any, encoder: ChatEncoder, seq_len: int, pad_id: int, layout: BatchLayout
    ):
        streams = ChatStreams(dataset_name, ds, encoder, seq_len, pad_id, layout.global_batch, layout.rows())
        super().__init__(dataset_name, streams, seq_len, layout)

    def check_trainable(self) -> None:
        self._streams.check_trainable()

    def _batch(self, rows: list[int]) -> Batch:
        windows = [self._streams.next_window(s) for s in rows]
        return Batch(*(torch.stack(parts) for parts in zip(*windows)))


def build_chat_dataset(
    chat: ChatConfig,
    dataset_name: str,
    dataset_path: str | None,
    tokenizer: Any,
    seq_len: int,
    layout: BatchLayout,
    split: str = "train",
    section: str = "training",
) -> ChatDataset:
    """A rank's chat data, as the `[chat]` section says: conversations, or a pre-tokenized chat folder
    (chat_shards.py) at `dataset_path` (`section`'s option). Checked here, before training, in one line
    naming the cause: the template renders the first conversation, and each of this rank's rows of the
    global batch is dealt a conversation to train."""
    label = dataset_path or dataset_name  # what the logs and errors name
    encoder = chat_encoder(chat, tokenizer, seq_len)
    encoder.counts.name = label if section == "training" else f"{label} ({section})"
    pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id
    option = f"{section}.dataset_path" if dataset_path else f"{section}.dataset"
    with bad_input(option):
        folder = resolve_data_path(dataset_path) if dataset_path is not None else None
        if folder is not None and is_pretokenized(folder):
            manifest = read_manifest(folder, tokenizer.model_path, tokenizer.n_words)
            chats = PretokenizedChats(label, folder, manifest, encoder, layout.global_batch)
            dataset = ChatDataset(label, chats, chats, seq_len, pad_id, layout)
        else:
            ds = load_chat_dataset(dataset_name, dataset_path, split, chat.format)
            with bad_input("chat.template_path"):
                encoder.template.render(json.loads(next(iter(ds))["text"]))
            dataset = ChatDataset(label, ds, encoder, seq_len, pad_id, layout)
        dataset.check_trainable()
    logger.info(f"Chat data for {section}: {label} (chat.loss_on {chat.loss_on}, overflow {chat.overflow})")
    return dataset


def chat_encoder(chat: ChatConfig, tokenizer: Any, seq_len: int) -> ChatEncoder:
    """The job's conversation encoder: the tokenizer's chat template, chat.loss_on and chat.overflow for
    windows of `seq_len` tokens (train.py's and scripts/pretokenize.py's)."""
    if not isinstance(tokenizer, HFTokenizer):
        raise ConfigError(
            "chat.enable: needs a Hugging Face tokenizer (model.tokenizer_path: a tokenizer.json folder), "
            "whose special tokens the chat template writes"
        )
    with bad_input("chat.template_path"):
        template = load_chat_template(tokenizer.folder, tokenizer.config, chat.template_path)
    return ChatEncoder(template, tokenizer, chat.loss_on, chat.overflow, seq_len)
