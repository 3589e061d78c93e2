"""The exit codes every entry point shares (train.py, the launcher, the preflight, the scripts) and the
one-line error contract: a failure the user can act on is one line on stderr and a code below, never
a traceback; TITAN_DEBUG=1 (any value but 0) shows the traceback instead. Under torchrun that line is
also written to the rank's error file (TORCHELASTIC_ERROR_FILE), where the launcher reads it to show the
reason of a failed rank whose output LOG_RANK hides.

    0   training completed
    1   an unexpected error (its traceback is printed)
    2   bad input: one line naming the option or file and the fix
    3   a non-finite loss or gradient norm, with training.skip_nonfinite_steps off
    4   a collective failed or timed out: another rank died or hung
    5   a checkpoint could not be written (a full disk, a file-size limit, an I/O or permission error):
        its temporary folder is removed, the earlier checkpoints are intact; launch again to resume
    6   the data loader failed: a data loading worker died, or made no batch within
        training.data_timeout_seconds; launch again to resume from the last checkpoint
    75  preempted by SIGTERM or SIGUSR1, or the launcher died: stopped after a step and saved a checkpoint
        (if enabled), or stopped before training started, with nothing to save; launch the same job again
        to resume (75 is EX_TEMPFAIL, "try again later")

Importing this module does not import torch (the preflight and the launcher use it)."""

import contextlib
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator

from torchtitan.config.options import CommConfig, ConfigError

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_BAD_INPUT = 2
EXIT_NONFINITE = 3
EXIT_COMM_FAILURE = 4
EXIT_CHECKPOINT_WRITE = 5
EXIT_DATA = 6
EXIT_PREEMPTED = 75


def debug_enabled() -> bool:
    """TITAN_DEBUG=1 (or any value but 0): tracebacks instead of one-line errors."""
    return os.environ.get("TITAN_DEBUG", "") not in ("", "0")


class NonFiniteError(RuntimeError):
    """A step produced a NaN or Inf loss or gradient norm (exit code 3)."""


class CheckpointWriteError(RuntimeError):
    """Writing a checkpoint failed for an OS error, named in the message (exit code 5)."""


class DataLoaderError(RuntimeError):
    """A data loading worker died or stalled, named in the message (exit code 6)."""


def os_error_behind(error: BaseException) -> OSError | None:
    """The OSError behind a failed checkpoint save, if any: DCP wraps each rank's error in a
    CheckpointException, and torch.save turns a failed write into a RuntimeError whose context is the
    OSError. A lost connection to another rank is no write error."""
    seen, pending = set(), [error]
    while pending:
        e = pending.pop(0)
        if isinstance(e, OSError) and not isinstance(e, (ConnectionError, TimeoutError)):
            return e
        if id(e) in seen:
            continue
        seen.add(id(e))
        if "torch" in sys.modules:
            import torch.distributed.checkpoint as dcp

            if isinstance(e, dcp.CheckpointException):
                pending += [failure for failure, _ in e.failures.values()]
        pending += [cause for cause in (e.__cause__, e.__context__) if cause is not None]
    return None


@contextlib.contextmanager
def bad_input(option: str) -> Iterator[None]:
    """Turn an error reading a user's file (missing, malformed, empty) into a ConfigError naming the
    option, so that it is reported in one line. Such errors are ValueErrors or OSErrors, or are
    caused by one (a `datasets` DatasetGenerationError wraps pyarrow's ArrowInvalid, a ValueError)."""
    try:
        yield
    except ConfigError:
        raise
    except Exception as e:
        cause: BaseException | None = e
        while cause is not None and not isinstance(cause, (ValueError, OSError)):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
        detail = str(e) if cause is e else f"{e}: {cause}"
        raise ConfigError(f"{option}: {' '.join(detail.split())}") from e


# The torchao that scripts/install.sh installs on GPU machines (requirements-gpu.txt, pyproject's
# `float8` extra): the newest on PyPI when this was written, whose own check asks for torch >= 2.11.
TORCHAO_REQUIREMENT = "torchao==0.18.0"


def torchao_missing(reason: str = "torchao is not installed") -> str:
    """The one-line error for a missing (or unimportable) torchao."""
    return (
        f"float8.enable_float8_linear: needs torchao, and {reason}; install it with "
        f"`pip install {TORCHAO_REQUIREMENT}` (scripts/install.sh does on a GPU machine) or set it to false"
    )


