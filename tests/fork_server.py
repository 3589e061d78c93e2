"""tests/launch.py's fork server: a process that has imported torch and torchrun and runs each command
it reads (`python -m module args`, `python script args`, or a function as mp.spawn runs it) in a
child forked from it: a process of its own, with the command's environment, folder, output files and
no stdin, as a new interpreter would be, without the seconds each spends importing torch. The server
only imports: no Python thread runs, and no op has started torch's thread pools, when it forks. A
command still running at its timeout is killed with its process group.

scripts/chaos.py's ranks are started too (kind "start"), as subprocess.Popen would start them, when
their environment is the server's but for the variables a rank is given (RANK, MASTER_PORT...): the
server answers with the pid at once, and with the exit codes when polled ("poll").

torchrun's workers (under torchrun or torchtitan.reliability.launcher, which runs torchrun's agent
in its process) are forked too, by the agent before it starts a thread (WorkerShells), when the
command's environment is the server's own (what a module read from it at import is then what a new
interpreter would read): each worker is `python -u script args` in a session of its own, its exit
code reported to the agent, as torchrun's Popen would make it (tests/test_launch.py compares the
two); the script's imports were made once, here."""

import faulthandler
import io
import json
import os
import resource
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from typing import IO

import torch.distributed.run  # noqa: F401  (imported for the commands, once)
import torch.multiprocessing
from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import SubprocessHandler

# runpy's note that the module it runs as __main__ is imported already (here, on purpose).
warnings.filterwarnings("ignore", "'torch.distributed.run' found in sys.modules", RuntimeWarning)

SERVER_ENV = dict(os.environ)
LAUNCHERS = ("torch.distributed.run", "torchtitan.reliability.launcher")
WORKER_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)
# What a rank's environment adds to its launcher's (as torchrun or scripts/chaos.py sets it).
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def run(kind: str, target: str, argv: list[str]) -> None:
    """As `python -m target argv` or `python target argv` would, sys.path's first entry included; kind
    "ranks": the function `file::name` run as mp.spawn(function, args, nprocs) would, argv being
    [nprocs, *args], its processes forked from this one."""
    if kind == "ranks":
        path, name = target.split("::")
        sys.path[0] = os.path.dirname(path)
        nprocs, *args = argv
        function = runpy.run_path(path)[name]
        torch.multiprocessing.start_processes(function, tuple(args), nprocs, start_method="fork")
        return
    sys.argv = [target, *argv]
    if kind == "module":
        sys.path[0] = os.getcwd()
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        runpy.run_path(target, run_name="__main__")


def exit_code(exit: SystemExit) -> int:
    if exit.code is None or isinstance(exit.code, int):
        return exit.code or 0
    print(exit.code, file=sys.stderr)
    return 1


def run_then_exit(kind: str, target: str, argv: list[str]) -> None:
    """Runs the command in this (forked) process and ends it with the command's exit code."""
    code = 1
    try:
        run(kind, target, argv)
        code = 0
    except SystemExit as e:
        code = exit_code(e)
    except BaseException:
        traceback.print_exc()
    finally:
        for shells in _shells:
            shells.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class ForkedWorker:
    """What torchrun's agent uses of a worker's Popen: its pid, poll() and wait()."""

    def __init__(self, pid: int, args: tuple) -> None:
        self.pid, self.args, self.returncode = pid, args, None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        return self.returncode


