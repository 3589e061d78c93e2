"""Loading a checkpoint into a run: what does not fit (shapes, missing parts, another data layout,
another model) is one line naming the checkpoint and the fix, checked before DCP reads anything, and
DCP reads through the safe reader (torchtitan/checkpoint/safe_reader.py)."""

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan.checkpoint.checksums import check_intact
from torchtitan.checkpoint.safe_reader import SafeLoadPlanner, SafeReader, read_checkpoint, saved_entries
from torchtitan.checkpoint.state import RECORD, ModelState, merge_model_parts, model_record
from torchtitan.config.options import ConfigError, ModelConfig
from torchtitan.config.paths import shown
from torchtitan.logging import logger


def read_model_weights(path: str) -> dict[str, torch.Tensor]:
    """The whole model's weights in a checkpoint, as plain CPU tensors (read in this one process)."""
    weights = {key.removeprefix("model."): value for key, value in read_checkpoint(path, "model.").items()}
    if not weights:
        raise ValueError(f"{path} holds no model weights")
    return weights


def _flat_keys(state: dict[str, Any], prefix: str) -> list[str]:
    """The keys DCP flattens a nested state dict to ('dataloader.dataset_state.x')."""
    keys = []
    for key, value in state.items():
        name = f"{prefix}.{key}"
        keys += _flat_keys(value, name) if isinstance(value, dict) else [name]
    return keys


def load_states(states: dict[str, Stateful], path: str, parts: list[str]) -> None:
    """Load `parts` (keys of `states`) from the checkpoint at `path`, through the safe reader; what does
    not fit this run (shapes, missing parts, another data layout) is a one-line ConfigError."""
    saved = saved_entries(path)
    if "model" in parts:
        _check_model_shapes(states["model"], path, saved)
    if "rng" in parts:
        rng = states["rng"].state_dict()
        if not {f"rng.{rank}.{name}" for rank, states in rng.items() for name in states} <= saved.keys():
            logger.info(f"{path} has no RNG state for this rank and device: keeping the seeded ones")
            parts.remove("rng")
    missing = [part for part in parts if not any(key.startswith(part + ".") for key in saved)]
    if missing:
        raise ConfigError(
            f"checkpoint: {path} has no {', '.join(missing)} state (a model_weights_only export?); "
            "start from it with checkpoint.initial_load_path, or set checkpoint.exclude_from_loading"
        )
    if "dataloader" in parts:
        _check_dataloader_keys(states["dataloader"], path, saved)
    logger.info(f"Loading {', '.join(parts)} from {path}")
    try:
        dcp.load(
            {part: states[part] for part in parts},
            storage_reader=SafeReader(path),  # runs no code from the files (safe_reader.py)
            planner=SafeLoadPlanner(),
        )
    except ConfigError:  # a part's own one line (a mixture's changed sources)
        raise
    except (Exception, dcp.CheckpointException) as e:  # DCP's is a BaseException
        raise ConfigError(
            f"checkpoint: cannot load {path} ({str(e).strip().splitlines()[-1]}); it may come from a "
            "different model or layout: point job.dump_folder elsewhere or move the folder away"
        ) from e


def _check_dataloader_keys(dataloader: Stateful, path: str, saved: dict[str, Any]) -> None:
    """DCP asks for the keys of this run's data loader state; the data streams are keyed by the global
    batch size, so another global batch size (or an older loader) leaves keys missing: say so in one
    line rather than DCP's 'missing key'."""
    missing = [key for key in _flat_keys(dataloader.state_dict(), "dataloader") if key not in saved]
    if missing:
        raise ConfigError(
            f"checkpoint: {path} has no {missing[0]}: its data loader state was saved for another "
            "global batch size or by an older data loader (or from text data for pre-tokenized data, or the "
            "reverse), and the text data streams depend on the global batch size; keep the saved global "
            "batch size, or start the data afresh with --checkpoint.exclude_from_loading dataloader"
        )


def _check_model_shapes(model_state: Stateful, path: str, saved: dict[str, Any]) -> None:
    """Compare the parameters of the whole model (pipeline stages hold different ones, so gather
    them) with the checkpoint's, so that a mismatch is one clear line, the same on every rank."""
    shapes = {f"model.{fqn}": tuple(t.shape) for fqn, t in model_state.state_dict().items()}
    if dist.is_initialized():
        gathered: list[dict] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(gathered, shapes)
        shapes = {key: shape for rank_shapes in gathered for key, shape in rank_shapes.items()}
    hint = "was it saved with another model.flavor, model.n_layers or tokenizer?"
    for key, shape in shapes.items():
        entry = saved.get(key)
        if not isinstance(entry, TensorStorageMetadata):
            raise ConfigError(f"checkpoint: {path} has no parameter {key[6:]}; {hint}")
        if tuple(entry.size) != shape:
            raise ConfigError(
                f"checkpoint: {path} holds {key[6:]} with shape {tuple(entry.size)} but the model's "
                f"is {shape}; {hint}"
            )
    extra = [key for key in saved if key.startswith("model.") and key not in shapes]
    if extra and extra[0].startswith("model.mtp."):
        depths = len({key.split(".")[2] for key in extra if key.startswith("model.mtp.")})
        raise ConfigError(
            f"model.mtp_layers: {path} holds {extra[0][6:]}, a multi-token prediction depth the model lacks; "
            f"set model.mtp_layers to the checkpoint's (at least {depths} more), or convert the Hugging Face "
            "folder with scripts/convert_hf_to_dcp.py --mtp-layers 0"
        )
    if extra:
        raise ConfigError(f"checkpoint: {path} holds {extra[0][6:]}, which the model lacks; {hint}")


def read_model_record(path: str) -> dict[str, str] | None:
    """The model the checkpoint at `path` records (name, flavor, tokenizer_sha256), or None where it
    records none (saved by an earlier version, converted from Hugging Face)."""
    if not any(key.startswith(RECORD + ".") for key in saved_entries(path)):
        return None
    return {key.removeprefix(RECORD + "."): v for key, v in read_checkpoint(path, RECORD + ".").items()}


def check_model_record(path: str, model_config: ModelConfig) -> None:
    """Raise a one-line ConfigError if the checkpoint at `path` holds another model (name, flavour or
    tokenizer) than `model_config`'s. What a checkpoint does not record (saved by an earlier version,
    converted from Hugging Face) is unknown and passes."""
    saved = read_model_record(path)
    if saved is None:
        return
    ours = model_record(model_config)
    if (saved["name"], saved["flavor"]) != (ours["name"], ours["flavor"]):
        option = "model.name" if saved["name"] != ours["name"] else "model.flavor"
        raise ConfigError(
            f"{option}: {path} holds a {saved['name']} {saved['flavor']} model, not this job's "
            f"{ours['name']} {ours['flavor']}; set --model.name {saved['name']} --model.flavor "
            f"{saved['flavor']}, or load a checkpoint of this model"
        )
    if saved["tokenizer_sha256"] != ours["tokenizer_sha256"]:
        raise ConfigError(
            f"model.tokenizer_path: {path} was trained with another tokenizer than "
            f"{shown(model_config.tokenizer_path)} (their SHA-256 differ); set model.tokenizer_path to the "
            "checkpoint's tokenizer"
        )


def load_model_weights(model_parts: list[nn.Module], path: str, verify: bool = True) -> None:
    """The model weights of the checkpoint at `path` into this rank's parts, whatever the layout;
    `verify`: against its checksums first."""
    if verify:
        check_intact(path)
    load_states({"model": ModelState(merge_model_parts(model_parts))}, path, ["model"])
