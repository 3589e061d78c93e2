"""One job per dump folder: two launches on one `job.dump_folder` would replace each other's
checkpoints and interleave their metrics.

A job's rank 0 holds `{dump_folder}/.titan.lock` (its host, pid, the pid's start time and when it took
the lock, as JSON) from before any work until it ends, and touches it every HEARTBEAT_SECONDS. Where
the file system supports it, rank 0 also holds an advisory `flock` on the file for the whole run: the
kernel drops it the instant the process dies, however it dies. A second launch reads the file and
stops with one line naming the holder. A lock left by a job that died (kill -9, a lost node) never
blocks the next launch; it is stale:
- on this host, when the holder took a flock that nobody holds now; else (a file system without
  flock) when its pid is gone, a zombie (dead, not reaped), or another process (its start time differs);
- from another host (a shared file system, where flock may be local to each host), when its heartbeat
  is older than STALE_SECONDS.
A stale lock is taken over with a warning.

Torch-free: the preflight checks the lock before any worker starts."""

import contextlib
import fcntl
import json
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass

from torchtitan.config.options import ConfigError
from torchtitan.logging import logger

LOCK_NAME = ".titan.lock"
HEARTBEAT_SECONDS = 30
STALE_SECONDS = 300  # a holder on another host whose heartbeat is older than this is taken for dead
DYING_SECONDS = 1.0  # how long a live holder is watched before a launch is refused


@dataclass
class Holder:
    host: str
    pid: int
    since: float  # time.time() when the lock was taken
    pid_started: int | None = None  # the pid's start time (clock ticks after boot); None: unknown
    flock: bool = False  # whether the holder holds a flock on the lock file

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


def proc_stat(pid: int) -> tuple[str, int] | None:
    """Process `pid`'s state letter (Z: a zombie) and start time in clock ticks after boot
    (/proc/PID/stat fields 3 and 22); None if there is no such process or /proc does not show it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()  # after the command name, which may hold spaces
    except OSError:
        return None
    return fields[0], int(fields[19])


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def pid_runs(pid: int, started: int | None = None) -> bool:
    """Whether process `pid` still runs on this host: not gone, not a zombie (dead, not reaped: forever
    where PID 1 never reaps), and, given its start time (proc_stat's), not another process that was
    given its pid. Also used for scripts/pretokenize.py's temporary folders of killed runs."""
    stat = proc_stat(pid)
    if stat is None:  # gone, or hidden (no /proc, or mounted hidepid): as far as kill(pid, 0) tells
        return _pid_exists(pid)
    state, start = stat
    return state not in ("Z", "X") and started in (None, start)


def _flock_free(path: str) -> bool | None:
    """Whether no process holds a flock on `path`; None where it cannot be told (no such file, or a
    file system without flock)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        return None
    finally:
        os.close(fd)  # drops the shared lock just taken
    return True


def _take_flock(fd: int) -> bool:
    """Hold an exclusive flock on the open lock file `fd` until it is closed or the process dies; False
    on a file system without flock (some network file systems), where the pid rule alone applies. It
    waits only while another launch's check holds a shared flock for a moment."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
        return False
    return True


def _alive(path: str, holder: Holder | None, heartbeat: float) -> bool:
    if holder is None:  # being written right now, or garbage: judged by its age alone
        return time.time() - heartbeat < HEARTBEAT_SECONDS
    if holder.host == socket.gethostname():
        free = _flock_free(path) if holder.flock else None
        return pid_runs(holder.pid, holder.pid_started) if free is None else not free
    return time.time() - heartbeat < STALE_SECONDS


def check_unlocked(dump_folder: str) -> None:
    """Raise ConfigError if a live job holds `dump_folder`. A holder killed a moment ago (a relaunch
    right after `kill -9` of the whole job) may still be exiting: it is given DYING_SECONDS to go."""
    path = os.path.join(dump_folder, LOCK_NAME)
    deadline = time.monotonic() + DYING_SECONDS
    while os.path.exists(path):
        holder, heartbeat = _read(path)
        if not _alive(path, holder, heartbeat):
            return
        if time.monotonic() < deadline:
            time.sleep(0.05)
            continue
        who = holder.describe() if holder is not None else "a job starting right now"
        raise ConfigError(
            f"job.dump_folder: {dump_folder} is in use by another job ({who}); wait for it to end, stop "
            f"it, or set job.dump_folder to another folder (a lock of a dead job is taken over by itself)"
        )


class DumpFolderLock(contextlib.AbstractContextManager):
    """Held by rank 0 for the whole job; released when the job ends (also on an error)."""

    def __init__(self, dump_folder: str) -> None:
        self.path = os.path.join(dump_folder, LOCK_NAME)
        stat = proc_stat(os.getpid())
        self.holder = Holder(socket.gethostname(), os.getpid(), time.time(), stat[1] if stat else None)
        self._fd: int | None = None  # the lock file, open (and flocked, where supported) for the whole job
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
            self._fd = fd
            self.holder.flock = _take_flock(fd)
            os.write(fd, json.dumps(asdict(self.holder)).encode())  # named only once the flock is held
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
        if self._fd is not None:
            os.close(self._fd)  # drops the flock
            self._fd = None
        if self._made_folder:
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(self.path))

    def __exit__(self, *exc_info: object) -> None:
        self.release()
