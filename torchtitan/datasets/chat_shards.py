"""Pre-tokenized chat data: conversations rendered, tokenized and masked once by scripts/pretokenize.py,
read by memory map when training (the chat streams' packing, chat_data.py, is unchanged).

The folder is a pre-tokenized one (pretokenized.py: ``manifest.json``, per shard its tokens, the offsets
where each document starts and block checksums), each document one conversation, plus per shard
``shard-NNNNN.trained.npy`` (uint8, one per token: bit 0 where the token is a target of the loss,
chat.loss_on; bit 1 where a conversation's next sample starts, one per assistant turn: chat.py).
Conversation i of the source is document i: one that the template refuses, that trains no token, or that
chat.overflow drops is an empty document, so that streams are dealt the same conversations as when
streaming (i to stream ``i % S``, map-style sources) and train the same batches. The manifest's ``chat``
entry records what the masks and truncation depend on (the template, loss_on, overflow, seq_len): a job
that differs is refused.
"""

import hashlib
import json
import zlib
from bisect import bisect_right
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan.datasets.chat import ChatEncoder, Encoded
from torchtitan.datasets.pretokenized import (
    TOKEN_DTYPES,
    block_checksums,
    shard_names,
    token_dtype,
    write_manifest,
    written_whole,
)
from torchtitan.datasets.streams import too_small

SAMPLE_START = 2  # the bit of a ``trained`` byte marking the first token of a conversation's next sample


def trained_name(index: int) -> str:
    return f"shard-{index:05d}.trained.npy"


def chat_settings(encoder: ChatEncoder) -> dict[str, Any]:
    """What a conversation's tokens and mask depend on besides the tokenizer (checked on loading)."""
    return {
        "template_sha256": hashlib.sha256(encoder.template.source.encode()).hexdigest(),
        "loss_on": encoder.loss_on,
        "overflow": encoder.overflow,
        "seq_len": encoder.max_tokens,
    }


def pretokenize_chats(
    texts: Iterator[list[str]],
    encoder: ChatEncoder,
    tokenizer_path: str,
    vocab_size: int,
    output: Path,
    source: dict[str, Any],
) -> dict[str, Any]:
    """Write the pre-tokenized chat folder `output` from `texts` (one list of conversations, each JSON
    role/content messages, per shard); returns its manifest. Written to a temporary folder renamed at the
    end, as pretokenized.pretokenize's."""
    dtype = TOKEN_DTYPES[token_dtype(vocab_size)]
    shards: list[dict[str, Any]] = []
    with written_whole(output) as tmp:
        for index, batch in enumerate(texts):
            encoded = [encoder.encode(json.loads(text)) for text in batch]
            docs = [e.ids if e is not None else [] for e in encoded]
            tokens = np.array([t for doc in docs for t in doc], dtype=dtype)
            trained = np.concatenate([_flags(e) for e in encoded if e is not None] or [np.zeros(0, np.uint8)])
            offsets = np.cumsum([0] + [len(d) for d in docs], dtype=np.int64)
            tokens_name, offsets_name, checksums_name = shard_names(index)
            (tmp / tokens_name).write_bytes(tokens.tobytes())
            np.save(tmp / offsets_name, offsets)
            np.save(tmp / checksums_name, block_checksums(tokens))
            np.save(tmp / trained_name(index), trained)
            shards.append(
                {
                    "tokens": tokens_name,
                    "offsets": offsets_name,
                    "checksums": checksums_name,
                    "trained": trained_name(index),
                    "num_tokens": len(tokens),
                    "num_documents": len(docs),
                    "crc32": zlib.crc32(tokens),
                }
            )
        chat = {**chat_settings(encoder), "counts": encoder.counts.counts}
        return write_manifest(tmp, tokenizer_path, vocab_size, source, shards, chat=chat)


def _flags(encoded: Encoded) -> np.ndarray:
    """A conversation's ``trained`` bytes: bit 0 where a token is trained, bit 1 where a sample (after the
    first) starts."""
    flags = np.array(encoded.trained, dtype=np.uint8)
    flags[list(encoded.starts[1:])] |= SAMPLE_START
    return flags


class PretokenizedChats:
    """The conversations of a pre-tokenized chat folder, as the chat streams read them: `get` (a stream's
    n-th conversation, as streams.MapDocuments deals them) gives its index, and `encode_document` its
    tokens and mask (None for an empty document: a conversation left out when it was written)."""

    def __init__(
        self, name: str, folder: Path, manifest: dict[str, Any], encoder: ChatEncoder, num_streams: int
    ):
        chat = manifest.get("chat")
        if chat is None:
            raise ValueError(
                f"{folder} holds pre-tokenized text, not conversations: run scripts/pretokenize.py with "
                "chat.enable = true, or train it without chat.enable"
            )
        wanted = chat_settings(encoder)
        differ = [
            f"{key} {chat[key]} (the job: {value})" for key, value in wanted.items() if chat[key] != value
        ]
        if differ:
            raise ValueError(
                f"{folder} was written for other chat settings: {'; '.join(differ)}; re-run "
                "scripts/pretokenize.py with this job's [chat] and training.seq_len"
            )
        if manifest["num_documents"] < num_streams:
            raise too_small(name, manifest["num_documents"], num_streams)
        self._folder = folder
        self._counts = ", ".join(f"{n} {kind}" for kind, n in chat.get("counts", {}).items()) or "no counts"
        dtype = TOKEN_DTYPES[manifest["dtype"]]
        shards = manifest["shards"]
        self._tokens = [
            np.memmap(folder / s["tokens"], dtype=dtype, mode="r") if s["num_tokens"] else None
            for s in shards
        ]
        self._trained = [np.load(folder / s["trained"], mmap_mode="r") for s in shards]
        self._offsets = [np.load(folder / s["offsets"]) for s in shards]
        self._first = np.cumsum([0] + [s["num_documents"] for s in shards]).tolist()
        self.num_documents = self._first[-1]
        self.num_streams = num_streams

    def reset(self, starts: dict[int, tuple[int, int]]) -> None:
        """Nothing to do: conversations are read by index."""

    def get(self, stream: int, epoch: int, n: int) -> int | None:
        i = stream + self.num_streams * n
        return i if i < self.num_documents else None

    def encode_document(self, i: int) -> Encoded | None:
        shard = bisect_right(self._first, i) - 1
        j = i - self._first[shard]
        start, end = int(self._offsets[shard][j]), int(self._offsets[shard][j + 1])
        if start == end:
            return None
        ids = self._tokens[shard][start:end].astype(np.int64).tolist()
        flags = np.asarray(self._trained[shard][start:end])
        starts = (0, *np.flatnonzero(flags & SAMPLE_START).tolist())
        return Encoded(ids, (flags & 1).astype(bool).tolist(), starts)

    def why_nothing(self) -> str:
        """Why a row has nothing to train: its conversations were left out when the folder was written."""
        return f"every conversation dealt to it was left out when {self._folder} was written ({self._counts})"
