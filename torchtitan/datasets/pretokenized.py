"""Pre-tokenized datasets: token shards written once by scripts/pretokenize.py, read by memory map.

A pre-tokenized folder holds ``manifest.json`` and, per shard, ``shard-NNNNN.bin`` (the tokens of a
contiguous range of documents, each framed by BOS, if the tokenizer has one, and EOS as the on-the-fly
loader encodes it; uint16 when the vocabulary fits, else uint32) and ``shard-NNNNN.offsets.npy`` (int64:
where each document starts, then the shard's length) and ``shard-NNNNN.crc32.npy`` (uint32: the CRC32 of
each block of CHECK_TOKENS tokens, which a rank checks, with the block's largest token id, the first time it
reads from the block: `TokenWindows`). Training cuts windows of ``seq_len + 1`` tokens from the
concatenation of all shards: window w is tokens ``[w * (seq_len + 1), (w + 1) * (seq_len + 1))``, the
partial tail dropped.

Global row j of optimizer step k (S sequences per step) reads window ``order(k * S + j)`` of the epoch,
``order`` being the identity or, with ``training.shuffle_windows``, a seeded bijection of the windows that
changes every epoch. Rank r's micro-batch m holds rows ``m * D * b + r * b + [0, b)``, as the text loader's.
The state is the epoch and the windows consumed in it, the same on every rank, so a run resumes exactly on
any layout and with any global batch size (it goes on from the next unconsumed window).
"""

import contextlib
import functools
import hashlib
import json
import math
import multiprocessing
import os
import shutil
import zlib
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset

from torchtitan.config.options import ConfigError
from torchtitan.datasets.hf_tokenizer import tokenizer_file
from torchtitan.datasets.layout import Batch, BatchLayout, StepCursor, warn_relooped
from torchtitan.logging import logger

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SHARD_SUFFIX = ".bin"
TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
RERUN = "re-run scripts/pretokenize.py"
# Tokens per checksum block. A rank checks the blocks it reads, not whole shards: with windows spread over
# the ranks (every rank reads from every shard) whole-shard checks would make each rank read the dataset.
CHECK_TOKENS = 1 << 13


def shard_names(index: int) -> tuple[str, str, str]:
    """The token, offset and checksum file names of shard `index`."""
    return (
        f"shard-{index:05d}{SHARD_SUFFIX}",
        f"shard-{index:05d}.offsets.npy",
        f"shard-{index:05d}.crc32.npy",
    )


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 2**16 else "uint32"


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class DamagedShard(ConfigError):
    """A shard whose block fails its check when first read (exit code 2). Raised in a data-loading worker,
    it is raised again in the trainer by torch's DataLoader as DamagedShard("Caught DamagedShard in
    DataLoader worker process N. Original Traceback ...: <message>"): keep the one line the contract wants."""

    def __init__(self, message: str):
        if message.startswith(f"Caught {type(self).__name__} "):
            message = message.rstrip().rpartition(f"{type(self).__name__}: ")[2]
        super().__init__(message)


def block_checksums(tokens: np.ndarray) -> np.ndarray:
    """The CRC32 of each block of CHECK_TOKENS tokens (the last one shorter)."""
    crcs = [zlib.crc32(tokens[i : i + CHECK_TOKENS]) for i in range(0, len(tokens), CHECK_TOKENS)]
    return np.array(crcs, dtype=np.uint32)


def file_stats(paths: list[Path]) -> str:
    """The size and modification time of each file: what tells that files changed without reading them."""
    stats = [(path, path.stat()) for path in paths]
    return "\n".join(f"{path} {stat.st_size} {stat.st_mtime_ns}" for path, stat in stats)


def is_pretokenized(folder: Path) -> bool:
    """A folder with a manifest is pre-tokenized data; one with shards but no manifest is refused, as
    pretokenize.py writes the manifest last and an interrupted run leaves no such folder."""
    if not folder.is_dir():
        return False
    if (folder / MANIFEST).is_file():
        return True
    if any(folder.glob(f"shard-*{SHARD_SUFFIX}")):
        raise ValueError(
            f"{folder} holds token shards but no {MANIFEST}: run scripts/pretokenize.py to write a complete "
            "pre-tokenized folder, or point at text files (.txt/.json/.jsonl/.parquet)"
        )
    return False


