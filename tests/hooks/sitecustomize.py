"""Test-only behaviour of the trainers in a job a test launches (tests/test_reliability.py): with this
folder on PYTHONPATH, Python imports this module as each process starts. It acts in torchrun's workers
running train.py only, and only with TITAN_TEST_HOOK set; its files go to TITAN_TEST_HOOK_DIR.

TITAN_TEST_HOOK=linger: rank 0 is slow to end, as a busy machine makes a rank (seconds between its
last line and its end), deterministically. In its last exit handler (registered first, it runs after
the others; train.py's exit_process ends the process right after them), it writes `lingering-rank-0`,
then waits until the launcher has reaped every other worker (so that torchrun's agent, seeing another
rank's exit code, has sent it its closing SIGTERM), one second more, and writes `left-rank-0`: a rank
that never writes it was killed while leaving. The other ranks wait, in theirs, until rank 0 lingers,
so that they end after it.

TITAN_TEST_HOOK=slow_start: each rank, about to build its tokenizer (start-up, after the process group
is up), writes `starting-rank-R` and waits up to 120 s, as while it builds a large model."""

import atexit
import os
import sys
import time

_HOOK = os.environ.get("TITAN_TEST_HOOK") if "TORCHELASTIC_RUN_ID" in os.environ else None
if not sys.argv[0].endswith("train.py"):
    _HOOK = None
_DIR = os.environ.get("TITAN_TEST_HOOK_DIR", ".")
_RANK = os.environ.get("RANK", "0")


def _touch(name: str) -> None:
    with open(os.path.join(_DIR, name), "w"):
        pass


class _Linger:
    """Its `linger` is the process's last exit handler. Should the interpreter's teardown follow (a
    process ended by sys.exit), the modules' globals may be going: it uses what it kept, C functions
    only."""

    def __init__(self) -> None:
        self.pid, self.rank, self.dir = os.getpid(), _RANK, _DIR
        self.open = open
        self.getpid, self.getppid, self.listdir, self.stat = os.getpid, os.getppid, os.listdir, os.stat
        self.sleep, self.monotonic = time.sleep, time.monotonic

    def _exists(self, name: str) -> bool:
        try:
            self.stat(f"{self.dir}/{name}")
            return True
        except FileNotFoundError:
            return False

    def _touch(self, name: str) -> None:
        self.open(f"{self.dir}/{name}", "w").close()

    def _children(self, pid: int) -> set[int]:
        """Child pids of `pid`, zombies included (until reaped)."""
        found = set()
        for task in self.listdir(f"/proc/{pid}/task"):
            try:
                with self.open(f"/proc/{pid}/task/{task}/children") as f:
                    found |= {int(child) for child in f.read().split()}
            except FileNotFoundError:
                pass
        return found

    def linger(self) -> None:
        if self.getpid() != self.pid:  # a forked data loading worker
            return
        deadline = self.monotonic() + 60
        if self.rank != "0":
            while not self._exists("lingering-rank-0") and self.monotonic() < deadline:
                self.sleep(0.01)
            return
        self._touch("lingering-rank-0")
        launcher, me = self.getppid(), self.getpid()
        while self._children(launcher) - {me} and self.monotonic() < deadline:
            self.sleep(0.01)
        self.sleep(1)
        self._touch("left-rank-0")


def _slow_start() -> None:
    import torchtitan.datasets.tokenizer as tokenizer

    build_tokenizer = tokenizer.build_tokenizer

    def slow_build_tokenizer(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        _touch(f"starting-rank-{_RANK}")
        time.sleep(120)
        return build_tokenizer(*args, **kwargs)

    tokenizer.build_tokenizer = slow_build_tokenizer  # train.py imports it by name, after this


if _HOOK == "linger":
    atexit.register(_Linger().linger)
elif _HOOK == "slow_start":
    _slow_start()
