"""A checksum manifest in every checkpoint, so that a damaged one (a truncated copy, a flipped bit on a
disk or on the way) is refused with one line instead of crashing DCP or loading wrong weights.

`checksums.json` in a `step-N` folder lists each file's size and CRC32. It is written by the
coordinator inside the save, before CheckpointManager renames `step-N.tmp` to `step-N`, so a complete
`step-N` written by this version always has it.

Each rank checksums the files it has just written itself (in the background writer for an async save)
and hands the sums to the coordinator inside its DCP write results, which DCP gathers anyway to write
`.metadata`. So no file is read again by another node, and no collective is added: the ranks finish
an async save at different moments, where a collective of our own could wait forever.

On load the ranks share the reading: rank r checks every world_size-th file and the verdicts are
all-gathered (loading is collective anyway), so all ranks stop with the same line."""

import json
import os
import zlib
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from torchtitan.checkpoint.folder import CHECKSUMS as MANIFEST
from torchtitan.checkpoint.folder import list_checkpoints
from torchtitan.config.options import ConfigError
from torchtitan.logging import logger

_CHUNK = 4 << 20
# The write result that carries a rank's checksums to the coordinator; never a state-dict key.
_SUMS_KEY = "__checksums__"


def file_checksum(path: str) -> list[int]:
    """[size, CRC32] of a file, read in chunks."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return [size, crc]


def _table_crc(files: dict[str, list[int]]) -> int:
    return zlib.crc32(json.dumps(files, sort_keys=True).encode())


class ChecksumWriter(FileSystemWriter):
    """DCP's FileSystemWriter, plus `checksums.json`."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results = super().write_data(plan, planner).wait()
        names = sorted({result.storage_data.relative_path for result in results})
        sums = {name: file_checksum(os.path.join(self.path, name)) for name in names}
        future: Future[list[WriteResult]] = Future()
        future.set_result([*results, WriteResult(MetadataIndex(_SUMS_KEY), 0, sums)])
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        files: dict[str, list[int]] = {}
        for rank_results in results:
            files.update(next(r.storage_data for r in rank_results if r.index.fqn == _SUMS_KEY))
        super().finish(
            metadata, [[r for r in rank_results if r.index.fqn != _SUMS_KEY] for rank_results in results]
        )
        files[".metadata"] = file_checksum(os.path.join(self.path, ".metadata"))
        with open(os.path.join(self.path, MANIFEST), "w") as f:
            json.dump({"files": files, "crc32": _table_crc(files)}, f, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())


def _read_manifest(path: str) -> dict[str, list[int]] | str:
    """The manifest's table of files, or what is wrong with it."""
    try:
        with open(os.path.join(path, MANIFEST), "rb") as f:
            manifest: Any = json.loads(f.read())
        files = manifest["files"]
        if _table_crc(files) != manifest["crc32"]:
            return f"{MANIFEST} does not match its own checksum"
        return files
    except (ValueError, TypeError, KeyError) as e:
        return f"{MANIFEST} is unreadable ({type(e).__name__})"


def find_damage(path: str, rank: int = 0, world_size: int = 1) -> str | None:
    """What is wrong with the checkpoint at `path` according to its manifest, checking this rank's
    share of the files (every world_size-th); None if nothing. A checkpoint without a manifest (saved
    by an earlier version, converted, exported) passes, with an info line."""
    if not os.path.exists(os.path.join(path, MANIFEST)):
        logger.info(
            f"{path} has no {MANIFEST} (saved by an earlier version or converted): loading it unverified"
        )
        return None
    files = _read_manifest(path)
    if isinstance(files, str):
        return files
    for name in sorted(files)[rank::world_size]:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"{name} is missing"
        size, crc = file_checksum(file)
        if size != files[name][0]:
            return f"{name} has {size} bytes, {files[name][0]} when saved"
        if crc != files[name][1]:
            return f"{name} does not match its CRC32 checksum"
    return None


def check_intact(path: str, fallback: str | None = None) -> None:
    """Raise a one-line ConfigError if a file of the checkpoint at `path` is not what was saved, saying
    how to go on: `fallback`, or by default an earlier step of the same run (checkpoint.load_step).
    Collective when a process group exists: every rank checks its share and all stop together."""
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    damage = find_damage(path, rank, world_size)
    if world_size > 1:
        found: list[str | None] = [None] * world_size
        dist.all_gather_object(found, damage)
        damage = next((d for d in found if d is not None), None)
    if damage is None:
        return
    if fallback is None:
        folder, name = os.path.split(os.path.normpath(path))
        others = [str(s) for s in list_checkpoints(folder) if f"step-{s}" != name]
        fallback = (
            f"resume from another one with --checkpoint.load_step (available steps: {', '.join(others)})"
            if others
            else "there is no other checkpoint to resume from: move it away to start afresh"
        )
    raise ConfigError(f"checkpoint: {path} is damaged: {damage}; {fallback}")
