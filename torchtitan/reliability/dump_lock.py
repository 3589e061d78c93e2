"""One job per dump folder: two launches on one `job.dump_folder` would replace each other's
checkpoints and interleave their metrics.

A job's rank 0 holds `{dump_folder}/.titan.lock` (its host, pid and start time, as JSON) from before
any work until it ends, and touches it every HEARTBEAT_SECONDS. A second launch reads it and stops
with one line naming the holder. A lock left by a job that died (kill -9, a lost node) never blocks
the next launch: it is stale when its pid is gone on this host, or, from another host (a shared file
system), when its heartbeat is older than STALE_SECONDS; a stale lock is taken over with a warning.

Torch-free: the preflight checks the lock before any worker starts."""

import contextlib
import json
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass

from torchtitan.config_manager import ConfigError
from torchtitan.logging import logger

LOCK_NAME = ".titan.lock"
HEARTBEAT_SECONDS = 30
STALE_SECONDS = 300  # a holder on another host whose heartbeat is older than this is taken for dead


@dataclass
class Holder:
    host: str
    pid: int
    since: float  # time.time() when the lock was taken

    def describe(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"host {self.host}, pid {self.pid}, since {started}"


def _read(path: str) -> tuple[Holder | None, float]:
    """The holder named in the lock file (None if unreadable) and the file's last heartbeat."""
    try:
        heartbeat = os.stat(path).st_mtime
        with open(path) as f:
            return Holder(**json.load(f)), heartbeat
    except (OSError, ValueError, TypeError):
        return None, 0.0


def _alive(holder: Holder | None, heartbeat: float) -> bool:
    if holder is None:  # being written right now, or garbage: judged by its age alone
        return time.time() - heartbeat < HEARTBEAT_SECONDS
    if holder.host == socket.gethostname():
        try:
            os.kill(holder.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's live process
            return True
        return True
    return time.time() - heartbeat < STALE_SECONDS


def check_unlocked(dump_folder: str) -> None:
    """Raise ConfigError if a live job holds `dump_folder`."""
    path = os.path.join(dump_folder, LOCK_NAME)
    if not os.path.exists(path):
        return
    holder, heartbeat = _read(path)
    if _alive(holder, heartbeat):
        who = holder.describe() if holder is not None else "a job starting right now"
        raise ConfigError(
            f"job.dump_folder: {dump_folder} is in use by another job ({who}); wait for it to end, stop "
            f"it, or set job.dump_folder to another folder (a lock of a dead job is taken over by itself)"
        )


class DumpFolderLock(contextlib.AbstractContextManager):
    """Held by rank 0 for the whole job; released when the job ends (also on an error)."""

    def __init__(self, dump_folder: str) -> None:
        self.path = os.path.join(dump_folder, LOCK_NAME)
        self.holder = Holder(socket.gethostname(), os.getpid(), time.time())
        self._stop = threading.Event()
        self._made_folder = not os.path.isdir(dump_folder)  # removed again if the job leaves it empty
        os.makedirs(dump_folder, exist_ok=True)
        self._take()
        self._heartbeat = threading.Thread(target=self._beat, name="dump-folder-lock", daemon=True)
        self._heartbeat.start()

    def _take(self) -> None:
        for _ in range(3):  # a stale lock removed, then another launch may race us to the new one
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                check_unlocked(os.path.dirname(self.path))
                self._take_over_stale()
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(asdict(self.holder), f)
            return
        check_unlocked(os.path.dirname(self.path))
        raise ConfigError(f"job.dump_folder: could not take {self.path}; another launch keeps taking it")

    def _take_over_stale(self) -> None:
        holder, _ = _read(self.path)
        stale = f"{self.path}.stale-{os.getpid()}"
        with contextlib.suppress(FileNotFoundError):  # another launch took it over first
            os.rename(self.path, stale)
            os.remove(stale)
            who = holder.describe() if holder is not None else "an unreadable holder"
            logger.warning(f"Took over {self.path}: the job that held it ({who}) is gone")

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def release(self) -> None:
        self._stop.set()
        holder, _ = _read(self.path)
        if holder == self.holder:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)
        if self._made_folder:
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(self.path))

    def __exit__(self, *exc_info: object) -> None:
        self.release()
