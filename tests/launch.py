"""Run train.py under torchrun as a user would, and read back what it logged."""

import atexit
import gc
import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# A small, fast job: the debug model on short sequences, exact fp32, every step logged.
TINY_JOB = [
    "--job.config_file",
    str(ROOT / "train_configs" / "debug_model.toml"),
    "--training.seq_len",
    "64",
    "--training.steps",
    "10",
    "--lr_scheduler.warmup_steps",
    "2",
    "--metrics.log_freq",
    "1",
    "--checkpoint.enable_checkpoint",
    "false",
    "--training.mixed_precision_param",
    "float32",
    "--training.mixed_precision_reduce",
    "float32",
    "--validation.enable",
    "false",
]
# Validation at steps 5 and 10 on 2 global batches of 4 sequences (per-rank batch: 4 // DP degree).
VALIDATION = ["--validation.enable", "true", "--validation.freq", "5", "--validation.steps", "2"]


def run_train_in_process(*argv: str) -> int:
    """train.py's run() in this process (no interpreter start-up). train.py is a program, not a
    library: it is executed from its file, as torchrun would, without its `__main__` block. Undoes
    what main() sets globally (signal handlers, automatic GC off)."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        return runpy.run_path(str(ROOT / "train.py"))["run"](list(argv))
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        gc.enable()


# A process that has imported torch and torchrun, and runs each command (`python -m module args`, or
# `python script args`) in a child forked from it: a process of its own, with the command's
# environment, folder, output files and no stdin, as a new interpreter would be, without the seconds
# each spends importing torch (the suite launches torchrun about 60 times). The server only imports
# (no thread exists at a fork). A command still running at its timeout is killed with its process group.
FORK_SERVER = r"""
import json, os, runpy, signal, sys, tempfile, time, traceback, warnings
import torch.distributed.run

# runpy's note that the module it runs as __main__ is imported already (here, on purpose).
warnings.filterwarnings("ignore", "'torch.distributed.run' found in sys.modules", RuntimeWarning)


def run(kind, target, argv):
    sys.argv = [target, *argv]
    if kind == "module":
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(target, run_name="__main__")


def exit_code(exit):
    if exit.code is None or isinstance(exit.code, int):
        return exit.code or 0
    print(exit.code, file=sys.stderr)
    return 1


for line in sys.stdin:
    kind, target, argv, env, cwd, timeout = json.loads(line)
    if kind == "warm":  # a script's imports, made here once for the commands that run it
        runpy.run_path(target)
        print("[]", flush=True)
        continue
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setpgid(0, 0)
            os.chdir(cwd)
            os.environ.clear()
            os.environ.update(env)
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            run(kind, target, argv)
            code = 0
        except SystemExit as e:
            code = exit_code(e)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    deadline, timed_out = time.monotonic() + timeout, False
    while not (done := os.waitpid(pid, os.WNOHANG))[0]:
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            done, timed_out = os.waitpid(pid, 0), True
            break
        time.sleep(0.02)
    out.seek(0)
    err.seek(0)
    print(json.dumps([os.waitstatus_to_exitcode(done[1]), out.read(), err.read(), timed_out]), flush=True)
    out.close()
    err.close()
"""


class ForkServer:
    def __init__(self) -> None:
        self.log = tempfile.TemporaryFile("w+")  # the server's own stderr
        self.process = subprocess.Popen(
            [sys.executable, "-c", FORK_SERVER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            cwd=ROOT,
            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)),
        )
        self.warmed: set[str] = set()

    def request(self, *request) -> list:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        reply = self.process.stdout.readline()
        if not reply:
            self.log.seek(0)
            raise RuntimeError(f"the fork server exited: {self.log.read()[-3000:]}")
        return json.loads(reply)

    def run(
        self, kind: str, target: str, argv: list[str], env: dict[str, str], timeout: float
    ) -> subprocess.CompletedProcess:
        cmd = [sys.executable, *(["-m"] if kind == "module" else []), target, *argv]
        if kind == "script" and target not in self.warmed:
            self.request("warm", target, [], {}, str(ROOT), 0)
            self.warmed.add(target)
        returncode, stdout, stderr, timed_out = self.request(kind, target, argv, env, str(ROOT), timeout)
        if timed_out:
            raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
        return subprocess.CompletedProcess(cmd, returncode, stdout, stderr)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)
        self.log.close()


_fork_server: list[ForkServer] = []  # started by the first command


def run_forked(
    kind: str, target: str, argv: list[str], env: dict[str, str], timeout: float = 300
) -> subprocess.CompletedProcess:
    """`python -m target argv` (kind "module") or `python target argv` ("script"), in ROOT with the
    environment `env`, as a child of the fork server: as subprocess.run with captured output would."""
    if not _fork_server:
        _fork_server.append(ForkServer())
        atexit.register(_fork_server[0].close)
    return _fork_server[0].run(kind, target, argv, env, timeout)


def run_train(
    nproc: int,
    dump_folder: Path,
    *args: str,
    timeout: int = 300,
    launcher: str = "torch.distributed.run",
    preexec_fn: Callable[[], None] | None = None,
) -> subprocess.CompletedProcess:
    """train.py under `launcher` (torchrun, or torchtitan.reliability.launcher as run_llama_train.sh
    starts it), the launcher forked from the fork server; with `preexec_fn` (run in the launcher's
    process before it starts, e.g. to set a limit) it is a new interpreter."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    argv = [
        f"--nproc_per_node={nproc}",
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        "localhost:0",
        str(ROOT / "train.py"),
        *TINY_JOB,
        "--job.dump_folder",
        str(dump_folder),
        *args,
    ]
    if preexec_fn is None:
        return run_forked("module", launcher, argv, env, timeout)
    return subprocess.run(
        [sys.executable, "-m", launcher, *argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=timeout,
        preexec_fn=preexec_fn,
    )


def read_records(dump_folder: Path) -> list[dict]:
    with open(dump_folder / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def read_metrics(dump_folder: Path) -> list[dict]:
    """The training steps' records."""
    return [record for record in read_records(dump_folder) if "loss" in record]


def validation_losses(dump_folder: Path) -> dict[int, float]:
    return {r["step"]: r["validation_loss"] for r in read_records(dump_folder) if "validation_loss" in r}


def losses(dump_folder: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_metrics(dump_folder)}
