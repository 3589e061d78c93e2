"""Profiling the training loop: torch profiler traces and CUDA memory snapshots.

Both are context managers wrapped around the loop. They yield None when disabled; otherwise an
object whose `step()` the loop calls once at the end of every step, so that a trace or snapshot
is named after the training step it shows (`iteration_N`), also after a resume.
"""

import contextlib
import os
from collections.abc import Callable, Iterator

import torch
from torch.profiler import ProfilerActivity

from torchtitan.config.options import JobConfig
from torchtitan.logging import logger

# Steps run under the profiler, unrecorded, before the recorded one: its first steps are slow.
WARMUP_STEPS = 3
# Allocation events the CUDA memory history keeps (the newest; a few kB of host memory each).
MEMORY_SNAPSHOT_MAX_ENTRIES = 100_000


@contextlib.contextmanager
def maybe_enable_profiling(
    job_config: JobConfig, rank: int, global_step: int = 0
) -> Iterator[torch.profiler.profile | None]:
    """Record one step in every `profile_freq` (steps profile_freq, 2 x profile_freq, ...) and
    write it as a Chrome/Perfetto trace, with memory events, to
    `{dump_folder}/{save_traces_folder}/iteration_{step}/rank{rank}_trace.json`."""
    profiling_config = job_config.profiling
    if not profiling_config.enable_profiling:
        yield None
        return
    trace_dir = os.path.join(job_config.job.dump_folder, profiling_config.save_traces_folder)
    warmup = min(WARMUP_STEPS, profiling_config.profile_freq - 1)

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
            wait=profiling_config.profile_freq - warmup - 1, warmup=warmup, active=1, skip_first=1
        ),
        on_trace_ready=save_trace,
        record_shapes=True,
        profile_memory=True,
    )
    profiler.step_num = global_step + 1
    logger.info(f"Profiling every {profiling_config.profile_freq} steps into {trace_dir}")
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
    profiling_config = job_config.profiling
    if not profiling_config.enable_memory_snapshot:
        yield None
        return
    folder = os.path.join(job_config.job.dump_folder, profiling_config.save_memory_snapshot_folder)
    snapshotter = MemorySnapshotter(folder, rank, profiling_config.profile_freq, global_step)
    torch.cuda.memory._record_memory_history(max_entries=MEMORY_SNAPSHOT_MAX_ENTRIES)
    torch._C._cuda_attach_out_of_memory_observer(
        lambda *_: snapshotter.dump(f"iteration_{snapshotter.step_num + 1}_oom")
    )
    logger.info(
        f"Recording CUDA memory history; snapshots every {profiling_config.profile_freq} steps into {folder}"
    )
    try:
        yield snapshotter
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


@contextlib.contextmanager
def maybe_enable_profilers(
    job_config: JobConfig, rank: int, global_step: int = 0
) -> Iterator[Callable[[], None]]:
    """Both of the above; yields what the loop calls at the end of every step."""
    with (
        maybe_enable_profiling(job_config, rank, global_step) as torch_profiler,
        maybe_enable_memory_snapshot(job_config, rank, global_step) as snapshotter,
    ):
        enabled = [profiler for profiler in (torch_profiler, snapshotter) if profiler is not None]

        def step() -> None:
            for profiler in enabled:
                profiler.step()

        yield step
