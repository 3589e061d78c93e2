"""`checkpoint.initial_load_path` as a Hugging Face folder (config.json and safetensors files, one or
sharded with model.safetensors.index.json): its weights read straight into the sharded model, each rank
reading the parts of the files that it holds.

DCP does the loading (`dcp.load` with `HFReader`, a StorageReader): its planner asks each rank for the
regions of our parameters it holds, whatever the layout (FSDP shards, TP slices, experts, strided
FSDP x TP, pipeline stages), and the reader serves each region from the files. DCP's own
HuggingFaceStorageReader reads HF's tensors as they are; ours differ (names, Llama's q/k rows per head,
the experts stacked, a tied head), so the reader maps each of our rows to the file's row it comes from,
by running the family's own `from_hf` (its adapter: torchtitan/models/<family>/hf_convert.py) on
tensors of row numbers instead of weights: every change of layout there moves whole rows, so each of
our rows learns its source (tensor and row) and the columns pass through. A region then reads, from
each file tensor it needs, the span of rows between the first and the last it needs, only the region's
columns.
"""

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError, safe_open
from torch import nn
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader

from torchtitan.checkpoint.state import ModelState
from torchtitan.config.options import ConfigError, ModelConfig
from torchtitan.models import MODEL_SPECS

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
TENSOR_BITS = 40  # a row number's bits; the file tensor's number above them


def _weight_files(path: str) -> dict[str, str]:
    """Each tensor's safetensors file in the folder (sharded: by model.safetensors.index.json)."""
    if os.path.isfile(os.path.join(path, INDEX)):
        index = json.loads(Path(path, INDEX).read_text())
        return {name: os.path.join(path, file) for name, file in index["weight_map"].items()}
    if os.path.isfile(os.path.join(path, SINGLE)):
        with _opened(os.path.join(path, SINGLE)) as f:
            return {name: os.path.join(path, SINGLE) for name in f.keys()}  # noqa: SIM118
    raise ConfigError(
        f"checkpoint.initial_load_path: {path} has a {CONFIG} but no weights ({SINGLE} or {INDEX}); "
        "point it at a Hugging Face model folder"
    )


class _opened:
    """safe_open whose damage (a cut or corrupt file) is one line."""

    def __init__(self, file: str) -> None:
        self.file = file

    def __enter__(self) -> Any:
        try:
            self.handle = safe_open(self.file, framework="pt")
        except (SafetensorError, OSError) as e:
            raise ConfigError(
                f"checkpoint.initial_load_path: {self.file} is damaged or not a safetensors file ({e}); "
                "download it again"
            ) from None
        return self.handle.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.handle.__exit__(*exc)


