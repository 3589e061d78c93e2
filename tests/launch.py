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
from typing import IO, Any

from fork_server import ForkedWorker

ROOT = Path(__file__).resolve().parent.parent

# A small, fast job: the debug model's width on 2 blocks (a test's cost is its launches' Python-side work
# per block and step: the families' debug flavours have 6), short sequences, exact fp32, every step logged.
TINY_JOB = [
    "--job.config_file",
    str(ROOT / "train_configs" / "debug_model.toml"),
    "--model.n_layers",
    "2",
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
    # The tests choose a per-rank validation batch (validation.batch_size), not the recipe's global one.
    "--validation.global_batch_size",
    "-1",
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


def launch_env(**extra: str) -> dict[str, str]:
    """The environment of the commands the tests launch: this process's, one intra-op thread, the
    repository importable. tests/fork_server.py forks torchrun's workers where a command has it."""
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **extra)


class ForkServer:
    """tests/fork_server.py, started with launch_env()."""

    def __init__(self) -> None:
        self.log = tempfile.TemporaryFile("w+")  # the server's own stderr
        self.process = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "fork_server.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            cwd=ROOT,
            env=launch_env(),
        )
        self.warmed: set[str] = set()

    def request(self, kind: str, **arguments):  # noqa: ANN201 (the kind's JSON reply)
        self.process.stdin.write(json.dumps({"kind": kind, **arguments}) + "\n")
        self.process.stdin.flush()
        reply = self.process.stdout.readline()
        if not reply:
            self.log.seek(0)
            raise RuntimeError(f"the fork server exited: {self.log.read()[-3000:]}")
        return json.loads(reply)

    def run(
        self,
        kind: str,
        target: str,
        argv: list[str],
        env: dict[str, str],
        timeout: float,
        file_size_limit: int | None = None,
    ) -> subprocess.CompletedProcess:
        cmd = [sys.executable, *(["-m"] if kind == "module" else []), target, *argv]
        if kind == "module":  # a launcher: the script it runs
            script = next((a for a in argv if a.endswith(".py")), None)
        else:
            script = target.split("::")[0]  # "ranks": file::function
        if script is not None:
            self.warm(script)
        returncode, stdout, stderr, timed_out = self.request(
            kind,
            target=target,
            argv=argv,
            env=env,
            cwd=str(ROOT),
            timeout=timeout,
            file_size_limit=file_size_limit,
        )
        if timed_out:
            raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
        return subprocess.CompletedProcess(cmd, returncode, stdout, stderr)

    def warm(self, script: str) -> None:
        if script not in self.warmed:
            self.request("warm", target=script)
            self.warmed.add(script)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)
        self.log.close()


_fork_server: list[ForkServer] = []  # started by the first command


def fork_server() -> ForkServer:
    if not _fork_server:
        _fork_server.append(ForkServer())
        atexit.register(_fork_server[0].close)
    return _fork_server[0]


def run_forked(
    kind: str,
    target: str,
    argv: list[str],
    env: dict[str, str],
    timeout: float = 300,
    file_size_limit: int | None = None,
) -> subprocess.CompletedProcess:
    """`python -m target argv` (kind "module") or `python target argv` ("script"), in ROOT with the
    environment `env`, as a child of the fork server: as subprocess.run with captured output would.
    `file_size_limit` (bytes): RLIMIT_FSIZE in the command's process, and so in the processes it starts."""
    return fork_server().run(kind, target, argv, env, timeout, file_size_limit)


class StartedProcess(ForkedWorker):
    """What scripts/chaos.py uses of a rank's Popen, for a process the fork server started (and reaps:
    it asks the server)."""

    def poll(self) -> int | None:
        if self.returncode is None:
            (self.returncode,) = fork_server().request("poll", pids=[self.pid])
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # as Popen: not to a pid that may have been reused
            os.kill(self.pid, sig)


def start_forked(args: list[str], env: dict[str, str], cwd: Path, stdout: IO, stderr: int) -> Any:
    """subprocess.Popen(args, env=env, cwd=cwd, stdout=stdout, stderr=subprocess.STDOUT) for args
    `[python, script, ...]` and stdout a file (scripts/chaos.py's Job.popen): the process forked from
    the fork server, which imported the script once, where env is the server's but for what a rank
    is given (tests/fork_server.py's start); a new interpreter otherwise."""
    python, script, *argv = args
    assert python == sys.executable and stderr == subprocess.STDOUT, args
    server = fork_server()
    server.warm(script)
    pid = server.request("start", script=script, argv=argv, env=env, cwd=str(cwd), log=stdout.name)
    if pid is None:
        return subprocess.Popen(args, env=env, cwd=cwd, stdout=stdout, stderr=stderr)
    return StartedProcess(pid, args)


def spawn_forked(function: Callable[..., None], nprocs: int, *args: int | str, timeout: float = 300) -> None:
    """mp.spawn(function, args, nprocs) with the processes forked from the fork server (which imported
    the function's file once), not new interpreters; `function` is a module-level function of a file,
    `args` numbers or strings. Raises with the ranks' output if one failed."""
    target = f"{function.__code__.co_filename}::{function.__name__}"
    result = run_forked("ranks", target, [nprocs, *args], launch_env(), timeout)
    if result.returncode != 0:
        raise RuntimeError(f"{function.__name__} failed: {result.stdout[-3000:]}{result.stderr[-5000:]}")


def run_train(
    nproc: int,
    dump_folder: Path,
    *args: str,
    timeout: int = 300,
    launcher: str = "torch.distributed.run",
    file_size_limit: int | None = None,
) -> subprocess.CompletedProcess:
    """train.py under `launcher` (torchrun, or torchtitan.reliability.launcher as run_llama_train.sh
    starts it), the launcher forked from the fork server, with launch_env()."""
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
    return run_forked("module", launcher, argv, launch_env(), timeout, file_size_limit)


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
