"""A Hugging Face folder (config.json and safetensors files, one or sharded with
model.safetensors.index.json) read strictly, for `checkpoint.initial_load_path` (its weights straight
into the sharded model, each rank reading the parts of the files that it holds) and for
scripts/convert_hf_to_dcp.py (the whole state dict), so that the two cannot disagree.

Strict: the index and its shards agree (a missing shard, a tensor in the wrong one), damaged JSON or
safetensors are one line naming the file, every tensor of the folder is used or named as skipped
(`SKIPPED`: multi-token prediction, RoPE frequencies), and a job's model takes every tensor it has, with
its shape, and leaves none of the folder's out (a larger model's extra layers are refused, not dropped).

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

import os
from types import ModuleType
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
from torchtitan.config.paths import check_file, read_json, shown
from torchtitan.logging import logger
from torchtitan.models import HF_CONFIG, MODEL_SPECS, text_config
from torchtitan.models.hf_convert import SKIPPED
from torchtitan.models.spec import ModelArgs

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
TENSOR_BITS = 40  # a row number's bits; the file tensor's number above them
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}
# Our tensors whose rows are the vocabulary.
_VOCAB_TENSORS = ("tok_embeddings.weight", "output.weight")
DOWNLOAD = "download the folder again"


def _folder_types(adapter: ModuleType) -> tuple[str, ...]:
    """The model_types of the folders a family's adapter reads: its own, and those of `ALSO_READS`
    (Qwen3.5's vision-language folders, Qwen3-Next's)."""
    return (adapter.MODEL_TYPE, *getattr(adapter, "ALSO_READS", ()))


def read_hf_config(option: str, folder: str, model_name: str | None) -> tuple[dict[str, Any], ModuleType]:
    """config.json (a vision-language folder's: its text model's, `text_config`), with the keys every
    family's conversion needs, and the adapter of its model_type: that of the family `model_name` (the
    job's), or any family's without one."""
    path = os.path.join(folder, HF_CONFIG)
    config = read_json(option, path)
    if not isinstance(config, dict):
        raise ConfigError(f"{option}: {shown(path)} holds no JSON object; give a Hugging Face model folder")
    adapters = {kind: spec.hf() for spec in MODEL_SPECS.values() for kind in _folder_types(spec.hf())}
    model_type = config.get("model_type")
    job_types = _folder_types(MODEL_SPECS[model_name].hf()) if model_name is not None else (model_type,)
    job_type = job_types[0]
    if model_type not in job_types:
        raise ConfigError(
            f"model.name: {folder} holds a {model_type} model (its {HF_CONFIG}'s model_type), not this "
            f"job's {model_name} ({job_type}); set model.name to the folder's family"
        )
    if model_type not in adapters:
        raise ConfigError(
            f"{option}: {shown(path)} has model_type {model_type!r}; give a model of a supported type "
            f"({', '.join(sorted(adapters))})"
        )
    config = text_config(config)
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if not isinstance(config.get(key), int):
            raise ConfigError(
                f"{option}: {shown(path)} has no integer {key}; give a Hugging Face model folder"
            )
    return config, adapters[model_type]


class _opened:
    """safe_open whose damage (a cut or corrupt file) is one line naming the file."""

    def __init__(self, option: str, file: str) -> None:
        self.option, self.file = option, file

    def __enter__(self) -> Any:
        try:
            self.handle = safe_open(self.file, framework="pt")
        except (SafetensorError, OSError) as e:
            raise ConfigError(
                f"{self.option}: {shown(self.file)} is damaged or not a safetensors file ({e}); {DOWNLOAD}"
            ) from None
        return self.handle.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.handle.__exit__(*exc)


def _folder_tensors(option: str, folder: str) -> dict[str, tuple[str, list[int], str]]:
    """Every tensor of the folder's weights: name -> (file, shape, safetensors dtype). Sharded, the
    files are the index's, each holding exactly the tensors the index puts in it."""
    index_path = os.path.join(folder, INDEX)
    listed: dict[str, set[str]] | None = None
    if os.path.lexists(index_path):
        index = read_json(option, index_path)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ConfigError(
                f"{option}: {shown(index_path)} has no weight_map of tensors to files; {DOWNLOAD}"
            )
        listed = {}
        for name, file in weight_map.items():
            listed.setdefault(file, set()).add(name)
    elif not os.path.lexists(os.path.join(folder, SINGLE)):
        raise ConfigError(
            f"{option}: {shown(folder)} has a {HF_CONFIG} but no weights ({SINGLE} or {INDEX}); "
            "point it at a Hugging Face model folder"
        )
    tensors = {}
    for file in sorted(listed) if listed is not None else [SINGLE]:
        path = os.path.join(folder, file)
        check_file(option, path, fix=f"{INDEX} names it: {DOWNLOAD}" if listed is not None else DOWNLOAD)
        with _opened(option, path) as f:
            held = set(f.keys())
            if listed is not None and held != listed[file]:
                name = sorted(listed[file] ^ held)[0]
                disagree = (
                    f"{INDEX} puts {name} in {shown(path)}, which does not hold it"
                    if name in listed[file]
                    else f"{shown(path)} holds {name}, which {INDEX} puts elsewhere or nowhere"
                )
                raise ConfigError(f"{option}: {disagree}; {DOWNLOAD}")
            for name in held:
                tensor = f.get_slice(name)
                tensors[name] = (path, tensor.get_shape(), tensor.get_dtype())
    return tensors


