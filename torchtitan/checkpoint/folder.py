"""Where a run's checkpoints are and which one it resumes from: `{dump_folder}/{checkpoint.folder}/step-N`.

A `step-N` folder with a `.metadata` file is complete (torchtitan/checkpoint/manager.py writes
`step-N.tmp` and renames it once whole). Torch-free: the preflight checks these rules before any
worker starts."""

import contextlib
import os
import re
import shutil
from collections.abc import Iterator

from torchtitan.config.options import CheckpointConfig, ConfigError, JobConfig
from torchtitan.config.paths import check_folder, check_writable_folder, read_json, shown
from torchtitan.models import HF_CONFIG

CHECKSUMS = "checksums.json"  # a step-N's files' sizes and CRC32s (torchtitan/checkpoint/checksums.py)
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
    return os.path.isfile(os.path.join(path, HF_CONFIG))


def check_initial_load_path(checkpoint_config: CheckpointConfig) -> None:
    """A DCP checkpoint or a Hugging Face folder whose config.json reads (a hand edit's stray comma is
    one line here, before any worker starts)."""
    path = checkpoint_config.initial_load_path
    if path is None or is_complete(path):
        return
    if not is_hf_folder(path):
        raise ConfigError(
            f"checkpoint.initial_load_path: {path} is not a DCP checkpoint folder (no .metadata) nor a "
            "Hugging Face model folder (no config.json); point it at a step-N folder or a model folder"
        )
    read_json("checkpoint.initial_load_path", os.path.join(path, HF_CONFIG))


def is_run_checkpoint(path: str) -> bool:
    """A step-N folder a run saved: complete, with its checksums."""
    return is_complete(path) and os.path.isfile(os.path.join(path, CHECKSUMS))


def check_output_folder(option: str, output: str, overwrite: bool, inputs: list[str]) -> None:
    """A converter's output folder, before anything is read: never a run's checkpoint or a folder in one
    (its checksums would no longer match, or the run would resume from model weights only), never one
    holding an input; an existing non-empty folder only with `overwrite`, which replaces it whole (a
    stale shard or index left beside new weights would be loaded with them)."""
    check_writable_folder(option, output)
    real = os.path.realpath(output)
    check_outside_run_checkpoints(option, output, real)
    for source in inputs:
        if os.path.commonpath([real, os.path.realpath(source)]) == real:
            raise ConfigError(f"{option}: {shown(output)} holds the input {shown(source)}; give a new folder")
    held = sorted(os.listdir(output)) if os.path.isdir(output) else []
    if held and not overwrite:
        more = f" and {len(held) - 3} more" if len(held) > 3 else ""
        raise ConfigError(
            f"{option}: {shown(output)} already holds files ({', '.join(held[:3])}{more}); give a new or "
            "empty folder, or pass --overwrite to replace it"
        )


def check_outside_run_checkpoints(option: str, output: str, path: str) -> None:
    """`path` (where `output` writes) is no run's step-N nor inside one: a converter never writes there."""
    folder = os.path.realpath(path)
    while True:
        if is_run_checkpoint(folder):
            where = "" if folder == os.path.realpath(output) else f"inside {shown(folder)}, "
            raise ConfigError(
                f"{option}: {shown(output)} is {where}a run's checkpoint (.metadata and {CHECKSUMS}), "
                "which a converter never writes into; give a new folder"
            )
        if folder == (folder := os.path.dirname(folder)):
            return


def check_output_file_is_new(option: str, output: str, overwrite: bool) -> None:
    """A converter's output file: never in a run's checkpoint, and an existing one only with `overwrite`."""
    check_outside_run_checkpoints(option, output, os.path.dirname(os.path.abspath(output)))
    if os.path.lexists(output) and not overwrite:
        raise ConfigError(
            f"{option}: {shown(output)} exists; give a new file, or pass --overwrite to replace it"
        )


@contextlib.contextmanager
def replacing_folder(output: str) -> Iterator[str]:
    """A new folder to write `output`'s contents into: made beside it and renamed to `output` once
    complete, the old `output` (if any) deleted only then, so a failed write leaves it as it was."""
    base = os.path.normpath(output)
    new, old = f"{base}.new-{os.getpid()}", f"{base}.old-{os.getpid()}"
    shutil.rmtree(new, ignore_errors=True)
    os.makedirs(new)
    try:
        yield new
    except BaseException:
        shutil.rmtree(new, ignore_errors=True)
        raise
    if os.path.lexists(base):
        os.rename(base, old)
    os.rename(new, base)
    shutil.rmtree(old, ignore_errors=True)


def hf_export_folder(job_config: JobConfig) -> str:
    """Where checkpoint.last_save_in_hf writes: {job.dump_folder}/hf."""
    return os.path.join(job_config.job.dump_folder, "hf")


def check_hf_export_folder(job_config: JobConfig) -> None:
    """checkpoint.last_save_in_hf's folder, checked before training rather than after it."""
    if not job_config.checkpoint.last_save_in_hf:
        return
    folder = hf_export_folder(job_config)
    if os.path.lexists(folder) and not os.path.isdir(folder):
        raise ConfigError(
            f"checkpoint.last_save_in_hf: exports into {shown(folder)}, which is not a folder; move it away "
            "or set job.dump_folder to another folder"
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