class HFReader(StorageReader):
    """A Hugging Face folder as a DCP checkpoint of our model family's state dict, under `prefix`."""

    def __init__(self, path: str, model_name: str, prefix: str = "model.") -> None:
        super().__init__()
        self.path, self.prefix = path, prefix
        self.config = json.loads(Path(path, CONFIG).read_text())
        adapter = MODEL_SPECS[model_name].hf()
        model_type = self.config.get("model_type")
        if model_type != adapter.MODEL_TYPE:
            raise ConfigError(
                f"model.name: {path} holds a {model_type} model (its {CONFIG}'s model_type), not this job's "
                f"{model_name} ({adapter.MODEL_TYPE}); set model.name to the folder's family"
            )
        self.files = _weight_files(path)
        names = sorted(self.files)
        self.shapes: dict[str, list[int]] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        rows = {}
        for number, name in enumerate(names):
            with _opened(self.files[name]) as f:
                tensor = f.get_slice(name)
                shape, dtype = tensor.get_shape(), tensor.get_dtype()
            self.shapes[name] = shape
            self.dtypes[name] = _DTYPES[dtype]
            # The rows of the tensor, its columns collapsed: what the adapter moves.
            rows[name] = (torch.arange(shape[0]) + (number << TENSOR_BITS)).view(
                shape[0], *[1] * (len(shape) - 1)
            )
        try:
            self.sources = adapter.from_hf(rows, self.config)
        except KeyError as e:
            raise ConfigError(
                f"checkpoint.initial_load_path: {path}: {e.args[0]}; is it another family's?"
            ) from None
        self.names = names
        self.bytes_read = 0  # what this rank read of the files

    def _columns(self, source: torch.Tensor) -> list[int]:
        """The file tensor's column sizes (all but its rows) behind our tensor's source rows."""
        return self.shapes[self.names[int(source.flatten()[0]) >> TENSOR_BITS]][1:]

    def shape(self, ours: str) -> list[int]:
        """Our tensor's full shape: its source rows' shape with the file tensor's columns."""
        source = self.sources[ours]
        if source.dtype != torch.int64:  # made by the adapter (a zero routing bias)
            return list(source.shape)
        columns = self._columns(source)
        return list(source.shape[: source.ndim - len(columns)]) + columns

    def dtype(self, ours: str) -> torch.dtype:
        source = self.sources[ours]
        if source.dtype != torch.int64:
            return source.dtype
        return self.dtypes[self.names[int(source.flatten()[0]) >> TENSOR_BITS]]

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        entries = {}
        for ours in self.sources:
            shape = torch.Size(self.shape(ours))
            chunk = ChunkStorageMetadata(torch.Size([0] * len(shape)), shape)
            entries[self.prefix + ours] = TensorStorageMetadata(
                TensorProperties(dtype=self.dtype(ours)), shape, [chunk]
            )
        return Metadata(state_dict_metadata=entries, storage_meta=StorageMeta())

    def read_region(self, ours: str, region: tuple[slice, ...]) -> torch.Tensor:
        """Our tensor's `region` (a slice per dimension), read from the files: from each file tensor
        it needs, the rows from the first to the last it needs, the region's columns only."""
        source = self.sources[ours]
        if source.dtype != torch.int64:
            return source[region]
        n_columns = len(self._columns(source))
        row_region, column_region = region[: source.ndim - n_columns], region[source.ndim - n_columns :]
        ids = source[row_region].flatten()
        tensors, rows = ids >> TENSOR_BITS, ids & ((1 << TENSOR_BITS) - 1)
        out = None
        for number in tensors.unique().tolist():
            mine = tensors == number
            first, last = int(rows[mine].min()), int(rows[mine].max())
            name = self.names[number]
            with _opened(self.files[name]) as f:
                block = f.get_slice(name)[(slice(first, last + 1), *column_region)]
            self.bytes_read += block.numel() * block.element_size()
            if out is None:
                out = block.new_empty(len(ids), *block.shape[1:])
            out[mine] = block[rows[mine] - first]
        return out.view([s.stop - s.start for s in region])

    # DCP's StorageReader interface: one process reads its plan's items from the files.
    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future:
        for item in plan.items:
            ours = item.storage_index.fqn.removeprefix(self.prefix)
            region = tuple(slice(o, o + n) for o, n in zip(item.storage_offsets, item.lengths))
            target = planner.resolve_tensor(item).detach()
            target.copy_(self.read_region(ours, region))
            planner.commit_tensor(item, target)
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True


_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


def load_hf_weights(model: nn.Module, path: str, model_config: ModelConfig) -> HFReader:
    """The Hugging Face folder's weights into this rank's `model` (its parts merged), whatever the
    layout, the family and every shape checked first (one line each); returns the reader (its
    `bytes_read`)."""
    reader = HFReader(path, model_config.name)
    state = ModelState(model)
    for name, tensor in state.state_dict().items():
        if name not in reader.sources:
            raise ConfigError(
                f"checkpoint.initial_load_path: {path} has no {name}; is model.flavor "
                f"{model_config.flavor} the folder's?"
            )
        if list(tensor.shape) != reader.shape(name):
            raise ConfigError(
                f"model.flavor: {path} holds {name} with shape {tuple(reader.shape(name))} but "
                f"{model_config.name} {model_config.flavor}'s is {tuple(tensor.shape)}; set model.flavor to "
                "the folder's"
            )
    dcp.load({"model": state}, storage_reader=reader)
    return reader