def _check_complete(option: str, folder: str, tensors: dict, expected: list[str]) -> None:
    """Every tensor the folder's config.json gives the model is there (a layer's, an expert's, a
    multi-token prediction depth's), else one line naming the first missing and where it belongs,
    before anything is read or written."""
    missing = next((name for name in expected if name not in tensors), None)
    if missing is None:
        return
    index = os.path.lexists(os.path.join(folder, INDEX))
    where = (
        f"no file of {shown(os.path.join(folder, INDEX))} holds"
        if index
        else f"{shown(os.path.join(folder, SINGLE))} has no"
    )
    raise ConfigError(
        f"{option}: {where} {missing}, which its {HF_CONFIG} needs ({len(expected)} tensors); {DOWNLOAD}"
    )


def _skipped(name: str, patterns: dict) -> str | None:
    """Why the folder's tensor `name` is left out (`patterns`: pattern -> why), or None for one the
    conversion uses."""
    return next((why for pattern, why in patterns.items() if pattern.fullmatch(name)), None)


class HFReader(StorageReader):
    """A Hugging Face folder as a DCP checkpoint of our model family's state dict, under `prefix`: the
    family `model_name`'s (its config.json's model_type must be that family's), or, without one, the
    family config.json names. Errors name `option`."""

    def __init__(
        self,
        path: str,
        option: str,
        model_name: str | None = None,
        prefix: str = "model.",
        mtp_layers: int = 0,
    ) -> None:
        super().__init__()
        self.path, self.option, self.prefix = path, option, prefix
        self.config, self.adapter = read_hf_config(option, path, model_name)
        adapter = self.adapter
        tensors = _folder_tensors(option, path)
        # Every family's skipped tensors, and those of the family's own layout (DeepSeek-V3's MTP layers
        # beyond the model's `mtp_layers`).
        own = adapter.skipped(self.config, mtp_layers) if hasattr(adapter, "skipped") else {}
        patterns = {**SKIPPED, **own}
        self.skipped = {name: why for name in tensors if (why := _skipped(name, patterns)) is not None}
        self.names = sorted(name for name in tensors if name not in self.skipped)
        _check_complete(option, path, tensors, adapter.hf_tensors(self.config, mtp_layers))
        self.files: dict[str, str] = {}
        self.shapes: dict[str, list[int]] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        rows = {}
        for number, name in enumerate(self.names):
            file, shape, dtype = tensors[name]
            if dtype not in _DTYPES or not shape:
                raise ConfigError(
                    f"{option}: {shown(file)} holds {name} as a {dtype} tensor of shape {tuple(shape)}, "
                    f"which no parameter is (one of {', '.join(_DTYPES)}, one dimension or more); {DOWNLOAD}"
                )
            self.files[name], self.shapes[name], self.dtypes[name] = file, shape, _DTYPES[dtype]
            # The rows of the tensor, its columns collapsed: what the adapter moves.
            rows[name] = (torch.arange(shape[0]) + (number << TENSOR_BITS)).view(
                shape[0], *[1] * (len(shape) - 1)
            )
        try:
            self.sources = adapter.from_hf(rows, self.config)
        except KeyError as e:
            raise ConfigError(f"{option}: {path}: {e.args[0]}; is it another family's?") from None
        self.bytes_read = 0  # what this rank read of the files

    def skipped_summary(self) -> str:
        """The folder's tensors left out, by reason, e.g. 'multi-token prediction: 12 tensors (mtp.fc.weight,
        ...)'; empty when none is."""
        by_reason: dict[str, list[str]] = {}
        for name, why in sorted(self.skipped.items()):
            by_reason.setdefault(why, []).append(name)
        return "; ".join(
            f"{why}: {len(names)} tensors ({names[0]}{', ...' if len(names) > 1 else ''})"
            for why, names in by_reason.items()
        )

    def read_all(self) -> dict[str, torch.Tensor]:
        """Our whole state dict, each tensor read whole (scripts/convert_hf_to_dcp.py)."""
        return {
            ours: self.read_region(ours, tuple(slice(0, n) for n in self.shape(ours)))
            for ours in self.sources
        }

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
            with _opened(self.option, self.files[name]) as f:
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