def reopen_stdio(unbuffered: bool) -> None:
    """sys.stdout and sys.stderr anew over their file descriptors, as a new interpreter opens them for
    a file or a pipe: stdout block-buffered, stderr line-buffered; with `python -u` (or PYTHONUNBUFFERED)
    both written through to the file descriptor, no buffer."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if unbuffered:
            binary = io.FileIO(stream.fileno(), "w", closefd=False)
        else:
            binary = io.BufferedWriter(io.FileIO(stream.fileno(), "w", closefd=False))
        line_buffering = name == "stderr" and not unbuffered
        reopened = io.TextIOWrapper(
            binary, stream.encoding, stream.errors, line_buffering=line_buffering, write_through=unbuffered
        )
        setattr(sys, name, reopened)
        setattr(sys, f"__{name}__", reopened)


# A worker hung (by a lock it inherited, or any other way) prints its threads' stacks this long after
# its start, before the first step's timeout (comm's init_timeout_seconds, 300 s) ends the run: the
# launch's output then says where it hung.
WORKER_STACKS_AFTER_S = 240


def become_worker(args: tuple, env: dict[str, str], stdout: int | None, stderr: int | None) -> None:
    """This forked process becomes torchrun's worker `python -u script args` (stdout and stderr: file
    descriptors to write to, or None to keep this process's); it never returns."""
    _, _, script, *argv = args
    try:
        os.setsid()
        for sig in WORKER_SIGNALS:  # the agent's handlers; a new interpreter's defaults
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
        for stream, target in ((sys.stdout, stdout), (sys.stderr, stderr)):
            if target is not None:
                os.dup2(target, stream.fileno())
        reopen_stdio(unbuffered=True)
        faulthandler.dump_traceback_later(WORKER_STACKS_AFTER_S)
        os.environ.clear()
        os.environ.update(env)
        sys.orig_argv = list(args)
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    run_then_exit("script", script, argv)


class WorkerShells:
    """Processes forked from the agent before it starts a thread, each waiting to become one of its
    workers. Once running, the agent has threads (its rendezvous' keep-alive timer, its TCP store's): a
    process forked then inherits any lock one of them holds, held for good. A shell is the agent's
    child, as a worker forked then would be (its pid, its exit code, its parent's death signal), but
    forked while nothing held a lock. Each takes its worker's arguments, environment and output files
    over a socket; past the shells made, workers are forked from the agent."""

    def __init__(self, count: int) -> None:
        self.idle: list[tuple[int, socket.socket]] = []
        for _ in range(count):
            agent_end, shell_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            pid = os.fork()
            if pid == 0:
                agent_end.close()
                for _, other in self.idle:
                    other.close()
                self._wait(shell_end)
            shell_end.close()
            self.idle.append((pid, agent_end))

    @staticmethod
    def _wait(shell_end: socket.socket) -> None:
        """In a shell: become the worker the agent sends, or end with the agent (its socket closed)."""
        try:
            message, fds, _, _ = socket.recv_fds(shell_end, 1 << 20, 2)
            if not message:
                os._exit(0)
            spec = json.loads(message)
            received = iter(fds)
            outputs = [next(received) if present else None for present in spec["outputs"]]
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        become_worker(tuple(spec["args"]), spec["env"], *outputs)

    def close(self) -> None:
        """The idle shells ended (their sockets closed) and reaped."""
        for pid, agent_end in self.idle:
            agent_end.close()
            os.waitpid(pid, 0)
        self.idle = []

    def start(self, args: tuple, env: dict[str, str], stdout: IO | None, stderr: IO | None) -> int | None:
        """An idle shell made the worker: its pid; None where none is left."""
        if not self.idle:
            return None
        pid, agent_end = self.idle.pop(0)
        outputs = [stream for stream in (stdout, stderr) if stream is not None]
        spec = {"args": list(args), "env": env, "outputs": [stdout is not None, stderr is not None]}
        socket.send_fds(agent_end, [json.dumps(spec).encode()], [stream.fileno() for stream in outputs])
        agent_end.close()
        return pid


_shells: list[WorkerShells] = []  # the agent's, made before it runs


def fork_worker(handler: SubprocessHandler, args: tuple, env: dict[str, str]) -> ForkedWorker:
    """SubprocessHandler._popen's stand-in: `python -u script args` started by one of the agent's
    WorkerShells, or forked from the agent when none is left."""
    python, unbuffered, *_ = args
    assert (python, unbuffered) == (sys.executable, "-u"), args
    sys.stdout.flush()
    sys.stderr.flush()
    pid = _shells[0].start(args, env, handler._stdout, handler._stderr) if _shells else None
    if pid is None:
        pid = os.fork()
        if pid == 0:
            for _, agent_end in _shells[0].idle if _shells else ():
                agent_end.close()  # the idle shells end with the agent, not with this worker
            _shells.clear()
            stdout, stderr = (None if f is None else f.fileno() for f in (handler._stdout, handler._stderr))
            become_worker(args, env, stdout, stderr)
    return ForkedWorker(pid, args)


