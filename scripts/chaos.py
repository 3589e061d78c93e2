"""Chaos test: kill a training job with SIGKILL at random moments, checkpoint writes included, launch it
again each time, and check that it ends exactly as an uninterrupted run does: the same loss at every
step, bit for bit, and the same final checkpoint.

    python scripts/chaos.py --trials 20 [--seed 0] [--workdir DIR] [--async-mode async]

A trial launches the job (2 ranks on CPU, each its own process with the environment torchrun would
give it, so that one rank can be killed alone) and, once or twice, kills one rank or all of them:
after a random step, or while a checkpoint is being written (a `step-N.tmp` folder exists). The
surviving ranks must exit by themselves (their next collective fails); retention
(checkpoint.keep_latest_k = 1) must never have left the folder without a complete checkpoint once
one was saved. The last launch runs to the end. Exit code 0 when every trial passed.
"""

import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from torchtitan.config.options import ConfigError  # noqa: E402
from torchtitan.config.parser import OneLineParser, positive_int  # noqa: E402
from torchtitan.errors import run_with_exit_codes  # noqa: E402

STEPS = 8
COMM_TIMEOUT = 10  # comm.train_timeout_seconds: how long a survivor may wait on a dead rank
# A small job that saves often (the debug model on 2 blocks): every other step, keeping only the newest
# checkpoint.
JOB = [
    "--job.config_file",
    str(ROOT / "train_configs" / "debug_model.toml"),
    "--model.n_layers",
    "2",
    "--training.seq_len",
    "64",
    "--training.batch_size",
    "2",
    "--training.steps",
    str(STEPS),
    "--lr_scheduler.warmup_steps",
    "2",
    "--metrics.log_freq",
    "1",
    "--training.mixed_precision_param",
    "float32",
    "--training.mixed_precision_reduce",
    "float32",
    "--checkpoint.enable_checkpoint",
    "true",
    "--checkpoint.interval",
    "2",
    "--checkpoint.keep_latest_k",
    "1",
    "--comm.train_timeout_seconds",
    str(COMM_TIMEOUT),
    "--comm.init_timeout_seconds",
    "60",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """One launch of train.py on `nproc` ranks, started directly (not by torchrun) with the
    environment torchrun would set, each rank's output in `{dump_folder}/logs/launch-K-rank-R.log`."""

    # How each rank's process starts (the tests fork it from their fork server: tests/launch.py).
    popen: Callable[..., subprocess.Popen] = subprocess.Popen

    def __init__(self, nproc: int, dump_folder: Path, *args: str, world_size: int | None = None) -> None:
        """Ranks 0 to nproc-1 of a world of `world_size` (default: nproc) ranks."""
        port = free_port()
        logs = dump_folder / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        launch = len(list(logs.glob("launch-*-rank-0.log")))
        self.logs = [logs / f"launch-{launch}-rank-{rank}.log" for rank in range(nproc)]
        self.procs = []
        for rank in range(nproc):
            env = dict(
                os.environ,
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world_size or nproc),
                LOCAL_WORLD_SIZE=str(nproc),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                OMP_NUM_THREADS="1",
                PYTHONPATH=str(ROOT),
                PYTHONUNBUFFERED="1",
            )
            cmd = [sys.executable, str(ROOT / "train.py"), *args, "--job.dump_folder", str(dump_folder)]
            with open(self.logs[rank], "w") as log:
                self.procs.append(self.popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))

    def output(self, rank: int = 0) -> str:
        return self.logs[rank].read_text()

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def signal(self, ranks: list[int], sig: int) -> None:
        for rank in ranks:
            if self.procs[rank].poll() is None:
                self.procs[rank].send_signal(sig)

    def wait(self, timeout: float) -> list[int | None]:
        """Exit codes (negative: killed by that signal); None for a rank still running at `timeout`."""
        deadline = time.monotonic() + timeout
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(deadline - time.monotonic(), 0))
        return [p.poll() for p in self.procs]

    def kill(self) -> None:
        """SIGCONT then SIGKILL whatever still runs (a stopped process must be woken to be reaped)."""
        self.signal(list(range(len(self.procs))), signal.SIGCONT)
        self.signal(list(range(len(self.procs))), signal.SIGKILL)
        self.wait(30)


def last_step(text: str) -> int:
    steps = re.findall(r"step:\s+(\d+)/", text)
    return int(steps[-1]) if steps else 0


def losses(dump_folder: Path) -> list[tuple[int, float]]:
    """Every training (step, loss) logged to metrics.jsonl, across all launches."""
    with open(dump_folder / "metrics.jsonl") as f:
        return [(r["step"], r["loss"]) for r in map(json.loads, f) if "loss" in r]


def complete_checkpoints(dump_folder: Path) -> list[str]:
    folder = dump_folder / "checkpoint"
    if not folder.is_dir():
        return []
    return sorted(
        p.name for p in folder.iterdir() if re.fullmatch(r"step-\d+", p.name) and (p / ".metadata").is_file()
    )


def kill_once_saved(job: Job, dump_folder: Path, step: int, timeout: float = 300) -> None:
    """SIGKILL every rank of `job` as soon as checkpoint step-`step` is complete in `dump_folder`."""
    deadline = time.monotonic() + timeout
    while f"step-{step}" not in complete_checkpoints(dump_folder):
        assert job.running() and time.monotonic() < deadline, job.output(0)[-3000:]
        time.sleep(0.01)
    ranks = list(range(len(job.procs)))
    job.signal(ranks, signal.SIGKILL)
    assert job.wait(30) == [-signal.SIGKILL] * len(ranks)