def load_hf_weights(
    model: nn.Module, path: str, model_config: ModelConfig, model_args: ModelArgs
) -> HFReader:
    """The Hugging Face folder's weights into this rank's `model` (its parts merged), whatever the
    layout; checked first against the whole model `model_args` builds (the same on every rank), one line
    each: the family, every tensor the model has present with its shape, none of the folder's left
    out but those `SKIPPED`, and, as the family's adapter checks it (`check_flavor`), config.json's
    other settings. Returns the reader (its `bytes_read`)."""
    mtp_layers = getattr(model_args, "mtp_layers", 0)
    reader = HFReader(path, "checkpoint.initial_load_path", model_config.name, mtp_layers=mtp_layers)
    with torch.device("meta"):
        expected = {
            name: tuple(tensor.shape)
            for name, tensor in MODEL_SPECS[model_config.name].build(model_args).state_dict().items()
        }
    job_model = f"{model_config.name} {model_config.flavor}"
    for name, shape in expected.items():
        if name not in reader.sources and name.startswith("mtp."):
            depths = reader.config.get("num_nextn_predict_layers") or 0
            raise ConfigError(
                f"model.mtp_layers: {path} has {depths} multi-token prediction layers, fewer than the "
                f"{mtp_layers} asked for; set model.mtp_layers to at most {depths}"
            )
        if name not in reader.sources:
            raise ConfigError(
                f"checkpoint.initial_load_path: {path} has no {name}; is model.flavor "
                f"{model_config.flavor} the folder's?"
            )
        theirs = tuple(reader.shape(name))
        if theirs != shape and name in _VOCAB_TENSORS and theirs[1:] == shape[1:]:
            raise ConfigError(
                f"model.vocab_size: {path} holds {name} with {theirs[0]} rows (its vocabulary), this job's "
                f"model {shape[0]}; set model.vocab_size to {theirs[0]}"
            )
        if theirs != shape:
            raise ConfigError(
                f"model.flavor: {path} holds {name} with shape {theirs} but {job_model}'s is {shape}; set "
                "model.flavor to the folder's"
            )
    if extra := sorted(set(reader.sources) - set(expected)):
        more = f" and {len(extra) - 1} more" if len(extra) > 1 else ""
        raise ConfigError(
            f"model.flavor: {path} holds {extra[0]}{more}, which {job_model} has no place for (the folder's "
            f"{reader.config['num_hidden_layers']} layers, the flavour's {model_args.n_layers}); set "
            "model.flavor to the folder's"
        )
    reader.adapter.check_flavor(reader.config, model_args, path)  # what config.json sets beyond the shapes
    if reader.skipped:
        logger.info(
            f"Not loading tensors of {path} that this model has no place for: {reader.skipped_summary()}"
        )
    dcp.load({"model": ModelState(model)}, storage_reader=reader)
    return reader
