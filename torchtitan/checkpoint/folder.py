"""Where a run's checkpoints are and which one it resumes from: `{dump_folder}/{checkpoint.folder}/step-N`.

A `step-N` folder with a `.metadata` file is complete (torchtitan/checkpoint/manager.py writes
`step-N.tmp` and renames it once whole). Torch-free: the preflight checks these rules before any
worker starts."""

import os
import re

from torchtitan.config.options import CheckpointConfig, ConfigError, JobConfig
from torchtitan.config.paths import check_folder, shown

STEP_DIR = re.compile(r"^step-(\d+)$")
# Folders of a save or a deletion cut short; never loaded, removed at start.
LEFTOVER_DIR = re.compile(r"^step-\d+\.(tmp|old|purging)$")


def checkpoint_folder(job_config: JobConfig) -> str:
    return os.path.join(job_config.job.dump_folder, job_config.checkpoint.folder)


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, ".metadata"))


def check_checkpoint(option: str, path: str) -> None:
    """A complete DCP checkpoint folder (a step-N folder with its .metadata)."""
    fix = "give a DCP checkpoint folder, e.g. outputs/checkpoint/step-100"
    check_folder(option, path, fix=fix)
    if not is_complete(path):
        raise ConfigError(f"{option}: {shown(path)} is not a complete DCP checkpoint (no .metadata); {fix}")


def list_checkpoints(folder: str) -> list[int]:
    """Steps of the complete checkpoints in `folder`, oldest first."""
    if not os.path.isdir(folder):
        return []
    steps = [int(m.group(1)) for name in os.listdir(folder) if (m := STEP_DIR.match(name))]
    return sorted(s for s in steps if is_complete(os.path.join(folder, f"step-{s}")))


def check_load_step(checkpoint_config: CheckpointConfig, folder: str) -> None:
    """checkpoint.load_step, when set, must name a complete checkpoint."""
    step = checkpoint_config.load_step
    if step != -1 and step not in (steps := list_checkpoints(folder)):
        raise ConfigError(
            f"checkpoint.load_step: there is no complete checkpoint step-{step} in {folder}; "
            f"available steps: {', '.join(map(str, steps)) or 'none'}"
        )


def is_hf_folder(path: str) -> bool:
    """A Hugging Face model folder (its config.json), which checkpoint.initial_load_path may name."""
    return os.path.isfile(os.path.join(path, "config.json"))


def check_initial_load_path(checkpoint_config: CheckpointConfig) -> None:
    path = checkpoint_config.initial_load_path
    if path is not None and not is_complete(path) and not is_hf_folder(path):
        raise ConfigError(
            f"checkpoint.initial_load_path: {path} is not a DCP checkpoint folder (no .metadata) nor a "
            "Hugging Face model folder (no config.json); point it at a step-N folder or a model folder"
        )


def latest_checkpoint_path(job_config: JobConfig) -> str:
    """The checkpoint a tool reads for a run (checkpoint.load_step, else the newest, weights-only
    exports included, else checkpoint.initial_load_path)."""
    checkpoint_config = job_config.checkpoint
    folder = checkpoint_folder(job_config)
    check_load_step(checkpoint_config, folder)
    steps = [checkpoint_config.load_step] if checkpoint_config.load_step != -1 else list_checkpoints(folder)
    if steps:
        return os.path.join(folder, f"step-{steps[-1]}")
    if checkpoint_config.initial_load_path is not None:
        check_initial_load_path(checkpoint_config)
        return checkpoint_config.initial_load_path
    raise ConfigError(
        f"job.dump_folder: no checkpoint in {folder}; point it at a run trained with "
        "checkpoint.enable_checkpoint, or set checkpoint.initial_load_path"
    )