def run_to_end(nproc: int, dump_folder: Path, *args: str) -> Job:
    job = Job(nproc, dump_folder, *JOB, *args)
    codes = job.wait(600)
    if codes != [0] * nproc:
        job.kill()
        raise AssertionError(f"exit codes {codes}:\n{job.output()[-3000:]}")
    return job


def kill_at_random(rng: random.Random, nproc: int, dump_folder: Path, *args: str) -> str:
    """One launch killed at a random moment: after a random step or during a save, one rank or all."""
    victims = rng.choice([[r] for r in range(nproc)] + [list(range(nproc))])
    when = rng.choice(["step", "save"])
    return kill_once(nproc, dump_folder, when, rng.randint(1, STEPS - 1), victims, rng.uniform(0, 0.3), *args)


def kill_once(
    nproc: int, dump_folder: Path, when: str, step: int, victims: list[int], delay: float, *args: str
) -> str:
    """Launch; SIGKILL `victims` `delay` seconds after rank 0 logs `step` (when="step") or once a
    checkpoint is being written (when="save"); check that the other ranks exit by themselves and that
    a complete checkpoint is left if one was ever saved. Returns what happened, in words."""
    job = Job(nproc, dump_folder, *JOB, *args)
    checkpoints = dump_folder / "checkpoint"
    started = False
    while job.running():
        text = job.output(0)
        started = started or "Training steps" in text  # a crash's leftovers are removed by then
        if when == "step" and last_step(text) >= step:
            break
        if when == "save" and started and any(p.name.endswith(".tmp") for p in checkpoints.glob("step-*")):
            break
        time.sleep(0.005)
    else:
        return f"{when}: the job ended before the kill"
    time.sleep(delay)
    at = last_step(job.output(0))
    job.signal(victims, signal.SIGKILL)
    start = time.monotonic()
    codes = job.wait(COMM_TIMEOUT + 30)
    waited = time.monotonic() - start
    if any(code is None for code in codes):
        job.kill()
        raise AssertionError(f"ranks still running {waited:.0f}s after ranks {victims} were killed: {codes}")
    saved = any("Saved checkpoint" in log.read_text() for log in (dump_folder / "logs").glob("*-rank-0.log"))
    if saved and not complete_checkpoints(dump_folder):
        raise AssertionError("a checkpoint was saved before, but none is complete after the kill")
    return f"killed ranks {victims} ({when}, after step {at}); exit codes {codes} after {waited:.1f}s"


def compare(dump_folder: Path, reference: Path) -> None:
    """Every loss logged in any launch equals the reference's at that step, every step was logged,
    and the final checkpoints are identical."""
    expected = dict(losses(reference))
    seen = losses(dump_folder)
    for step, loss in seen:
        if loss != expected[step]:
            raise AssertionError(f"step {step}: loss {loss!r} != {expected[step]!r} uninterrupted")
    if {step for step, _ in seen} != set(expected):
        raise AssertionError(f"steps logged {sorted({s for s, _ in seen})}, expected 1..{STEPS}")
    import torch  # here, not at the top: a bad argument is answered without loading torch

    from torchtitan.checkpoint.safe_reader import read_checkpoint

    final = f"checkpoint/step-{STEPS}"
    got, want = read_checkpoint(str(dump_folder / final)), read_checkpoint(str(reference / final))
    if got.keys() != want.keys():
        raise AssertionError(f"final checkpoint keys differ: {sorted(got.keys() ^ want.keys())[:5]}")
    for key, value in want.items():
        same = torch.equal(got[key], value) if isinstance(value, torch.Tensor) else got[key] == value
        if not same:
            raise AssertionError(f"final checkpoint differs from the uninterrupted run's at {key}")


def trial(rng: random.Random, nproc: int, dump_folder: Path, reference: Path, *args: str) -> list[str]:
    events = [kill_at_random(rng, nproc, dump_folder, *args) for _ in range(rng.randint(1, 2))]
    run_to_end(nproc, dump_folder, *args)
    events.append(f"completed; checkpoints left: {', '.join(complete_checkpoints(dump_folder))}")
    compare(dump_folder, reference)
    return events


def main() -> int:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=positive_int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--nproc", type=positive_int, default=2)
    parser.add_argument("--workdir", type=Path, default=ROOT / "outputs" / "chaos")
    parser.add_argument("--async-mode", default="disabled", choices=("disabled", "async"))
    args = parser.parse_args()
    extra = ["--checkpoint.async_mode", args.async_mode]
    if args.workdir.exists():
        raise ConfigError(f"--workdir: {args.workdir} exists; remove it or pass another --workdir")
    reference = args.workdir / "reference"
    run_to_end(args.nproc, reference, *extra)
    failures = 0
    for i in range(args.trials):
        rng = random.Random(args.seed * 1000 + i)
        try:
            events = trial(rng, args.nproc, args.workdir / f"trial-{i}", reference, *extra)
            print(f"trial {i}: ok: " + "; ".join(events), flush=True)
        except AssertionError as e:
            failures += 1
            print(f"trial {i}: FAILED: {e}", flush=True)
    print(f"{args.trials - failures} passed, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(run_with_exit_codes(main))
