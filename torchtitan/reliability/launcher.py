"""torchrun for this trainer, as run_llama_train.sh uses it (after the preflight):

    python -m torchtitan.reliability.launcher [torchrun options] train.py [train.py options]

It differs from plain torchrun in four ways:
- SIGTERM and SIGUSR1 are passed on to the workers, and the launcher keeps waiting for them while
  they finish the step, save and exit with code 75 (torchrun would give them --shutdown-timeout,
  then kill them and report a failure); before any worker has started, the launcher itself exits 75
  (nothing to save, a stop all the same); once all have ended, the signal changes nothing;
- it tells the workers its pid (LAUNCHER_PID_ENV), so that each one, however late it gets there, can
  have the kernel send it SIGTERM when the launcher dies, even of SIGKILL (entry.stop_with_launcher);
- it exits with the code of the first rank that failed (torchrun exits 1) and says so in one line
  instead of torchrun's ChildFailedError traceback; TITAN_DEBUG=1 shows that traceback again. A rank
  that failed with exit code 4 (a collective lost or waited for another rank) is reported only when
  no rank failed otherwise: the other one is the cause. When LOG_RANK (--local-ranks-filter) hides
  the reported rank's output, its one-line reason (from its error file, errors.record_for_launcher)
  is shown as that rank would have shown it;
- the job's code is never one that torchrun's agent caused itself. Once a rank has exited with a code
  other than 0, the agent sends the ranks still running SIGTERM (SIGKILL 30 s later): a rank that was
  still leaving after the same stop or failure (a busy machine can take seconds between a rank's last
  line and its end) would be reported as killed (143), a preempted job as a failed one. The launcher
  watches which ranks its agent signalled (_AgentWatch); their ends (killed, or 75: stopped by that
  signal) are never the cause while another rank's code is known. The workers, for their part, ignore
  the stop signals once their code is decided (entry.run_job), so they are not killed while leaving.
  A rank killed by a stop signal the launcher passed on to it (in its first seconds, before it could
  handle one) was preempted: 75.
"""

import contextlib
import glob
import logging
import os
import re
import signal
import sys
from types import FrameType
from typing import TYPE_CHECKING, Any

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


class _AgentWatch:
    """What torchrun's agent, in this process, did to the workers, seen through its SubprocessHandler
    (one per worker process, which starts it and sends it the agent's closing signals): whether any
    worker was started, and the pids the agent signalled to stop. Also the stop signals this
    launcher passed on, by pid."""

    def __init__(self) -> None:
        self.started = False
        self.closed: set[int] = set()
        self.forwarded: dict[int, int] = {}

    def install(self) -> None:
        """Wrap SubprocessHandler's __init__ and close. Were they gone (another torch), the launcher
        would still run, reporting as torchrun's timestamps say (tests/test_reliability.py fails)."""
        from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

        start, close = SubprocessHandler.__init__, getattr(SubprocessHandler, "close", None)
        if close is None:
            return
        watch = self

        def watched_start(self: SubprocessHandler, *args: Any, **kwargs: Any) -> None:
            start(self, *args, **kwargs)
            watch.started = True

        def watched_close(self: SubprocessHandler, *args: Any, **kwargs: Any) -> None:
            # torchrun closes a worker still running only; its first call is its SIGTERM.
            pid = getattr(getattr(self, "proc", None), "pid", None)
            if pid is not None:
                watch.closed.add(pid)
            close(self, *args, **kwargs)

        SubprocessHandler.__init__ = watched_start
        SubprocessHandler.close = watched_close

    def closed_it(self, failure: "ProcessFailure") -> bool:
        """Whether this failure is the agent's doing: a rank it signalled to stop, which then died of a
        signal or stopped (75). Any other code is the rank's own."""
        return failure.pid in self.closed and (failure.exitcode < 0 or failure.exitcode == EXIT_PREEMPTED)

    def stopped_it(self, pid: int, exitcode: int) -> bool:
        """Whether the rank `pid` ended by a signal from this launcher: its agent's, or a stop signal
        passed on to it."""
        return (pid in self.closed and exitcode < 0) or self.forwarded.get(pid) == -exitcode


_watch = _AgentWatch()