def read_manifest(folder: Path, tokenizer_path: str | Path, vocab_size: int) -> dict[str, Any]:
    """The manifest of `folder`, checked against the job's tokenizer file and the model's vocabulary size
    (embedding rows) and against the shard files on disk."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{folder / MANIFEST} is not valid JSON ({e}); {RERUN}") from None
    if manifest.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"{folder / MANIFEST} is format version {manifest.get('version')!r}; this trainer reads version "
            f"{FORMAT_VERSION}: {RERUN}"
        )
    tokenizer = manifest["tokenizer"]
    sha = file_sha256(tokenizer_path)
    if tokenizer["sha256"] != sha:
        raise ValueError(
            f"{folder} was tokenized with another tokenizer (sha256 {tokenizer['sha256'][:12]}, from "
            f"{tokenizer['path']}) than model.tokenizer_path {tokenizer_path} (sha256 {sha[:12]}): {RERUN} "
            "with this model.tokenizer_path, or set model.tokenizer_path to the one it was made with"
        )
    if tokenizer["vocab_size"] > vocab_size:
        raise ValueError(
            f"{folder} holds token ids up to {tokenizer['vocab_size'] - 1}, beyond the model's vocabulary of "
            f"{vocab_size} (model.vocab_size): {RERUN} with the model's tokenizer"
        )
    if manifest["dtype"] not in TOKEN_DTYPES:
        raise ValueError(f"{folder / MANIFEST} names an unknown dtype {manifest['dtype']!r}; {RERUN}")
    itemsize = np.dtype(TOKEN_DTYPES[manifest["dtype"]]).itemsize
    for shard in manifest["shards"]:
        path = folder / shard["tokens"]
        size = path.stat().st_size if path.is_file() else None
        if size != shard["num_tokens"] * itemsize:
            raise ValueError(
                f"{path} has {'no file' if size is None else f'{size} bytes'}, the manifest "
                f"{shard['num_tokens'] * itemsize} ({shard['num_tokens']} tokens of {manifest['dtype']}): "
                f"the folder is damaged; {RERUN}"
            )
    if any("checksums" not in shard for shard in manifest["shards"]):
        logger.info(
            f"{folder / MANIFEST} has no shard checksums (an older pretokenize.py): its shards are checked "
            f"for token ids beyond the vocabulary only; {RERUN} to add them"
        )
    return manifest


def splitmix64(x: int) -> int:
    """A 64-bit mixing function: consecutive inputs give unrelated outputs."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


class WindowOrder:
    """A seeded bijection of ``[0, n)`` in O(1) memory: a 4-round Feistel network over the smallest even
    number of bits that holds n, walking the cycle until the value falls inside ``[0, n)``."""

    ROUNDS = 4

    def __init__(self, n: int, seed: int, epoch: int):
        self.n = n
        self.half = max(1, math.ceil(math.log2(max(n, 2)) / 2))
        self.mask = (1 << self.half) - 1
        self.keys = [splitmix64(splitmix64(seed) ^ (epoch << 8 | r)) for r in range(self.ROUNDS)]

    def _permute(self, x: int) -> int:
        left, right = x >> self.half, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (splitmix64(key ^ right) & self.mask)
        return left << self.half | right

    def __call__(self, i: int) -> int:
        x = self._permute(i)
        while x >= self.n:
            x = self._permute(x)
        return x


