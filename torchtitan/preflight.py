"""Checks of a job that need no torch, so that a bad option, file or folder stops it in a fraction of a
second with one line, before any worker starts: run_llama_train.sh runs them before importing torch
(`python -m torchtitan.preflight`), and train.py runs them first thing however it is started.

Also the exit codes every entry point shares, and the debug switch:

    0   training completed
    1   an unexpected error (its traceback is printed)
    2   bad input: one line naming the option or file and the fix
    3   a non-finite loss or gradient norm, with training.skip_nonfinite_steps off
    4   a collective failed or timed out: another rank died or hung
    75  preempted by SIGTERM or SIGUSR1: stopped after a step and saved a checkpoint (if enabled);
        launch the same job again to resume (75 is EX_TEMPFAIL, "try again later")

TITAN_DEBUG=1 turns the one-line errors of codes 2 to 4 back into tracebacks.
"""

import os
import sys
import tempfile

from torchtitan.config_manager import ConfigError, JobConfig, parse_args, resolve_path
from torchtitan.parallelisms.parallel_dims import ParallelDims

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_BAD_INPUT = 2
EXIT_NONFINITE = 3
EXIT_COMM_FAILURE = 4
EXIT_PREEMPTED = 75


def debug_enabled() -> bool:
    """TITAN_DEBUG=1 (or any value but 0): tracebacks instead of one-line errors."""
    return os.environ.get("TITAN_DEBUG", "") not in ("", "0")


def check_job(cfg: JobConfig, world_size: int | None) -> None:
    """Raise ConfigError for what can be seen wrong without torch: missing or empty files, parallel
    degrees that do not fit `world_size` (skipped when None), an unwritable dump folder, a checkpoint
    step that does not exist."""
    _check_file("model.tokenizer_path", cfg.model.tokenizer_path)
    if cfg.training.dataset_path is not None:
        _check_dataset_path(cfg.training.dataset_path)
    if world_size is not None:
        ParallelDims(
            dp_shard=cfg.parallelism.data_parallel_shard_degree,
            world_size=world_size,
            dp_replicate=cfg.parallelism.data_parallel_replicate_degree,
            tp=cfg.parallelism.tensor_parallel_degree,
            pp=cfg.parallelism.pipeline_parallel_degree,
        )
    _check_writable_folder("job.dump_folder", cfg.job.dump_folder)
    _check_checkpoint(cfg)


def _check_file(option: str, path: str) -> None:
    resolved = resolve_path(path)
    if not os.path.isfile(resolved):
        what = "is a folder" if os.path.isdir(resolved) else "does not exist"
        raise ConfigError(f"{option}: {path} {what}; set {option} to an existing file")
    if os.path.getsize(resolved) == 0:
        raise ConfigError(f"{option}: {path} is empty; set {option} to a complete file")


def _check_dataset_path(path: str) -> None:
    resolved = resolve_path(path)
    if not os.path.exists(resolved):
        raise ConfigError(
            f"training.dataset_path: {path} does not exist (relative paths are tried from the current "
            "folder, then from the repository); set it to a .txt/.json/.jsonl/.parquet file or a folder"
        )
    if os.path.isfile(resolved) and os.path.getsize(resolved) == 0:
        raise ConfigError(f"training.dataset_path: {path} is empty; point it at a file with text in it")
    if os.path.isdir(resolved) and not any(files for _, _, files in os.walk(resolved)):
        raise ConfigError(f"training.dataset_path: the folder {path} holds no files; point it at your data")


def _check_writable_folder(option: str, folder: str) -> None:
    """The folder, or the nearest existing folder above it, must take a new file (tried for real:
    permission bits do not tell for root or on a read-only mount)."""
    existing = os.path.abspath(folder)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(f"{option}: {existing} is a file, not a folder; set {option} to a folder")
    try:
        with tempfile.TemporaryDirectory(prefix=".titan-write-test-", dir=existing):
            pass
    except OSError as e:
        raise ConfigError(
            f"{option}: cannot write in {existing} ({e.strerror}); set {option} to a writable folder"
        ) from None


def _check_checkpoint(cfg: JobConfig) -> None:
    ckpt = cfg.checkpoint
    folder = os.path.join(cfg.job.dump_folder, ckpt.folder)
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ConfigError(
            f"checkpoint.folder: {folder} is a file, not a folder; move it or set checkpoint.folder"
        )
    complete = [
        int(name[5:])
        for name in (os.listdir(folder) if os.path.isdir(folder) else [])
        if name.startswith("step-")
        and name[5:].isdigit()
        and os.path.isfile(os.path.join(folder, name, ".metadata"))
    ]
    if ckpt.enable_checkpoint and ckpt.load_step != -1 and ckpt.load_step not in complete:
        raise ConfigError(
            f"checkpoint.load_step: there is no complete checkpoint step-{ckpt.load_step} in {folder}; "
            f"available steps: {', '.join(map(str, sorted(complete))) or 'none'}"
        )
    if ckpt.initial_load_path is not None and not os.path.isfile(
        os.path.join(ckpt.initial_load_path, ".metadata")
    ):
        raise ConfigError(
            f"checkpoint.initial_load_path: {ckpt.initial_load_path} is not a DCP checkpoint folder "
            "(no .metadata); point it at a step-N folder"
        )


def main(argv: list[str]) -> int:
    """`python -m torchtitan.preflight [--nproc WORLD_SIZE] [train.py options]`: exit code 0, or 2 and
    one line on stderr. Without --nproc the parallel degrees are left to train.py to check."""
    if any(arg in ("-h", "--help") for arg in argv):
        return EXIT_OK  # train.py prints the help
    world_size = None
    if argv[:1] == ["--nproc"] and len(argv) > 1:
        if not argv[1].isdigit() or int(argv[1]) < 1:
            print(f"error: NGPU: expected a number of processes, got {argv[1]!r}", file=sys.stderr)
            return EXIT_BAD_INPUT
        world_size, argv = int(argv[1]), argv[2:]
    try:
        check_job(parse_args(argv), world_size)
    except ConfigError as e:
        if debug_enabled():
            raise
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
