"""The shape every job entry point shares (train.py, scripts/evaluate.py): parse the options, run the
preflight, hold the dump folder, run the job under the one-line error contract, tear the process
group down."""

import os
from collections.abc import Callable

import torch.distributed as dist

from torchtitan.config_manager import JobConfig
from torchtitan.config_parser import parse_args
from torchtitan.errors import run_with_exit_codes
from torchtitan.reliability.dump_lock import DumpFolderLock
from torchtitan.reliability.preflight import check_job


def run_job(
    main: Callable[[JobConfig], int], argv: list[str] | None = None, owns_dump_folder: bool = True
) -> int:
    """`main`'s exit code for the job `argv` describes (the codes are errors.py's). A job that
    `owns_dump_folder` (it writes there) holds its lock on rank 0 from before any work to the end."""
    job_config = None

    def parse_check_and_run() -> int:
        nonlocal job_config
        job_config = parse_args(argv)
        check_job(job_config, int(os.environ.get("WORLD_SIZE", "1")))
        if not owns_dump_folder or int(os.environ.get("RANK", "0")) != 0:
            return main(job_config)
        with DumpFolderLock(job_config.job.dump_folder):
            return main(job_config)

    try:
        return run_with_exit_codes(parse_check_and_run, lambda: job_config and job_config.comm)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
