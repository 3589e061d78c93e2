"""benchmark.py's step-time rows (framework overhead, compile), and the timing the other groups
share: train.py's main() run in this process and its steady step time, and the hand-written loop it is
compared with."""

import json
import os
import runpy
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_post_hook

from torchtitan.config.parser import parse_args

ROOT = Path(__file__).resolve().parents[2]

TRAIN_ARGS = [
    "--job.config_file",
    str(ROOT / "train_configs" / "debug_model.toml"),
    "--checkpoint.enable_checkpoint",
    "false",
    "--lr_scheduler.warmup_steps",
    "2",
    "--training.batch_size",
    "2",
    "--training.seq_len",
    "128",
]
LOG_FREQ = 4  # steps per timed window
STEADY_FROM = 2 * LOG_FREQ  # windows after this step are steady (compilation and warmup are over)
WINDOWS = 8  # steady windows timed per run; the best one counts, as other processes add noise


ON_GPU = torch.cuda.is_available()
# Step times compare in wall time on a GPU; on CPU in the measuring process's CPU time, which other
# processes sharing the cores barely change (a single-threaded CPU step's wall time is its CPU time on
# a quiet machine).
CLOCK = "wall" if ON_GPU else "cpu"


def run_train(argv: list[str], after_optimizer_step: Callable[[], None]) -> None:
    """train.py's main() in this process, calling `after_optimizer_step` after each of its optimizer
    steps (a global optimizer hook, so train.py needs no changes)."""
    train_main = runpy.run_path(str(ROOT / "train.py"))["main"]  # a program: executed, not imported
    hook = register_optimizer_step_post_hook(lambda *_: after_optimizer_step())
    try:
        train_main(parse_args(argv))
    finally:
        hook.remove()


def train_step_time(
    dump_folder: str,
    extra: list[str],
    log_freq: int = LOG_FREQ,
    steady_from: int = STEADY_FROM,
    windows: int = WINDOWS,
    after_step: Callable[[int], None] | None = None,
) -> dict:
    """Step seconds of train.py's main(), run in this process: its best steady window as its
    metrics.jsonl reports it (wall time), and this process's CPU time over the same windows.
    `after_step(step)` runs after each optimizer step, after the CPU clock is read."""
    cpu_at_step: list[float] = []

    def optimizer_step_done() -> None:
        cpu_at_step.append(time.process_time())
        if after_step is not None:
            after_step(len(cpu_at_step))

    steps = steady_from + windows * log_freq
    argv = [*TRAIN_ARGS, "--training.steps", str(steps), "--metrics.log_freq", str(log_freq)]
    run_train([*argv, "--job.dump_folder", dump_folder, *extra], optimizer_step_done)
    with open(os.path.join(dump_folder, "metrics.jsonl")) as f:
        steady = (r for r in map(json.loads, f) if r["step"] > steady_from and "step_time" in r)
        best = min(steady, key=lambda r: r["step_time"])
    ends = cpu_at_step[steady_from - 1 :: log_freq]  # CPU clock after steps 8, 12, 16, ... (defaults)
    cpu = min(b - a for a, b in zip(ends, ends[1:])) / log_freq
    return {"wall": best["step_time"], "cpu": cpu, "tokens": best["tps"] * best["step_time"]}


def reference_step_time(extra: list[str], warmup: int = 3, model_args=None) -> dict:
    """Step seconds (wall and CPU, best window) of a minimal PyTorch loop: same model, batch and
    optimizer as train.py, one fixed batch, no data loader, logging, scheduler or checkpointing.
    `model_args`: the family's arguments to build instead of the job's flavour."""
    from torchtitan.datasets.tokenizer import build_tokenizer
    from torchtitan.models import build_model_args, model_spec

    job_config = parse_args([*TRAIN_ARGS, *extra])
    args = build_model_args(job_config, build_tokenizer(ROOT / job_config.model.tokenizer_path).n_words)
    args = (
        replace(model_args, vocab_size=args.vocab_size, max_seq_len=args.max_seq_len) if model_args else args
    )
    device = torch.device("cuda" if ON_GPU else "cpu")
    with torch.device("meta"):
        model = model_spec(job_config.model).build(args)
    model.to_empty(device=device)
    model.init_weights(seed=0)
    o = job_config.optimizer
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=o.lr,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
        weight_decay=o.weight_decay,
        foreach=o.implementation == "foreach",
        fused=o.implementation == "fused",
    )
    tokens = torch.randint(
        0, args.vocab_size, (job_config.training.batch_size, job_config.training.seq_len + 1)
    )
    inputs, labels = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
    wall, cpu = [], []
    for window in range(-warmup, WINDOWS):
        wall_start, cpu_start = time.perf_counter(), time.process_time()
        for _ in range(LOG_FREQ):
            loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), job_config.training.max_norm, foreach=True)
            optimizer.step()
            optimizer.zero_grad()
        loss.item()  # like train.py's logging step: wait for the device
        if window >= 0:
            wall.append((time.perf_counter() - wall_start) / LOG_FREQ)
            cpu.append((time.process_time() - cpu_start) / LOG_FREQ)
    return {"wall": min(wall), "cpu": min(cpu)}


def step_ratio(a: dict, b: dict) -> float:
    """a / b in the compared clock (CLOCK)."""
    return a[CLOCK] / b[CLOCK]


def ms(step: dict) -> str:
    """A step time in the compared clock, wall time in brackets."""
    return f"{1e3 * step[CLOCK]:.1f} ms/step ({1e3 * step['wall']:.1f})"


def part_overhead(tmp: str) -> dict:
    before = reference_step_time([])
    trained = train_step_time(os.path.join(tmp, "eager"), [])
    after = reference_step_time([])
    reference = {clock: min(before[clock], after[clock]) for clock in ("wall", "cpu")}
    return {"value": step_ratio(trained, reference), "train": trained, "reference": [before, after]}


def part_compile(tmp: str) -> dict:
    compiled = train_step_time(os.path.join(tmp, "compiled"), ["--training.compile", "true"])
    eager = train_step_time(os.path.join(tmp, "eager"), [])
    return {"value": step_ratio(compiled, eager), "compiled": compiled, "eager": eager}


def overhead_rows(run_part: Callable[..., dict], add: Callable[..., None]) -> dict:
    """The framework-overhead row; returns its part's result (the data rows compare the loader's
    tokens/s with its train.py's)."""
    o = run_part("overhead")
    add(
        "framework overhead",
        o["value"],
        "<= 1.05",
        o["value"] <= 1.05,
        f"train.py {ms(o['train'])} vs hand-written loop, best of before/after: "
        + ", ".join(ms(r) for r in o["reference"]),
        o,
    )
    return o


def compile_rows(run_part: Callable[..., dict], add: Callable[..., None]) -> None:
    k = run_part("compile")
    add(
        "compile",
        k["value"],
        "< 1 (faster)",
        k["value"] < 1,
        f"compiled {ms(k['compiled'])}, eager {ms(k['eager'])}",
        k,
    )
