"""The shape every job entry point shares (train.py, scripts/evaluate.py): stop with the launcher,
parse the options, run the preflight, hold the dump folder, run the job under the one-line error
contract (a dead data worker included), tear the process group down."""

import ctypes
import os
import signal
import sys
from collections.abc import Callable

import torch.distributed as dist

from torchtitan.config.options import JobConfig
from torchtitan.config.parser import parse_args
from torchtitan.datasets.loader import PR_SET_PDEATHSIG, worker_failures_in_one_line
from torchtitan.errors import run_with_exit_codes
from torchtitan.reliability.dump_lock import DumpFolderLock
from torchtitan.reliability.launcher import LAUNCHER_PID_ENV
from torchtitan.reliability.preflight import check_job


def stop_with_launcher() -> None:
    """torchrun starts each worker in a session of its own, so a launcher killed outright (SIGKILL: the
    OOM killer, `kill -9`) would leave its workers training on as orphans, holding the devices and the
    dump folder. Instead the kernel sends this worker SIGTERM when its launcher dies: the preemption
    signal, so train.py finishes the step, saves and exits 75 (guards.StopRequest), and a worker still
    starting up ends at once. The launcher is the pid launcher.py exports (under plain torchrun: the
    parent now); if it has died already, before prctl took effect, SIGTERM comes at once."""
    if sys.platform != "linux" or "TORCHELASTIC_RUN_ID" not in os.environ:  # not a torchrun worker
        return
    launcher = int(os.environ.pop(LAUNCHER_PID_ENV, os.getppid()))  # popped: not for this worker's children
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != launcher:
        os.kill(os.getpid(), signal.SIGTERM)


def run_job(
    main: Callable[[JobConfig], int], argv: list[str] | None = None, owns_dump_folder: bool = True
) -> int:
    """`main`'s exit code for the job `argv` describes (the codes are errors.py's). A job that
    `owns_dump_folder` (it writes there) holds its lock on rank 0 from before any work to the end."""
    stop_with_launcher()
    job_config = None

    def parse_check_and_run() -> int:
        nonlocal job_config
        job_config = parse_args(argv)
        check_job(job_config, int(os.environ.get("WORLD_SIZE", "1")))
        with worker_failures_in_one_line():
            if not owns_dump_folder or int(os.environ.get("RANK", "0")) != 0:
                return main(job_config)
            with DumpFolderLock(job_config.job.dump_folder):
                return main(job_config)

    try:
        return run_with_exit_codes(parse_check_and_run, lambda: job_config and job_config.comm)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