class TokenWindows:
    """The windows of `window` tokens cut from the concatenated shards of a pre-tokenized folder, read by
    index from memory maps: window w is tokens ``[w * window, (w + 1) * window)``, the tail dropped.

    The first read from a block of tokens (the manifest's `checksum_tokens`) checks the block: its CRC32
    against the shard's checksum file (a flipped byte, a file changed after pretokenize.py wrote it) and its
    largest id against the tokenizer's vocabulary (an IndexError in the embedding otherwise). A rank thus
    reads, at most, the blocks around its own windows once more, never the whole dataset; a manifest of an
    older pretokenize.py (no checksum files) gets the id check only."""

    def __init__(self, folder: Path, manifest: dict[str, Any], window: int):
        dtype = TOKEN_DTYPES[manifest["dtype"]]
        shards = [s for s in manifest["shards"] if s["num_tokens"] > 0]
        self._paths = [folder / s["tokens"] for s in shards]
        self._tokens = [np.memmap(path, dtype=dtype, mode="r") for path in self._paths]
        self._crc32 = [s.get("crc32") for s in shards]
        self._checksum_paths = [folder / s["checksums"] if "checksums" in s else None for s in shards]
        self._vocab_size = manifest["tokenizer"]["vocab_size"]
        self._block = manifest.get("checksum_tokens", CHECK_TOKENS)
        # Per shard, read when it is first read from: its blocks' CRC32s (None: no checksum file) and which
        # blocks were checked.
        self._checksums: dict[int, np.ndarray | None] = {}
        self._checked: dict[int, np.ndarray] = {}
        self._starts = np.cumsum([0] + [s["num_tokens"] for s in shards]).tolist()
        self.num_tokens = self._starts[-1]
        self.window = window
        self.num_windows = self.num_tokens // window

    def contents(self) -> str:
        """What identifies the shards' content: their CRC32s, else (an older manifest) their files' stats."""
        if None in self._crc32:
            return file_stats(self._paths)
        return "\n".join(f"{path.name} {crc}" for path, crc in zip(self._paths, self._crc32))

    def read(self, w: int) -> np.ndarray:
        """Window w (it may span shards)."""
        start, end = w * self.window, (w + 1) * self.window
        pieces = []
        shard = bisect_right(self._starts, start) - 1
        while start < end:
            offset = self._starts[shard]
            take = min(end, self._starts[shard + 1])
            self._check(shard, start - offset, take - offset)
            pieces.append(self._tokens[shard][start - offset : take - offset])
            start, shard = take, shard + 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def _check(self, shard: int, lo: int, hi: int) -> None:
        """Check the blocks of tokens ``[lo, hi)`` of `shard` not checked yet."""
        checked = self._checked.get(shard)
        if checked is None:
            checked = self._open(shard)
        for block in range(lo // self._block, (hi - 1) // self._block + 1):
            if checked[block]:
                continue
            first = block * self._block
            tokens = self._tokens[shard][first : first + self._block]
            expected = self._checksums[shard]
            path = self._paths[shard]
            if expected is not None and zlib.crc32(tokens) != expected[block]:
                raise DamagedShard(
                    f"{path} does not match its CRC32 checksum (block {block}, tokens {first} to "
                    f"{first + len(tokens) - 1}): the file is damaged or was changed after pretokenize.py "
                    f"wrote it; restore it from a copy, or {RERUN}"
                )
            top = int(tokens.max())
            if top >= self._vocab_size:
                raise DamagedShard(
                    f"{path} holds token id {top}, beyond the {self._vocab_size} ids of the tokenizer it was "
                    f"made with: the file is damaged; restore it from a copy, or {RERUN}"
                )
            checked[block] = True

    def _open(self, shard: int) -> np.ndarray:
        """Read `shard`'s checksum file (one CRC32 per block); the blocks checked so far: none."""
        blocks = -(-len(self._tokens[shard]) // self._block)
        path = self._checksum_paths[shard]
        checksums = None
        if path is not None:
            try:
                checksums = np.load(path)
            except (OSError, ValueError) as e:
                raise DamagedShard(
                    f"{path} cannot be read ({e}): restore it from a copy, or {RERUN}"
                ) from None
            if checksums.shape != (blocks,) or checksums.dtype != np.uint32:
                raise DamagedShard(
                    f"{path} holds {checksums.shape} {checksums.dtype} checksums, not the {blocks} uint32 of "
                    f"{self._paths[shard].name}'s blocks: restore it from a copy, or {RERUN}"
                )
        self._checksums[shard] = checksums
        self._checked[shard] = np.zeros(blocks, dtype=bool)
        return self._checked[shard]


class PretokenizedDataset(IterableDataset, Stateful):
    """One data-parallel rank's ``(input_ids, labels)`` micro-batches, each ``(batch_size, seq_len)``,
    read from the memory-mapped shards of a pre-tokenized folder; nothing is tokenized."""

    def __init__(
        self,
        folder: Path,
        manifest: dict[str, Any],
        seq_len: int,
        layout: BatchLayout,
        infinite: bool = True,
        seed: int = 0,
        shuffle: bool = False,
    ):
        self.windows = TokenWindows(folder, manifest, seq_len + 1)
        self.window, self.num_windows = self.windows.window, self.windows.num_windows
        # This rank's rows of a step, one list per micro-batch, and the next micro-batch to make.
        self._cursor = StepCursor(layout)
        self.global_batch = self._cursor.global_batch
        if self.num_windows < self.global_batch:
            raise ValueError(
                f"{folder} holds {self.num_windows} windows of seq_len + 1 = {self.window} tokens, fewer "
                f"than the {self.global_batch} sequences of a global batch: use more data or a smaller "
                "global batch"
            )
        self.folder = folder
        self.infinite = infinite
        self.shuffle = shuffle and infinite  # evaluation reads the windows in order
        self.seed = seed
        self.load_state_dict(self._fresh_state())

    def _order(self):
        return WindowOrder(self.num_windows, self.seed, self.epoch) if self.shuffle else (lambda i: i)

    def __iter__(self) -> Iterator[Batch]:
        order = self._order()
        while True:
            if self.consumed + self.global_batch > self.num_windows:  # the incomplete last batch is dropped
                if not self.infinite:
                    self.load_state_dict(self._fresh_state())  # the next pass starts from the beginning
                    return
                self.epoch, self.consumed = self.epoch + 1, 0
                warn_relooped(f"Dataset {self.folder}", self.epoch)
                order = self._order()
            yield from self._cursor.rest_of_step(functools.partial(self._micro_batch, order), self._step_done)

    def _micro_batch(self, order: Callable[[int], int], rows: list[int]) -> Batch:
        windows = [order(self.consumed + row) for row in rows]
        return Batch.of_windows(
            torch.from_numpy(np.stack([self.windows.read(w) for w in windows]).astype(np.int64))
        )

    def _step_done(self) -> None:
        self.consumed += self.global_batch

    def keep_share(self, worker: int, num_workers: int) -> None:
        """Keep rows ``worker, worker + num_workers, ...`` of each micro-batch (data loading workers)."""
        self._cursor.keep_share(worker, num_workers)

    def _fresh_state(self) -> dict[str, Any]:
        return {"pretokenized": torch.tensor([0, 0, 0, self.global_batch], dtype=torch.long)}

    def state_dict(self) -> dict[str, Any]:
        """Epoch, windows consumed in it, this step's micro-batches done, and the global batch size: the
        same on every rank between steps, whatever the layout."""
        state = [self.epoch, self.consumed, self._cursor.micro, self.global_batch]
        return {"pretokenized": torch.tensor(state, dtype=torch.long)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "pretokenized" not in state_dict:
            raise ValueError(
                "The data loader state was saved by the text loader, not a pre-tokenized one (it holds "
                f"{', '.join(state_dict) or 'nothing'}); start the data afresh with "
                "--checkpoint.exclude_from_loading dataloader"
            )
        epoch, consumed, micro, global_batch = (int(v) for v in state_dict["pretokenized"])
        self._cursor.load(micro, global_batch)
        self.epoch, self.consumed = epoch, consumed


_worker: dict[str, Any] = {}


def _init_worker(tokenizer_path: str, dtype: str, folder: str) -> None:
    from torchtitan.datasets.tokenizer import build_tokenizer

    _worker.update(tokenizer=build_tokenizer(tokenizer_path), dtype=TOKEN_DTYPES[dtype], folder=Path(folder))


def _write_shard(index: int, texts: list[str]) -> dict[str, Any]:
    """Tokenize a contiguous range of documents into shard `index`; its entry in the manifest."""
    encode, dtype = _worker["tokenizer"].encode, _worker["dtype"]
    docs = [np.array(encode(text, bos=True, eos=True), dtype=dtype) for text in texts]
    offsets = np.cumsum([0] + [len(d) for d in docs], dtype=np.int64)
    tokens_name, offsets_name, checksums_name = shard_names(index)
    tokens = np.concatenate(docs or [np.empty(0, dtype)])
    # Written through Python's file rather than ndarray.tofile, whose failure drops the errno (a full disk)
    (_worker["folder"] / tokens_name).write_bytes(tokens.tobytes())
    np.save(_worker["folder"] / offsets_name, offsets)
    np.save(_worker["folder"] / checksums_name, block_checksums(tokens))
    return {
        "tokens": tokens_name,
        "offsets": offsets_name,
        "checksums": checksums_name,
        "num_tokens": int(offsets[-1]),
        "num_documents": len(docs),
        "crc32": zlib.crc32(tokens),  # the whole shard's: what a mixture's checkpoint fingerprints
    }


def pretokenize(
    texts: Iterator[list[str]],
    tokenizer_path: str,
    vocab_size: int,
    output: Path,
    workers: int,
    source: dict[str, Any],
    total_documents: int | None = None,
) -> dict[str, Any]:
    """Write the pre-tokenized folder `output` from `texts` (one list of documents per shard) with
    `workers` processes; returns its manifest. Shards are cut by document count, not by worker, so the
    output is the same for any number of workers. It is written to a temporary folder renamed at the end:
    an interrupted run leaves no `output` behind."""
    from tqdm import tqdm

    dtype = token_dtype(vocab_size)
    shards: list[dict[str, Any]] = []
    with written_whole(output) as tmp:
        progress = tqdm(total=total_documents, unit="doc", desc="pretokenize", dynamic_ncols=True)
        init = (tokenizer_path, dtype, str(tmp))
        with multiprocessing.Pool(workers, initializer=_init_worker, initargs=init) as pool, progress:
            pending: deque = deque()

            def collect() -> None:
                shards.append(pending.popleft().get())
                progress.update(shards[-1]["num_documents"])
                progress.set_postfix(tokens=f"{sum(s['num_tokens'] for s in shards):,}")

            for index, batch in enumerate(texts):
                pending.append(pool.apply_async(_write_shard, (index, batch)))
                if len(pending) > 2 * workers:  # bounded: the reader stays a few shards ahead
                    collect()
            while pending:
                collect()
        return write_manifest(tmp, tokenizer_path, vocab_size, source, shards)


@contextlib.contextmanager
def written_whole(output: Path) -> Iterator[Path]:
    """A temporary folder beside `output`, renamed to it once the block is done and removed if it fails:
    an interrupted run leaves no `output` behind."""
    if output.exists():
        raise FileExistsError(f"{output} exists; choose a new --output folder or remove it")
    tmp = output.with_name(f"{output.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True)
    try:
        yield tmp
        os.rename(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_manifest(
    folder: Path,
    tokenizer_path: str,
    vocab_size: int,
    source: dict[str, Any],
    shards: list[dict[str, Any]],
    **extra: Any,
) -> dict[str, Any]:
    """Write and return the manifest of `folder`'s `shards`; `extra` entries (chat's settings) follow
    `source`."""
    manifest = {
        "format": "torchtitan pre-tokenized",
        "version": FORMAT_VERSION,
        "tokenizer": {
            "path": str(tokenizer_file(tokenizer_path)),
            "sha256": file_sha256(tokenizer_file(tokenizer_path)),
            "vocab_size": vocab_size,
        },
        "dtype": token_dtype(vocab_size),
        "checksum_tokens": CHECK_TOKENS,
        "source": source,
        **extra,
        "num_documents": sum(s["num_documents"] for s in shards),
        "num_tokens": sum(s["num_tokens"] for s in shards),
        "shards": shards,
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest
