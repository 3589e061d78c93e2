"""torchrun for this trainer, as run_llama_train.sh uses it (after the preflight):

    python -m torchtitan.reliability.launcher [torchrun options] train.py [train.py options]

It differs from plain torchrun in three ways:
- SIGTERM and SIGUSR1 are passed on to the workers, and the launcher keeps waiting for them while
  they finish the step, save and exit with code 75 (torchrun would give them --shutdown-timeout,
  then kill them and report a failure);
- it tells the workers its pid (LAUNCHER_PID_ENV), so that each one, however late it gets there, can
  have the kernel send it SIGTERM when the launcher dies, even of SIGKILL (entry.stop_with_launcher);
- it exits with the code of the first rank that failed (torchrun exits 1) and says so in one line
  instead of torchrun's ChildFailedError traceback; TITAN_DEBUG=1 shows that traceback again.
"""

import contextlib
import glob
import logging
import os
import signal
import sys
from types import FrameType

from torchtitan.errors import (
    EXIT_BAD_INPUT,
    EXIT_CHECKPOINT_WRITE,
    EXIT_COMM_FAILURE,
    EXIT_NONFINITE,
    EXIT_PREEMPTED,
    debug_enabled,
)

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
LAUNCHER_PID_ENV = "TITAN_LAUNCHER_PID"
# Exit codes whose rank has printed its reason in one line already.
EXPLAINED = {EXIT_BAD_INPUT, EXIT_NONFINITE, EXIT_COMM_FAILURE, EXIT_CHECKPOINT_WRITE, EXIT_PREEMPTED}


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
        rank, failure = e.get_first_failure()
        code = failure.exitcode
        if code < 0:
            print(f"error: rank {rank} was killed by {signal.Signals(-code).name}", file=sys.stderr)
            return 128 - code
        if code not in EXPLAINED:
            print(
                f"error: rank {rank} failed with exit code {code}; its output above says why", file=sys.stderr
            )
        return code
    except SignalException as e:
        print(f"launcher: stopped by {e.sigval.name}", file=sys.stderr)
        return 128 + e.sigval
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
