"""Checks of a job that need no torch, so that a bad option, file or folder stops it in a fraction of a
second with one line, before any worker starts: run_llama_train.sh runs them before importing torch
(`python -m torchtitan.reliability.preflight`), and train.py runs them first thing however it is
started. The rules between options are torchtitan/config_rules.py's; the exit codes errors.py's."""

import os
import sys
import tempfile

from torchtitan.checkpoint_folder import check_initial_load_path, check_load_step, checkpoint_folder
from torchtitan.config_manager import ConfigError, JobConfig, parse_args, resolve_path
from torchtitan.config_rules import check_layout, check_lr_schedule
from torchtitan.models import flavor_args
from torchtitan.reliability.dump_lock import check_unlocked
from torchtitan.reliability.errors import EXIT_BAD_INPUT, EXIT_OK, debug_enabled


def check_job(job_config: JobConfig, world_size: int | None) -> None:
    """Raise ConfigError for what can be seen wrong without torch: missing or empty files, the rules
    between options (the parallel layout only when `world_size` is known), an unwritable dump folder,
    a checkpoint step that does not exist."""
    _check_file("model.tokenizer_path", job_config.model.tokenizer_path)
    if job_config.training.dataset_path is not None:
        _check_dataset_path("training.dataset_path", job_config.training.dataset_path)
    if job_config.validation.enable and job_config.validation.dataset_path is not None:
        _check_dataset_path("validation.dataset_path", job_config.validation.dataset_path)
    flavor_args(job_config.model)
    check_lr_schedule(job_config.lr_scheduler, job_config.training.steps)
    if world_size is not None:
        check_layout(job_config, world_size)
    _check_writable_folder("job.dump_folder", job_config.job.dump_folder)
    _check_checkpoint(job_config)


def _check_file(option: str, path: str) -> None:
    resolved = resolve_path(path)
    if not os.path.isfile(resolved):
        what = "is a folder" if os.path.isdir(resolved) else "does not exist"
        raise ConfigError(f"{option}: {path} {what}; set {option} to an existing file")
    if os.path.getsize(resolved) == 0:
        raise ConfigError(f"{option}: {path} is empty; set {option} to a complete file")


def _check_dataset_path(option: str, path: str) -> None:
    resolved = resolve_path(path)
    if not os.path.exists(resolved):
        raise ConfigError(
            f"{option}: {path} does not exist (relative paths are tried from the current "
            "folder, then from the repository); set it to a .txt/.json/.jsonl/.parquet file or a folder"
        )
    if os.path.isfile(resolved) and os.path.getsize(resolved) == 0:
        raise ConfigError(f"{option}: {path} is empty; point it at a file with text in it")
    if os.path.isdir(resolved) and not any(files for _, _, files in os.walk(resolved)):
        raise ConfigError(f"{option}: the folder {path} holds no files; point it at your data")


def _check_writable_folder(option: str, folder: str) -> None:
    """The folder, or the nearest existing folder above it, must take a new file (tried for real:
    permission bits do not tell for root or on a read-only mount)."""
    existing = os.path.abspath(folder)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        inside = "" if existing == os.path.abspath(folder) else f" (it is inside {existing})"
        raise ConfigError(f"{option}: {folder} is a file, not a folder{inside}; set {option} to a folder")
    try:
        with tempfile.TemporaryDirectory(prefix=".titan-write-test-", dir=existing):
            pass
    except OSError as e:
        where = (
            folder
            if existing == os.path.abspath(folder)
            else f"{folder} (its parent {existing} is not writable)"
        )
        raise ConfigError(
            f"{option}: cannot write in {where} ({e.strerror}); set {option} to a writable folder"
        ) from None


def _check_checkpoint(job_config: JobConfig) -> None:
    folder = checkpoint_folder(job_config)
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ConfigError(
            f"checkpoint.folder: {folder} is a file, not a folder; move it or set checkpoint.folder"
        )
    if job_config.checkpoint.enable_checkpoint:
        check_load_step(job_config.checkpoint, folder)
    check_initial_load_path(job_config.checkpoint)


def main(argv: list[str]) -> int:
    """`python -m torchtitan.reliability.preflight [--nproc WORLD_SIZE] [train.py options]`: exit code 0,
    or 2 and one line on stderr. Without --nproc the parallel degrees are left to train.py to check."""
    if any(arg in ("-h", "--help") for arg in argv):
        return EXIT_OK  # train.py prints the help
    world_size = None
    if argv[:1] == ["--nproc"] and len(argv) > 1:
        if not argv[1].isdigit() or int(argv[1]) < 1:
            print(f"error: NGPU: expected a number of processes, got {argv[1]!r}", file=sys.stderr)
            return EXIT_BAD_INPUT
        world_size, argv = int(argv[1]), argv[2:]
    try:
        job_config = parse_args(argv)
        check_job(job_config, world_size)
        check_unlocked(job_config.job.dump_folder)
    except ConfigError as e:
        if debug_enabled():
            raise
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