_TIMED_OUT_MS = re.compile(r"Timed out waiting (\d+)ms")
_PEER_LOST = re.compile(r"Connection (reset|closed) by peer|Broken pipe|Connection refused", re.IGNORECASE)


def comm_failure_message(error: BaseException, rank: int, comm_config: CommConfig) -> str | None:
    """One line for a collective that timed out or lost its peer, or None for any other error.

    Gloo raises these in the waiting rank (its collectives honour the process group's timeout); NCCL's
    watchdog instead aborts the process once the timeout has passed, with its own message naming the
    collective. A failure inside a checkpoint save or load comes wrapped in DCP's CheckpointException."""
    if "torch" not in sys.modules:  # nothing can have failed in a collective
        return None
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    if not isinstance(error, (RuntimeError, dcp.CheckpointException)):
        return None
    text = str(error)
    if isinstance(error, dist.DistStoreError) or ("Timed out" in text and "clients" in text):
        return (
            f"rank {rank}: timed out after comm.init_timeout_seconds = {comm_config.init_timeout_seconds} s "
            "waiting for the other ranks to join; a rank may have failed to start: check its output"
        )
    if match := _TIMED_OUT_MS.search(text):
        seconds = int(match.group(1)) / 1000
        init = seconds == comm_config.init_timeout_seconds
        option = "comm.init_timeout_seconds" if init else "comm.train_timeout_seconds"
        return (
            f"rank {rank}: a collective timed out after {seconds:g} s waiting for other ranks ({option}); "
            "a rank may have died or hung"
        )
    if match := _PEER_LOST.search(text):
        return (
            f"rank {rank}: a collective lost its connection to another rank ({match.group(0)}); "
            "a rank may have died: check its output"
        )
    return None


def one_line_error(error: BaseException, rank: int, comm_config: CommConfig | None) -> tuple[int, str] | None:
    """(exit code, message) for the failures reported in one line; None for unexpected ones."""
    if isinstance(error, (ConfigError, FileNotFoundError)):
        return EXIT_BAD_INPUT, str(error)
    if isinstance(error, NonFiniteError):
        return EXIT_NONFINITE, str(error)
    if isinstance(error, CheckpointWriteError):
        return EXIT_CHECKPOINT_WRITE, str(error)
    if isinstance(error, DataLoaderError):
        return EXIT_DATA, f"rank {rank}: {error}"
    message = comm_failure_message(error, rank, comm_config) if comm_config is not None else None
    return (EXIT_COMM_FAILURE, message) if message else None


def record_for_launcher(line: str) -> None:
    """Write a failed rank's one line to its torchrun error file, in the format torchelastic reads into
    the failure's message (ProcessFailure), so that the launcher can show it when LOG_RANK hides this
    rank's output. Outside torchrun there is no such file."""
    if path := os.environ.get("TORCHELASTIC_ERROR_FILE"):
        with contextlib.suppress(OSError), open(path, "w") as f:
            json.dump({"message": line, "timestamp": int(time.time())}, f)


def run_with_exit_codes(
    main: Callable[[], int], comm_config: Callable[[], CommConfig | None] | None = None
) -> int:
    """Run an entry point under the contract: its return value, or the code of a known failure after
    its one line on stderr; unexpected errors (and any error with TITAN_DEBUG=1) propagate.
    `comm_config` gives the job's comm section once parsed (None before), to name the timeout; the
    scripts that start no process group leave it out."""
    try:
        return main()
    except BaseException as e:  # DCP's CheckpointException is one; the others are re-raised
        comm = comm_config() if comm_config is not None else None
        known = one_line_error(e, int(os.environ.get("RANK", "0")), comm)
        if known is None or debug_enabled():
            raise
        code, message = known
        print(f"error: {message}", file=sys.stderr)
        record_for_launcher(f"error: {message}")
        if code in (EXIT_COMM_FAILURE, EXIT_DATA):
            # A process group that lost a peer cannot be torn down: destroying it (or letting the
            # interpreter do so at exit) can abort the process and replace this exit code by SIGABRT.
            # A stalled data worker cannot be joined: multiprocessing's exit handler would wait for it
            # forever; the workers die with this process (loader.py, PR_SET_PDEATHSIG).
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        return code
