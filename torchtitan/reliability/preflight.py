"""Checks of a job that need no torch, so that a bad option, file or folder stops it in a fraction of a
second with one line, before any worker starts: run_llama_train.sh runs them before importing torch
(`python -m torchtitan.reliability.preflight`), and train.py runs them first thing however it is
started. The rules between options are torchtitan/config_rules.py's; the exit codes torchtitan/errors.py's."""

import importlib.util
import os
import subprocess
import sys

from torchtitan.checkpoint.folder import (
    check_hf_export_folder,
    check_initial_load_path,
    check_load_step,
    checkpoint_folder,
)
from torchtitan.config.options import ConfigError, JobConfig
from torchtitan.config.parser import parse_args
from torchtitan.config.paths import (
    check_dataset_path,
    check_file,
    check_folder,
    check_writable_folder,
    resolve_path,
    shown,
)
from torchtitan.config_rules import (
    check_float8,
    check_hf_export,
    check_layout,
    check_lr_schedule,
    check_optimizer,
    mixture_sources,
)
from torchtitan.datasets.registry import DATASETS
from torchtitan.errors import EXIT_BAD_INPUT, EXIT_OK, debug_enabled
from torchtitan.models import flavor_args
from torchtitan.reliability.dump_lock import check_unlocked


def check_job(job_config: JobConfig, world_size: int | None) -> None:
    """Raise ConfigError for what can be seen wrong without torch: missing or empty files, the rules
    between options (the parallel layout only when `world_size` is known), an unwritable dump folder,
    a checkpoint step that does not exist."""
    check_model_files(job_config)
    if (path := job_config.training.dataset_path) is not None:
        check_dataset_path("training.dataset_path", path, resolve_path(path))
    for source, _ in mixture_sources(job_config.training):
        check_mixture_source(source)
    if job_config.validation.enable and (path := job_config.validation.dataset_path) is not None:
        check_dataset_path("validation.dataset_path", path, resolve_path(path))
    flavor_args(job_config.model)
    check_lr_schedule(job_config.lr_scheduler, job_config.training.steps)
    check_optimizer(job_config.optimizer)
    check_hf_export(job_config)
    parallel_dims = check_layout(job_config, world_size) if world_size is not None else None
    if job_config.float8.enable_float8_linear:
        device_type, cuda_capability = gpu_facts()
        torchao_installed = importlib.util.find_spec("torchao") is not None
        check_float8(job_config, parallel_dims, device_type, cuda_capability, torchao_installed)
    check_writable_folder("job.dump_folder", job_config.job.dump_folder)
    _check_checkpoint(job_config)


# What shows that a machine has a GPU driver even without nvidia-smi (/dev/kfd: AMD's ROCm).
GPU_DRIVER_PATHS = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/kfd")


def gpu_facts() -> tuple[str | None, tuple[int, int] | None]:
    """(device type, lowest compute capability) of the GPUs this job would see, told without torch:
    ("cuda", (major, minor)) from nvidia-smi; ("cpu", None) when CUDA_VISIBLE_DEVICES hides every GPU or
    there is no GPU driver at all; (None, None) when it cannot be told (an old driver, a GPU machine
    without nvidia-smi), and train.py decides with torch."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and (not visible.strip() or visible.strip().startswith("-")):
        return "cpu", None
    command = ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"]
    if visible is not None:
        command += ["-i", visible.strip()]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        return (None, None) if any(os.path.exists(path) for path in GPU_DRIVER_PATHS) else ("cpu", None)
    except (OSError, subprocess.SubprocessError):
        return None, None
    capabilities = []
    for line in result.stdout.split():
        major, _, minor = line.partition(".")
        if not (major.isdigit() and minor.isdigit()):
            return None, None
        capabilities.append((int(major), int(minor)))
    if result.returncode != 0 or not capabilities:
        return None, None
    return "cuda", min(capabilities)


def check_mixture_source(source: str) -> None:
    """A mixture source is a registered dataset name or an existing file or folder."""
    if source in DATASETS:
        return
    resolved = resolve_path(source)
    if not os.path.lexists(resolved):
        raise ConfigError(
            f"training.mixture: unknown source {shown(source)}: not a dataset name "
            f"({', '.join(sorted(DATASETS))}) nor an existing file or folder; fix the name or the path"
        )
    check_dataset_path("training.mixture", source, resolved)


def check_model_files(job_config: JobConfig) -> None:
    """The files a job's model is built from (the tokenizer, the checkpoint a new run starts from),
    which the scripts that only read a run check too."""
    tokenizer_path = job_config.model.tokenizer_path
    resolved = resolve_path(tokenizer_path)
    if os.path.isdir(resolved):  # a Hugging Face tokenizer folder (hf_tokenizer.py; torch-free here)
        inner = os.path.join(tokenizer_path, "tokenizer.json")
        if not os.path.lexists(os.path.join(resolved, "tokenizer.json")):
            raise ConfigError(
                f"model.tokenizer_path: {shown(tokenizer_path)} is a folder, not a file, and holds no "
                "tokenizer.json; set it to a tiktoken BPE file, a Hugging Face tokenizer.json or a folder "
                "holding one"
            )
        check_file("model.tokenizer_path", inner, os.path.join(resolved, "tokenizer.json"), text=True)
    else:
        check_file("model.tokenizer_path", tokenizer_path, resolved, text=True)
    if (path := job_config.checkpoint.initial_load_path) is not None:
        fix = "point it at a step-N checkpoint or a Hugging Face model folder"
        check_folder("checkpoint.initial_load_path", path, fix=fix)
        check_initial_load_path(job_config.checkpoint)


def _check_checkpoint(job_config: JobConfig) -> None:
    folder = checkpoint_folder(job_config)
    if os.path.lexists(folder):
        check_folder("checkpoint.folder", folder, fix="move it or set checkpoint.folder")
    if job_config.checkpoint.enable_checkpoint:
        check_load_step(job_config.checkpoint, folder)
    check_hf_export_folder(job_config)


def main(argv: list[str]) -> int:
    """`python -m torchtitan.reliability.preflight [--nproc WORLD_SIZE] [train.py options]`: exit code 0,
    or 2 and one line on stderr. Without --nproc the parallel degrees are left to train.py to check."""
    if any(arg in ("-h", "--help") for arg in argv):
        return EXIT_OK  # train.py prints the help
    world_size = None
    if argv[:1] == ["--nproc"] and len(argv) > 1:
        if not (argv[1].isascii() and argv[1].isdigit()) or int(argv[1]) < 1:
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
