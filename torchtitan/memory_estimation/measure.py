"""--measure: the same step run for real on this machine's devices, under torchrun."""

import os
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, record_function

from torchtitan.config.options import JobConfig
from torchtitan.config_rules import check_layout
from torchtitan.memory_estimation.report import layout_of, row
from torchtitan.memory_estimation.step import SimulatedStep, build_step, vocab_size_of
from torchtitan.memory_estimation.torch_internals import kineto_events
from torchtitan.parallelisms.distributed import init_distributed


def cpu_peak(prof: torch.profiler.profile, window: str) -> int:
    """Peak of the bytes the CPU allocator held during the `window` record_function, from the
    profiler's memory events (allocations made before the profiler started are not seen)."""
    events = kineto_events(prof)
    (marker,) = [e for e in events if e.name() == window]
    memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    live = sum(nbytes for t, nbytes in memory if t < marker.start_ns())
    peak = live
    for t, nbytes in memory:
        if marker.start_ns() <= t <= marker.end_ns():
            live += nbytes
            peak = max(peak, live)
    return peak


def run_step(step: SimulatedStep) -> None:
    step.forward_backward()
    step.optimizer_step()


def measured_peak(build: Callable[[], SimulatedStep], device: torch.device) -> tuple[int, SimulatedStep]:
    """Peak bytes allocated during the second step of the one `build` makes (its optimizer state is
    made by the first), and the step: torch.cuda.max_memory_allocated, or on CPU from the profiler's
    memory events, the step built under the profiler so that its parameters are counted."""
    if device.type == "cuda":
        step = build()
        run_step(step)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        run_step(step)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(), step
    with torch.profiler.profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step = build()
        run_step(step)
        with record_function("measured step"):
            run_step(step)
    return cpu_peak(prof, "measured step"), step


def measure(cfg: JobConfig) -> None:
    """Run the step for real on this machine's devices (under torchrun) and print each rank's peak."""
    world_size, rank, device = init_distributed(cfg.comm.init_timeout_seconds)
    cfg.training.compile = False
    parallel_dims = check_layout(cfg, world_size, device.type)
    world_mesh = parallel_dims.build_mesh(device.type) if world_size > 1 else None
    vocab = vocab_size_of(cfg)
    peak, _ = measured_peak(lambda: build_step(cfg, parallel_dims, world_mesh, device, vocab), device)
    peaks = [peak]
    if world_size > 1:
        peaks = [None] * world_size
        dist.all_gather_object(peaks, peak)
        dist.barrier()  # ranks that tear their group down while a peer still uses it can abort at exit
        dist.destroy_process_group()
    if rank == 0:
        print(
            f"Measured peak memory per rank (GiB) of a steady-state step, {world_size} ranks ({device.type}):"
        )
        print(row("model", "layout", "rank", ["peak"]))
        for r, p in enumerate(peaks):
            print(row(cfg, layout_of(cfg, parallel_dims), r, [p]))
    if world_size > 1:
        # gloo's worker thread frees a finished collective's work (and the tensors it holds) after the
        # ranks have moved on; when that falls in the interpreter's shutdown, the process aborts
        # (std::terminate: about one run in ten here, seen in a core dump). Nothing is left to do, so
        # the rank leaves without shutting the interpreter down.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
