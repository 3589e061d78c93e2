r"""Find what stands between a GPU training step and the hardware: run train.py's main() in this
process (executed from its file, as a program), with the same options, and report

- where the CUDA time of a few steady steps goes (matmuls, attention, optimizer, the rest), and
  how much of the step the GPU sits idle waiting for the host;
- every host-device synchronisation made by the loop after the first steps (CUDA's sync debug
  mode), with the line that made it: outside logging steps there should be none.

    .venv/bin/python scripts/profile_train.py --job.config_file train_configs/llama3_1b.toml \
        --training.steps 12

The profiler follows the loop through a global optimizer-step hook, so train.py needs no changes.
Its figures are for diagnosis: the reported throughput comes from train.py's own log. It profiles CUDA
kernels, so on a machine without CUDA it stops at once (exit code 2, one line), as for any bad input.
"""

import os
import runpy
import sys
import time
import traceback
import warnings
from collections import Counter, defaultdict

import torch
from torch.autograd import DeviceType
from torch.optim.optimizer import register_optimizer_step_post_hook

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from torchtitan.config.options import ConfigError  # noqa: E402
from torchtitan.config.parser import parse_args  # noqa: E402
from torchtitan.errors import run_with_exit_codes  # noqa: E402
from torchtitan.reliability.preflight import check_job  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Kernel-name fragments per category, first match wins.
CATEGORIES = [
    ("attention", ("flash", "fmha", "attention", "cudnn")),
    ("matmul", ("gemm", "nvjet", "cutlass", "sm90_", "sm80_", "ampere", "hopper", "wgmma")),
    ("optimizer", ("multi_tensor", "adam", "foreach")),
    ("nccl", ("nccl",)),
    ("compiled (triton)", ("triton",)),
]


def category(kernel: str) -> str:
    name = kernel.lower()
    for label, fragments in CATEGORIES:
        if any(f in name for f in fragments):
            return label
    return "other (eager elementwise, copies, loss, embedding)"


def caller(stack: list[traceback.FrameSummary]) -> str:
    """The innermost frame in this repository (not this script), else the innermost frame."""
    for frame in reversed(stack):
        if frame.filename.startswith(REPO) and not frame.filename.endswith("profile_train.py"):
            return f"{os.path.relpath(frame.filename, REPO)}:{frame.lineno} {frame.line}"
    return f"{stack[-1].filename}:{stack[-1].lineno}"


def main(argv: list[str]) -> int:
    job_config = parse_args(argv)
    if not torch.cuda.is_available():
        raise ConfigError(
            "profile_train.py profiles CUDA kernels and this machine has no CUDA device: "
            "run it on a GPU machine"
        )
    warmup, active = 4, 3
    first_active = job_config.training.steps - active  # profile the last steps, after compilation
    if first_active <= warmup:
        raise ConfigError(
            f"--training.steps: profile_train.py profiles the last {active} steps after {warmup} warm-up "
            f"steps, so give more than {warmup + active}, got {job_config.training.steps}"
        )
    check_job(job_config, world_size=1)  # train.py's checks, before any work
    step_times: list[float] = []
    syncs: dict[str, list[int]] = defaultdict(list)
    profiler = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
        schedule=torch.profiler.schedule(wait=first_active - 2, warmup=2, active=active, repeat=1),
    )

    def after_optimizer_step(optimizer, args, kwargs) -> None:
        step_times.append(time.perf_counter())
        profiler.step()
        if len(step_times) == 3:  # past step 1's compilation
            torch.cuda.set_sync_debug_mode("warn")

    def record_sync(message, category_, filename, lineno, file=None, line=None) -> None:
        if "synchronizing" in str(message):
            syncs[caller(traceback.extract_stack()[:-1])].append(len(step_times))

    handle = register_optimizer_step_post_hook(after_optimizer_step)
    try:
        with profiler, warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record_sync
            runpy.run_path(os.path.join(REPO, "train.py"))["main"](job_config)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        handle.remove()

    kernels: Counter[str] = Counter()
    by_category: Counter[str] = Counter()
    for event in profiler.events():
        # GPU-side copies of annotations (ProfilerStep#N, Optimizer.step) span kernels: skip them.
        if event.device_type == DeviceType.CUDA and not event.is_user_annotation:
            us = event.time_range.elapsed_us()
            kernels[event.name] += us
            by_category[category(event.name)] += us
    busy_ms = sum(by_category.values()) / 1e3 / active
    window = step_times[first_active - 1 :]  # hook times bracketing the profiled steps
    wall_ms = 1e3 * (window[-1] - window[0]) / (len(window) - 1)
    print(
        f"\nProfiled steps {first_active + 1}-{job_config.training.steps}: GPU busy {busy_ms:.1f} ms per "
        "step; "
        f"host-side wall time per step {wall_ms:.1f} ms (profiler on; train.py's step_time is the figure)"
    )
    if not busy_ms:
        raise SystemExit("no CUDA kernels were recorded: profile on a GPU")
    print(f"{'category':<52} {'ms/step':>8} {'share':>6}")
    for label, us in by_category.most_common():
        print(f"{label:<52} {us / 1e3 / active:8.2f} {100 * us / 1e3 / active / busy_ms:5.1f}%")
    print("\nTop kernels (ms per step):")
    for name, us in kernels.most_common(15):
        print(f"{us / 1e3 / active:8.2f}  {name[:110]}")
    print(
        f"\nHost-device syncs from step 3 on, by the optimizer steps done when each happened (a sync "
        f"while logging step N, or in step N+1 before its optimizer step); log steps: every "
        f"{job_config.metrics.log_freq} and the last:"
    )
    for where, steps in sorted(syncs.items(), key=lambda kv: -len(kv[1])):
        shown = sorted(set(steps))
        print(f"{len(steps):5d}x at steps {shown[:12]}{' ...' if len(shown) > 12 else ''}: {where}")
    if not syncs:
        print("none")
    return 0


if __name__ == "__main__":
    sys.exit(run_with_exit_codes(lambda: main(sys.argv[1:])))
