"""scripts/benchmark.py's context-parallel rows: a rank's peak memory and step time on one long sequence
at CP 2 (2 gloo ranks) against CP 1, on the CPU whatever the device (`--only context_parallel`)."""

import os
from collections.abc import Callable

import torch
from benchmark_step import train_step_time

CP_SEQ_LEN = 4096  # long enough for the activations, which CP splits, to be most of the peak
CP_ARGS = [
    "--training.batch_size",
    "1",
    "--training.seq_len",
    str(CP_SEQ_LEN),
    "--training.mixed_precision_param",
    "float32",
    "--validation.enable",
    "false",
]
CP_MEASURED_STEP = 2  # the step whose peak counts: the first made the optimizer state
CP_STEADY_FROM = 3  # steps timed after this one (the profiler is stopped after the measured step)
CP_WINDOWS = 3  # timed steps, one per window; at ~6 s a step on one thread, a few suffice
CP_WINDOW = "context-parallel measured step"  # the profiler's marker around the measured step


def part_context_parallel(tmp: str) -> dict:
    """train.py on one CP_SEQ_LEN-token sequence, context-parallel over this part's processes (CP 1 in
    one process): each rank's peak memory over its second step, as scripts/estimate_memory.py
    --measure takes it on CPU (the profiler's memory events from before the model is built), then
    its step times with the profiler off."""
    import resource

    import torch.distributed as dist
    from torch.autograd.profiler import record_function

    from torchtitan.memory_estimation.measure import cpu_peak

    cp = int(os.environ.get("WORLD_SIZE", "1"))
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    window = record_function(CP_WINDOW)

    def around_measured_step(step: int) -> None:
        if step == CP_MEASURED_STEP - 1:
            window.__enter__()
        elif step == CP_MEASURED_STEP:
            window.__exit__(None, None, None)
            profiler.stop()

    profiler.start()
    timed = train_step_time(
        os.path.join(tmp, f"context_parallel_{cp}"),
        [*CP_ARGS, "--parallelism.context_parallel_degree", str(cp)],
        log_freq=1,
        steady_from=CP_STEADY_FROM,
        windows=CP_WINDOWS,
        after_step=around_measured_step,
    )
    # ru_maxrss (also what train.py logs as memory on CPU) adds the interpreter, libraries and the
    # profiler's own records: for reference only.
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    mine = {"peak": cpu_peak(profiler, CP_WINDOW), "max_rss": maxrss, **timed}
    if cp == 1:
        return {"ranks": [mine]}
    gathered: list = [None] * cp
    dist.all_gather_object(gathered, mine)
    dist.barrier()  # no rank tears gloo down while another still reads from it
    dist.destroy_process_group()
    return {"ranks": gathered}


def context_parallel_rows(run_part: Callable[..., dict], add: Callable[..., None]) -> None:
    """The part in 1 process (CP 1) and in 2 (CP 2), on the CPU, in CPU time whatever the device (the
    worst rank of the two counts)."""
    one = run_part("context_parallel", cpu=True)["ranks"][0]
    two = run_part("context_parallel", 2, cpu=True)["ranks"]

    def ranks(key: str, scale: float, spec: str) -> str:
        return " and ".join(format(r[key] * scale, spec) for r in two)

    peak = max(r["peak"] for r in two)
    add(
        "context-parallel memory",
        peak / one["peak"],
        "<= 0.6",
        peak / one["peak"] <= 0.6,
        f"peak per rank at CP 2 {ranks('peak', 2**-20, ',.0f')} MiB, at CP 1 {one['peak'] / 2**20:,.0f} "
        f"MiB (1 x {CP_SEQ_LEN} tokens, fp32, CPU)",
        {"cp_1": one, "cp_2": two},
    )
    slowest = max(r["cpu"] for r in two)
    add(
        "context-parallel step time",
        slowest / one["cpu"],
        "(reported)",
        True,
        f"CPU time per rank at CP 2 {ranks('cpu', 1, '.2f')} s/step, at CP 1 {one['cpu']:.2f} s/step "
        f"(wall, rank 0's log: {two[0]['wall']:.2f} vs {one['wall']:.2f}; best of steps {CP_STEADY_FROM + 1}-"
        f"{CP_STEADY_FROM + CP_WINDOWS}, one thread per process)",
        {"cp_1": one, "cp_2": two},
    )
