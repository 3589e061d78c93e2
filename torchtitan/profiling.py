"""Profiling the training loop: torch profiler traces and CUDA memory snapshots.

Both are context managers wrapped around the loop. They yield None when disabled; otherwise an
object whose `step()` the loop calls once at the end of every step, so that a trace or snapshot
is named after the training step it shows (`iteration_N`), also after a resume.
"""

import contextlib
import os
from collections.abc import Iterator

import torch
from torch.profiler import ProfilerActivity

from torchtitan.config_manager import ConfigError, JobConfig, Profiling
from torchtitan.logging import logger

# Steps run under the profiler, unrecorded, before the recorded one: its first steps are slow.
WARMUP_STEPS = 3
# Allocation events the CUDA memory history keeps (the newest; a few kB of host memory each).
MEMORY_SNAPSHOT_MAX_ENTRIES = 100_000


def validate_profiling(cfg: Profiling, device: torch.device) -> None:
    """Reject what cannot run on this device before any heavy work starts."""
    if cfg.enable_memory_snapshot and device.type != "cuda":
        raise ConfigError(
            f"profiling.enable_memory_snapshot: memory snapshots record the CUDA allocator, and this run is "
            f"on {device.type}; set it to false (profiler traces, enable_profiling, work on any device)"
        )


@contextlib.contextmanager
def maybe_enable_profiling(
    job_config: JobConfig, rank: int, global_step: int = 0
) -> Iterator[torch.profiler.profile | None]:
    """Record one step in every `profile_freq` (steps profile_freq, 2 x profile_freq, ...) and
    write it as a Chrome/Perfetto trace, with memory events, to
    `{dump_folder}/{save_traces_folder}/iteration_{step}/rank{rank}_trace.json`."""
    cfg = job_config.profiling
    if not cfg.enable_profiling:
        yield None
        return
    trace_dir = os.path.join(job_config.job.dump_folder, cfg.save_traces_folder)
    warmup = min(WARMUP_STEPS, cfg.profile_freq - 1)

    def save_trace(prof: torch.profiler.profile) -> None:
        folder = os.path.join(trace_dir, f"iteration_{prof.step_num - 1}")  # called once it moved on
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"rank{rank}_trace.json")
        prof.export_chrome_trace(path)
        logger.info(f"Saved profiler trace {path}")

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    profiler = torch.profiler.profile(
        activities=activities,
        # Its step count is the training step (1-based, so the schedule skips step 0): the trace of
        # step N is labelled ProfilerStep#N, also after a resume.
        schedule=torch.profiler.schedule(
            wait=cfg.profile_freq - warmup - 1, warmup=warmup, active=1, skip_first=1
        ),
        on_trace_ready=save_trace,
        record_shapes=True,
        profile_memory=True,
    )
    profiler.step_num = global_step + 1
    logger.info(f"Profiling every {cfg.profile_freq} steps into {trace_dir}")
    with profiler:
        yield profiler


class MemorySnapshotter:
    """Dumps the CUDA allocator's state and recent history every `freq` steps."""

    def __init__(self, folder: str, rank: int, freq: int, global_step: int) -> None:
        self.folder = folder
        self.rank = rank
        self.freq = freq
        self.step_num = global_step

    def step(self) -> None:
        self.step_num += 1
        if self.step_num % self.freq == 0:
            self.dump(f"iteration_{self.step_num}")

    def dump(self, name: str) -> None:
        folder = os.path.join(self.folder, name)
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"rank{self.rank}_memory_snapshot.pickle")
        torch.cuda.memory._dump_snapshot(path)
        logger.info(f"Saved memory snapshot {path} (open it at https://pytorch.org/memory_viz)")


@contextlib.contextmanager
def maybe_enable_memory_snapshot(
    job_config: JobConfig, rank: int, global_step: int = 0
) -> Iterator[MemorySnapshotter | None]:
    """Record CUDA allocations and dump a snapshot every `profile_freq` steps to
    `{dump_folder}/{save_memory_snapshot_folder}/iteration_{step}/rank{rank}_memory_snapshot.pickle`,
    and one into `iteration_{step}_oom` when an allocation fails (from the allocator's
    out-of-memory observer, so before the error unwinds anything)."""
    cfg = job_config.profiling
    if not cfg.enable_memory_snapshot:
        yield None
        return
    folder = os.path.join(job_config.job.dump_folder, cfg.save_memory_snapshot_folder)
    snapshotter = MemorySnapshotter(folder, rank, cfg.profile_freq, global_step)
    torch.cuda.memory._record_memory_history(max_entries=MEMORY_SNAPSHOT_MAX_ENTRIES)
    torch._C._cuda_attach_out_of_memory_observer(
        lambda *_: snapshotter.dump(f"iteration_{snapshotter.step_num + 1}_oom")
    )
    logger.info(f"Recording CUDA memory history; snapshots every {cfg.profile_freq} steps into {folder}")
    try:
        yield snapshotter
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
