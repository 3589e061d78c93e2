"""Reading DCP checkpoints without running code from them: a checkpoint may come from anywhere.

torch.distributed.checkpoint (torch 2.13) reads tensors with `torch.load(weights_only=True)`, but it
unpickles two things with no restriction: the `.metadata` file (`FileSystemReader.read_metadata`:
`pickle.load`) and every non-tensor item (`DefaultLoadPlanner.load_bytes`: `torch.load(weights_only=
False)`). A crafted checkpoint could run code through either. Here `.metadata` is read by an unpickler
that builds only DCP's own metadata classes and a few plain torch types, and non-tensor items must pass
`weights_only=True`, which admits plain values (numbers, strings, lists, dicts, tensors): all this
project's non-tensor state is such (the optimizer's hyperparameters, the data loader's batch count)."""

import io
import os
import pickle
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

from torchtitan.config.options import ConfigError

# (module, name) that a DCP .metadata file may refer to, besides the classes of DCP's metadata module.
_METADATA_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "Path"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            module == "torch.distributed.checkpoint.metadata"
            or (module, name) in _METADATA_GLOBALS
            or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        )
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name} has no place in a checkpoint's metadata")
        return super().find_class(module, name)


class SafeReader(FileSystemReader):
    """A FileSystemReader whose `.metadata` cannot run code, and whose damage is a ConfigError."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = os.path.join(self.path, ".metadata")
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as e:
            raise ConfigError(
                f"checkpoint: {path} is damaged or not a DCP checkpoint's ({e}); move that checkpoint "
                "away or set checkpoint.load_step to another one"
            ) from None
        if not isinstance(metadata, Metadata):
            raise ConfigError(f"checkpoint: {path} holds a {type(metadata).__name__}, not DCP metadata")
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, but a non-tensor item is loaded only if `weights_only=True` accepts it."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            lines = str(e).splitlines()
            reason = next((line for line in lines if "Unsupported global" in line), lines[0])
            raise ConfigError(
                f"checkpoint: the item {read_item.dest_index.fqn} is not plain data and is not loaded "
                f"({reason.removeprefix('WeightsUnpickler error: ')}); has the checkpoint been tampered with?"
            ) from None
        # The same bytes again, now known to hold plain data only, through DCP's own code.
        value.seek(0)
        super().load_bytes(read_item, value)


def saved_entries(path: str) -> dict[str, Any]:
    """What a DCP checkpoint holds: flattened key ('model.norm.weight', 'train_state.step') -> metadata."""
    return SafeReader(path).read_metadata().state_dict_metadata


def read_checkpoint(path: str, prefix: str = "") -> dict[str, Any]:
    """The items of a checkpoint whose flattened name (e.g. 'model.norm.weight') starts with `prefix`,
    as plain tensors and values, read in this one process: for tools and tests."""
    entries = {key: entry for key, entry in saved_entries(path).items() if key.startswith(prefix)}
    state: dict[str, Any] = {
        key: torch.empty(entry.size, dtype=entry.properties.dtype)
        if isinstance(entry, TensorStorageMetadata)
        else None
        for key, entry in entries.items()
    }
    with warnings.catch_warnings():  # DCP warns that it reads in one process even when told so (no_dist)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, storage_reader=SafeReader(path), planner=SafeLoadPlanner(), no_dist=True)
    return state
