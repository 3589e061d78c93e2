"""The shape every job entry point shares (train.py, scripts/evaluate.py): stop with the launcher,
parse the options, run the preflight, hold the dump folder, run the job under the one-line error
contract (a dead data worker included), tear the process group down.

Stop signals (SIGTERM, SIGUSR1: a preemption) have one meaning in every phase of a job:
- until the job's loop takes them over (train.py's guards.StopRequest: finish the step, save, exit 75),
  a signal stops the job at once: nothing is saved yet, so it leaves with exit code 75 and one line
  saying what the next launch does (StoppedEarly). A 70B model takes minutes to build;
- once a rank's exit code is decided (it stopped, finished, or failed), they are ignored until the
  process ends. torchrun's agent sends SIGTERM to the ranks still running as soon as one rank exits
  with a code other than 0; a rank still leaving after the same stop or failure (its interpreter's
  teardown can take seconds on a busy machine, and Python resets its handlers before that) would
  otherwise die of it, and the launcher would report a kill instead of the job's code."""

import atexit
import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import NoReturn

import torch.distributed as dist

from torchtitan.checkpoint.folder import checkpoint_folder, list_checkpoints
from torchtitan.config.options import JobConfig
from torchtitan.config.parser import parse_args
from torchtitan.datasets.loader import PR_SET_PDEATHSIG, worker_failures_in_one_line
from torchtitan.errors import EXIT_PREEMPTED, run_with_exit_codes
from torchtitan.logging import init_logger, logger
from torchtitan.reliability.dump_lock import DumpFolderLock
from torchtitan.reliability.guards import STOP_SIGNALS
from torchtitan.reliability.launcher import LAUNCHER_PID_ENV
from torchtitan.reliability.preflight import check_job


class StoppedEarly(BaseException):
    """A stop signal before the job's loop handles them, raised wherever the main thread is. Not an
    Exception, so that no `except Exception` on the way takes it for an error of its own; DCP wraps it
    in a CheckpointException (stopped_early finds it there)."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name


def ignore_stop_signals() -> None:
    """From now on this process's exit code is decided: a stop signal must not change it, nor kill the
    process while it leaves. Ignored signals stay ignored through the interpreter's teardown."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def _stop_at_once(signum: int, frame: FrameType | None) -> None:
    ignore_stop_signals()  # one stop: a second signal (the agent's) must not interrupt the leaving
    raise StoppedEarly(signal.Signals(signum).name)


def stopped_early(error: BaseException) -> StoppedEarly | None:
    """The StoppedEarly that `error` is, or is caused by (DCP wraps every rank's exception in a
    CheckpointException), if any."""
    import torch.distributed.checkpoint as dcp

    seen, pending = set(), [error]
    while pending:
        e = pending.pop(0)
        if isinstance(e, StoppedEarly):
            return e
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, dcp.CheckpointException):
            pending += [failure for failure, _ in e.failures.values()]
        pending += [cause for cause in (e.__cause__, e.__context__) if cause is not None]
    return None


def stopped_early_line(signal_name: str, job_config: JobConfig | None, trains: bool) -> str:
    """What a job stopped before its loop says: a training job, what its next launch starts from (the
    checkpoint it would have loaded: checkpoint.load_step, else the newest complete one)."""
    if not trains:
        return f"Stopped by {signal_name}; nothing to save: launch the same job again"
    stopped = f"Stopped by {signal_name} before training started; nothing to save: launch the same job again"
    if job_config is None:  # still reading its options
        return stopped
    checkpoint = job_config.checkpoint
    step = None
    if checkpoint.enable_checkpoint:
        steps = list_checkpoints(checkpoint_folder(job_config))
        step = checkpoint.load_step if checkpoint.load_step != -1 else (steps[-1] if steps else None)
    if step is not None:
        return f"{stopped} to resume from checkpoint step-{step}"
    if checkpoint.initial_load_path is not None:
        return f"{stopped} to start over from checkpoint.initial_load_path"
    return f"{stopped} to start over"


def stop_with_launcher() -> None:
    """torchrun starts each worker in a session of its own, so a launcher killed outright (SIGKILL: the
    OOM killer, `kill -9`) would leave its workers training on as orphans, holding the devices and the
    dump folder. Instead the kernel sends this worker SIGTERM when its launcher dies: the preemption
    signal, so train.py finishes the step, saves and exits 75 (guards.StopRequest), and a worker still
    starting up stops at once, also with 75 (StoppedEarly). The launcher is the pid launcher.py exports
    (under plain torchrun: the parent now); if it has died already, before prctl took effect, SIGTERM
    comes at once."""
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
    `owns_dump_folder` trains there (train.py; scripts/evaluate.py only reads): it holds its lock on
    rank 0 from before any work to the end. Stop signals: the module's docstring."""
    previous = {sig: signal.signal(sig, _stop_at_once) for sig in STOP_SIGNALS}
    job_config = None

    def parse_check_and_run() -> int:
        nonlocal job_config
        try:
            stop_with_launcher()
            job_config = parse_args(argv)
            check_job(job_config, int(os.environ.get("WORLD_SIZE", "1")))
            with worker_failures_in_one_line():
                if not owns_dump_folder or int(os.environ.get("RANK", "0")) != 0:
                    return main(job_config)
                with DumpFolderLock(job_config.job.dump_folder):
                    return main(job_config)
        except BaseException as e:
            ignore_stop_signals()  # its code is decided: reporting it must not be cut short
            stop = stopped_early(e)
            if stop is not None and stop is not e:  # wrapped (DCP), or an error that followed it
                raise stop from None
            raise

    try:
        try:
            return run_with_exit_codes(parse_check_and_run, lambda: job_config and job_config.comm)
        except StoppedEarly as stop:
            if not logger.handlers:  # stopped before main() set the logger up
                init_logger(int(os.environ.get("RANK", "0")))
            logger.warning(stopped_early_line(stop.signal_name, job_config, trains=owns_dump_folder))
            if dist.is_initialized() and dist.get_world_size() > 1:
                # The other ranks are leaving too, or have left: tearing the process group down (or
                # letting the interpreter do so) could abort this process (errors.run_with_exit_codes).
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(EXIT_PREEMPTED)
            return EXIT_PREEMPTED
    finally:
        if "TORCHELASTIC_RUN_ID" in os.environ:
            ignore_stop_signals()  # for good: this worker is about to end, and must end by itself
        else:  # run in-process (tests) or started without torchrun's agent
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if dist.is_initialized():
            dist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """End the process with `code` as the interpreter would, in its order (threading's exit hooks, such
    as the thread pools' shutdown, and the join of the other threads; then the exit handlers: logging's
    flush, multiprocessing's end of the data workers), without its teardown of every module: freeing what
    torch and its dependencies loaded takes about a second per process, and the OS frees it at once. For
    a job's `__main__`, once run_job has returned."""
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