def workers_of(argv: list[str]) -> int:
    """The workers a launcher's command line asks for (--nproc_per_node N or =N); 0 where not given."""
    for i, arg in enumerate(argv):
        name, _, value = arg.partition("=")
        if name in ("--nproc_per_node", "--nproc-per-node"):
            value = value or (argv[i + 1] if i + 1 < len(argv) else "")
            return int(value) if value.isdigit() else 0
    return 0


def start(script: str, argv: list[str], env: dict[str, str], cwd: str, log: str) -> int | None:
    """`python script argv` as subprocess.Popen starts it, in the caller's process group, with no
    stdin and its output written to the file `log` (from its start): forked from this process, its
    pid; None, and nothing started, where `env` is not the server's but for RANK_VARIABLES and
    PYTHONUNBUFFERED (which only sets how stdio buffers)."""
    if not server_environment(env, differing=(*RANK_VARIABLES, "PYTHONUNBUFFERED")):
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    try:
        os.chdir(cwd)
        output = os.open(log, os.O_WRONLY)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(output, 1)
        os.dup2(output, 2)
        reopen_stdio(unbuffered=bool(env.get("PYTHONUNBUFFERED")))
        os.environ.clear()
        os.environ.update(env)
        sys.orig_argv = [sys.executable, script, *argv]
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    run_then_exit("script", script, argv)


def poll(started: dict[int, int | None], pids: list[int]) -> list[int | None]:
    """The exit codes of processes `start` forked (negative: the signal that ended one), None for one
    still running; `started` keeps those already reaped."""
    for pid in pids:
        if started.get(pid) is None:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                started[pid] = os.waitstatus_to_exitcode(status)
    return [started[pid] for pid in pids]


def server_environment(env: dict[str, str], differing: tuple[str, ...] = ()) -> bool:
    """Whether `env` is the server's, pytest's name for the running test and the variables `differing`
    aside."""
    aside = ("PYTEST_CURRENT_TEST", *differing)
    return {k: v for k, v in env.items() if k not in aside} == {
        k: v for k, v in SERVER_ENV.items() if k not in aside
    }


def warm(target: str) -> None:
    """A script's imports, made here once for the commands that run it."""
    runpy.run_path(target)


def run_command(
    kind: str, target: str, argv: list[str], env: dict, cwd: str, timeout: float, file_size_limit: int | None
) -> list:
    """The command run to its end in a forked child: [exit code, stdout, stderr, whether it timed out]."""
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        try:
            os.setpgid(0, 0)
            os.chdir(cwd)
            os.environ.clear()
            os.environ.update(env)
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            if file_size_limit is not None:  # a write past it fails with EFBIG (CPython ignores SIGXFSZ)
                resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))
            if kind == "module" and target in LAUNCHERS and server_environment(env):
                SubprocessHandler._popen = fork_worker
                # Shells for the workers and for as many again (a restart), made while this process
                # runs no thread.
                _shells.append(WorkerShells(2 * workers_of(argv)))
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        run_then_exit(kind, target, argv)
    deadline, timed_out = time.monotonic() + timeout, False
    while not (done := os.waitpid(pid, os.WNOHANG))[0]:
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            done, timed_out = os.waitpid(pid, 0), True
            break
        time.sleep(0.02)
    out.seek(0)
    err.seek(0)
    reply = [os.waitstatus_to_exitcode(done[1]), out.read(), err.read(), timed_out]
    out.close()
    err.close()
    return reply


def serve() -> None:
    """One JSON request per line of stdin, {"kind": ..., then the kind's arguments}; one JSON reply per
    line of stdout."""
    started: dict[int, int | None] = {}
    for line in sys.stdin:
        request = json.loads(line)
        kind = request.pop("kind")
        if kind == "warm":
            warm(**request)
            reply = None
        elif kind == "start":
            reply = start(**request)
        elif kind == "poll":
            reply = poll(started, **request)
        else:
            reply = run_command(kind, **request)
        if kind == "start" and reply is not None:
            started[reply] = None
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    serve()
