"""torchrun for this trainer, as run_llama_train.sh uses it (after the preflight):

    python -m torchtitan.reliability.launcher [torchrun options] train.py [train.py options]

It differs from plain torchrun in three ways:
- SIGTERM and SIGUSR1 are passed on to the workers, and the launcher keeps waiting for them while
  they finish the step, save and exit with code 75 (torchrun would give them --shutdown-timeout,
  then kill them and report a failure);
- it tells the workers its pid (LAUNCHER_PID_ENV), so that each one, however late it gets there, can
  have the kernel send it SIGTERM when the launcher dies, even of SIGKILL (entry.stop_with_launcher);
- it exits with the code of the first rank that failed (torchrun exits 1) and says so in one line
  instead of torchrun's ChildFailedError traceback; TITAN_DEBUG=1 shows that traceback again. A rank
  that failed with exit code 4 (a collective lost or waited for another rank) is reported only when
  no rank failed otherwise: the other one is the cause. When LOG_RANK (--local-ranks-filter) hides
  the reported rank's output, its one-line reason (from its error file, errors.record_for_launcher)
  is shown as that rank would have shown it.
"""

import contextlib
import glob
import logging
import os
import signal
import sys
from types import FrameType
from typing import TYPE_CHECKING

from torchtitan.errors import (
    EXIT_BAD_INPUT,
    EXIT_CHECKPOINT_WRITE,
    EXIT_COMM_FAILURE,
    EXIT_DATA,
    EXIT_NONFINITE,
    EXIT_PREEMPTED,
    debug_enabled,
)

if TYPE_CHECKING:  # torch is imported when the launcher runs, not when it is imported
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
LAUNCHER_PID_ENV = "TITAN_LAUNCHER_PID"
# Exit codes whose rank has printed its reason in one line already.
EXPLAINED = {
    EXIT_BAD_INPUT,
    EXIT_NONFINITE,
    EXIT_COMM_FAILURE,
    EXIT_CHECKPOINT_WRITE,
    EXIT_DATA,
    EXIT_PREEMPTED,
}


def _children() -> list[int]:
    pids = []
    for path in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        with open(path) as f:
            pids += [int(pid) for pid in f.read().split()]
    return pids


def _forward_signal(signum: int, frame: FrameType | None) -> None:
    """Pass the signal on to the workers; without workers yet, there is nothing to save: exit."""
    workers = _children()
    if not workers:
        raise SystemExit(128 + signum)
    print(f"launcher: passing {signal.Signals(signum).name} on to the workers", file=sys.stderr, flush=True)
    for pid in workers:
        with contextlib.suppress(ProcessLookupError):  # it has just exited
            os.kill(pid, signum)


def _unexplained(record: logging.LogRecord) -> bool:
    """torchrun logs "failed (exitcode: N)" also for the codes whose rank has said why."""
    return not any(f"(exitcode: {code})" in record.getMessage() for code in EXPLAINED)


def _cause(failures: dict[int, "ProcessFailure"]) -> tuple[int, "ProcessFailure"]:
    """The failed rank to report: the first to fail, preferring any other exit code to 4, which only
    says that a collective lost (or waited for) another rank. torchrun's timestamps are whole seconds,
    so the rank left waiting often ties with the one that failed."""
    rank = min(failures, key=lambda r: (failures[r].exitcode == EXIT_COMM_FAILURE, failures[r].timestamp, r))
    return rank, failures[rank]


def _shown(local_rank: int, local_ranks_filter: str) -> bool:
    """Whether torchrun shows this local rank's output (--local-ranks-filter; empty: every rank)."""
    return not local_ranks_filter or local_rank in {int(r) for r in local_ranks_filter.split(",")}


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args as parse_torchrun_args
    from torch.distributed.run import run

    # torchrun keeps SIGINT and the like; the stop signals are ours to forward.
    args = parse_torchrun_args(["--signals-to-handle=SIGINT,SIGHUP,SIGQUIT", *argv])
    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, _forward_signal)
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    if not debug_enabled():
        logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_unexplained)
    try:
        run(args)
    except ChildFailedError as e:
        if debug_enabled():
            raise
        rank, failure = _cause(e.failures)
        code = failure.exitcode
        if code < 0:
            print(f"error: rank {rank} was killed by {signal.Signals(-code).name}", file=sys.stderr)
            return 128 - code
        if code not in EXPLAINED:
            print(
                f"error: rank {rank} failed with exit code {code}; its output above says why", file=sys.stderr
            )
        elif not _shown(failure.local_rank, args.local_ranks_filter) and failure.message.startswith("error:"):
            print(f"[rank{rank}]: {failure.message}", file=sys.stderr)  # as torchrun would have shown it
        return code
    except SignalException as e:
        print(f"launcher: stopped by {e.sigval.name}", file=sys.stderr)
        return 128 + e.sigval
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
