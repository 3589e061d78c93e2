"""Run train.py under torchrun as a user would, and read back what it logged."""

import gc
import json
import os
import runpy
import signal
import subprocess
import sys
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


def run_train(
    nproc: int,
    dump_folder: Path,
    *args: str,
    timeout: int = 300,
    launcher: str = "torch.distributed.run",
    preexec_fn: Callable[[], None] | None = None,
) -> subprocess.CompletedProcess:
    """train.py under `launcher` (torchrun, or torchtitan.reliability.launcher as run_llama_train.sh
    starts it); `preexec_fn` runs in the launcher's process before it starts (e.g. to set a limit)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [
        sys.executable,
        "-m",
        launcher,
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
    return subprocess.run(
        cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout, preexec_fn=preexec_fn
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