def _children() -> list[int]:
    pids = []
    for path in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        with open(path) as f:
            pids += [int(pid) for pid in f.read().split()]
    return pids


def _forward_signal(signum: int, frame: FrameType | None) -> None:
    """Pass the signal on to the workers. Before any has started there is nothing to save, but the job
    is preempted all the same: exit 75. Once all have ended, their codes are the job's: ignore it."""
    name = signal.Signals(signum).name
    workers = _children()
    if not workers and not _watch.started:
        print(
            f"launcher: stopped by {name} before the workers started; nothing to save: launch the same "
            "job again",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(EXIT_PREEMPTED)
    if not workers:
        return
    print(f"launcher: passing {name} on to the workers", file=sys.stderr, flush=True)
    for pid in workers:
        with contextlib.suppress(ProcessLookupError):  # it has just exited
            os.kill(pid, signum)
            _watch.forwarded[pid] = signum


_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\).*\(pid: (\d+)\)")


def _unexplained(record: logging.LogRecord) -> bool:
    """torchrun logs "failed (exitcode: N)" also for the codes whose rank has said why, and for a rank
    that the launcher reports as stopped (killed by the agent's or by a passed-on stop signal)."""
    message = record.getMessage()
    if any(f"(exitcode: {code})" in message for code in EXPLAINED):
        return False
    failed = _FAILED.search(message)
    return failed is None or not _watch.stopped_it(int(failed[2]), int(failed[1]))


def _cause(failures: dict[int, "ProcessFailure"], watch: _AgentWatch) -> tuple[int, "ProcessFailure"]:
    """The failed rank to report: the first to fail, preferring any other exit code to 4, which only
    says that a collective lost (or waited for) another rank, and any rank's own end to one the agent
    caused (watch.closed_it). torchrun's timestamps are whole seconds, so the rank left waiting, or
    stopped by the agent, often ties with the one that failed."""

    def order(rank: int) -> tuple[int, int, int]:
        failure = failures[rank]
        consequence = 2 if watch.closed_it(failure) else int(failure.exitcode == EXIT_COMM_FAILURE)
        return consequence, failure.timestamp, rank

    rank = min(failures, key=order)
    return rank, failures[rank]


def _shown(local_rank: int, local_ranks_filter: str) -> bool:
    """Whether torchrun shows this local rank's output (--local-ranks-filter; empty: every rank)."""
    return not local_ranks_filter or local_rank in {int(r) for r in local_ranks_filter.split(",")}


def _unseen(cause: "ProcessFailure", failures: dict[int, "ProcessFailure"], local_ranks_filter: str) -> bool:
    """Whether the cause's one line is missing from the output: its rank's output is hidden, and no
    shown rank printed the same line (bad input every rank sees alike, a second sooner on one of them)."""
    return cause.message.startswith("error:") and not any(
        _shown(f.local_rank, local_ranks_filter) and f.message == cause.message for f in failures.values()
    )


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args as parse_torchrun_args
    from torch.distributed.run import run

    # torchrun keeps SIGINT and the like; the stop signals are ours to forward.
    args = parse_torchrun_args(["--signals-to-handle=SIGINT,SIGHUP,SIGQUIT", *argv])
    _watch.install()
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
        rank, failure = _cause(e.failures, _watch)
        code = failure.exitcode
        if code < 0 and _watch.forwarded.get(failure.pid) == -code:
            print(
                f"launcher: rank {rank} was stopped by {signal.Signals(-code).name} as it started, before "
                "it could handle it; nothing to save: launch the same job again",
                file=sys.stderr,
            )
            return EXIT_PREEMPTED
        if code < 0:
            print(f"error: rank {rank} was killed by {signal.Signals(-code).name}", file=sys.stderr)
            return 128 - code
        if code not in EXPLAINED:
            print(
                f"error: rank {rank} failed with exit code {code}; its output above says why", file=sys.stderr
            )
        elif _unseen(failure, e.failures, args.local_ranks_filter):
            print(f"[rank{rank}]: {failure.message}", file=sys.stderr)  # as torchrun would have shown it
        return code
    except SignalException as e:
        print(f"launcher: stopped by {e.sigval.name}", file=sys.stderr)
        return 128 + e.sigval
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
