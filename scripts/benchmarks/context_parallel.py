"""benchmark.py's context-parallel rows: a rank's peak memory and step time on one long sequence
at CP 2 (2 gloo ranks) against CP 1, on the CPU whatever the device (`--only context_parallel`)."""

import math
import os
from collections.abc import Callable

import torch

from scripts.benchmarks.step import train_step_time

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


# Packed documents' lengths for the balance rows: log-normal (a few long documents do most of the
# attention work, which grows with the square of a document's length), web text's (median 700 tokens)
# and a long-context mixture's (median 8K), in 128K-token windows as train_configs/llama3_8b_128k.toml.
BALANCE_SEQ_LEN = 131072
BALANCE_LENGTHS = {"web text, median 700 tokens": 700, "long documents, median 8K tokens": 8000}
BALANCE_WINDOWS = 200


def attention_work(document_ids: torch.Tensor, positions: torch.Tensor) -> int:
    """block_causal attention work of the queries at `positions`: the keys each sees, summed."""
    from torchtitan.models.documents import document_positions

    return int((document_positions(document_ids) + 1)[:, positions].sum())


def packed_document_ids(seq_len: int, median: float, generator: torch.Generator) -> torch.Tensor:
    """(1, seq_len) document ids of a window of documents of log-normal lengths (sigma 1.2)."""
    lengths = torch.empty(0, dtype=torch.long)
    while lengths.sum() < seq_len:
        more = torch.empty(64).log_normal_(math.log(median), 1.2, generator=generator).long().clamp(min=1)
        lengths = torch.cat([lengths, more])
    ids = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    return ids[None, :seq_len]


def cp_balance_rows(run_part: Callable[..., dict], add: Callable[..., None]) -> None:
    """block_causal under context parallelism: the attention work of the busiest rank over the idlest,
    with head-tail chunks (as causal has them) and with the pieces dealt out by their work
    (context_parallel.sequence_layouts), over windows of packed documents; computed, nothing run."""
    from torchtitan.parallelisms.context_parallel import layout_positions, sequence_layouts

    for cp in (4, 8):
        for name, median in BALANCE_LENGTHS.items():
            generator = torch.Generator().manual_seed(0)
            ratios: dict[str, list[float]] = {"head-tail": [], "dealt": []}
            for _ in range(BALANCE_WINDOWS):
                ids = packed_document_ids(BALANCE_SEQ_LEN, median, generator)
                for kind, document_ids in (("head-tail", None), ("dealt", ids)):
                    layout = sequence_layouts(BALANCE_SEQ_LEN, cp, document_ids)[0]
                    work = [attention_work(ids, layout_positions(layout, r)) for r in range(cp)]
                    ratios[kind].append(max(work) / min(work))
            mean = {kind: sum(r) / len(r) for kind, r in ratios.items()}
            p95 = {kind: float(torch.tensor(r).quantile(0.95)) for kind, r in ratios.items()}
            add(
                f"CP {cp} attention work, busiest / idlest rank, {name}",
                mean["dealt"],
                "<= 1.3",
                mean["dealt"] <= 1.3,
                f"mean over {BALANCE_WINDOWS} windows of {BALANCE_SEQ_LEN} tokens (95th percentile): dealt "
                f"pieces {mean['dealt']:.3f} ({p95['dealt']:.3f}), head-tail chunks {mean['head-tail']:.3f} "
                f"({p95['head-tail']:.3f}); log-normal lengths, sigma 1.2",
                {"mean": mean, "p95": p95},
            )
