"""Performance figures of the trainer, each a ratio of two things measured side by side in one run.

    python scripts/benchmark.py [--out results.json] [--threads 1] [--only context_parallel]

| figure | ratio | goal |
| --- | --- | --- |
| framework overhead | train.py's steady step time / a minimal hand-written loop's | <= 1.05 |
| FSDP memory scaling | per-rank parameter + gradient + optimizer bytes at world size 4 / at 1 | <= 0.30 |
| checkpoint | training time blocked by an async save / by a sync save | <= 0.15 |
| data pipeline | tokens/s the loader delivers / tokens/s train.py consumes | >= 20 |
| data tokenized | tokens a rank tokenizes / tokens it trains on, simulated DP 1, 8, 64 (worst) | <= 1.25 |
| data at scale | one rank's loader tokens/s at simulated DP 64 / at DP 1 | >= 0.8 |
| streaming data at scale | the same, on a streaming source of 256 local files | >= 0.8 |
| pre-tokenized loader | one rank's memory-mapped loader tokens/s, in order or shuffled (worst) | >= 5M |
| pretokenize | scripts/pretokenize.py's tokens/s with 2 workers / with 1 | > 1 |
| compile | train.py's steady step time compiled / eager | < 1 |
| chunked-loss memory | a step's peak memory with / without training.loss_chunk_tokens | saves >= logits |
| chunked-loss step time | that step's time with / without training.loss_chunk_tokens | (reported) |
| MoE step time | Qwen3-MoE debug model's step time / a dense Qwen3's of the same active parameters | <= 1.5 |
| MoE all-to-all share | time in the all-to-all token exchange / step time, at EP 2 on 2 ranks | (reported) |
| context-parallel memory | a rank's peak memory on a 4096-token sequence, CP 2 (2 ranks) / CP 1 | <= 0.6 |
| context-parallel step time | a rank's step CPU time on that sequence at CP 2 / CP 1 | (reported) |

Each part runs in a fresh process (train.py's main() disables GC, compiles, may start process
groups), on the debug model, one process per rank, `--threads` intra-op threads each. train.py's
step time is its own: the `step_time` metrics.jsonl logs for its best window of 4 steps past
the first 8 (the best of 8 windows resists noise from other processes on a shared machine). On
CPU the figures use the CPU time of the measuring process over the same windows (other processes
on the cores stretch wall time, not CPU time; on a quiet machine the two agree), with wall time
printed beside. The hand-written loop runs in the same process as train.py, before and after
it, timed the same way, on the same model, batch and optimizer, with one fixed batch and torch's
own clip_grad_norm_.
The checkpoint figure comes from scripts/benchmark_checkpoint.py (a 134M-parameter model); the
chunked-loss figures from the trainer's TrainStep on the debug model with a 128256-token vocabulary
on 2 x 2048 tokens in fp32, peaks as scripts/estimate_memory.py --measure takes them. The MoE
all-to-all share profiles train.py on the Qwen3-MoE debug recipe at EP 2 on 2 gloo ranks (CPU, also
on a GPU machine), in wall time. The context-parallel figures run train.py on the CPU (also on a GPU
machine) on one sequence of 4096 tokens (batch 1, fp32: activations, which CP splits, are most of the
peak), in 1 process (CP 1) and in 2 gloo ranks (CP 2, FSDP over both), the same global batch. A
rank's peak is over train.py's second step, as scripts/estimate_memory.py --measure takes it on CPU
(the CPU allocator's bytes from the profiler's memory events, the model built under the profiler);
the larger rank's counts. Step times are the best of steps 4-6, with the profiler stopped, in CPU
time (the slower rank's at CP 2). With one thread per process, CP 2's ratio is the share of the
sequence's work a rank does, 0.5 without overhead; on 2 otherwise idle cores the step's wall time
would shrink about as much, plus the time the ranks wait for each other.
`--only context_parallel` measures those two figures alone.
Takes a few minutes on 2 CPU cores; on a GPU machine it runs on the GPU.
"""

import argparse
import json
import os
import platform
import runpy
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_post_hook

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "scripts"))
import benchmark_memory  # noqa: E402

from torchtitan.config.parser import parse_args  # noqa: E402

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
LOSS_CHUNK_TOKENS = 1024  # training.loss_chunk_tokens of the chunked-loss figures
LOG_FREQ = 4  # steps per timed window
STEADY_FROM = 2 * LOG_FREQ  # windows after this step are steady (compilation and warmup are over)
WINDOWS = 8  # steady windows timed per run; the best one counts, as other processes add noise


ON_GPU = torch.cuda.is_available()


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
    """a / b in wall time on a GPU; on CPU in CPU time, which other processes sharing the cores
    barely change (a single-threaded CPU step's wall time is its CPU time on a quiet machine)."""
    clock = "wall" if ON_GPU else "cpu"
    return a[clock] / b[clock]


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


def loader_rate(batches, seconds: float) -> dict:
    """Tokens/s (wall and CPU clocks) the iterator delivers over `seconds`."""
    count, wall, cpu = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - wall < seconds:
        inputs, _ = next(batches)
        count += inputs.numel()
    return {"wall": count / (time.perf_counter() - wall), "cpu": count / (time.process_time() - cpu)}


def part_data(tmp: str, seconds: float = 5.0) -> dict:
    """Tokens/s of the loader alone, past its first batch (dataset loading)."""
    from torchtitan.datasets.build import DataSource, build_dataset
    from torchtitan.datasets.layout import BatchLayout
    from torchtitan.datasets.loader import DataLoader
    from torchtitan.datasets.tokenizer import build_tokenizer

    job_config = parse_args(TRAIN_ARGS)
    t = job_config.training
    tokenizer = build_tokenizer(ROOT / job_config.model.tokenizer_path)
    dataset = build_dataset(
        DataSource(t.dataset, t.dataset_path), tokenizer, t.seq_len, BatchLayout(t.batch_size)
    )
    batches = iter(DataLoader(dataset, t.batch_size))
    next(batches)
    return loader_rate(batches, seconds)


def part_data_sharding(tmp: str, steps: int = 200, seconds: float = 3.0) -> dict:
    """Rank 0's loader at simulated DP degrees (its loader only; the other ranks' are not built): tokens
    tokenized per token yielded over its first `steps` batches, then its tokens/s."""
    from torchtitan.datasets.build import DataSource, build_dataset
    from torchtitan.datasets.layout import BatchLayout
    from torchtitan.datasets.loader import DataLoader
    from torchtitan.datasets.tokenizer import build_tokenizer

    job_config = parse_args(TRAIN_ARGS)
    t = job_config.training
    tokenizer = build_tokenizer(ROOT / job_config.model.tokenizer_path)

    class Counting:
        count = 0

        def encode(self, s: str, bos: bool, eos: bool) -> list[int]:
            ids = tokenizer.encode(s, bos=bos, eos=eos)
            self.count += len(ids)
            return ids

    result = {}
    for dp in (1, 8, 64):
        counting = Counting()
        layout = BatchLayout(t.batch_size, dp, 0)
        dataset = build_dataset(DataSource(t.dataset, t.dataset_path), counting, t.seq_len, layout)
        batches = iter(DataLoader(dataset, t.batch_size))
        trained = sum(next(batches)[0].numel() for _ in range(steps))
        result[dp] = {"tokenized_per_trained": counting.count / trained, **loader_rate(batches, seconds)}
    return result


def part_data_streaming(tmp: str, files: int = 256, copies: int = 16, seconds: float = 5.0) -> dict:
    """Rank 0's loader at simulated DP 1 and 64 on a local streaming source of `files` jsonl files (the
    corpus `copies` times over, its documents dealt in turn to the files), the code path of a streaming hub
    dataset such as C4: tokens/s past its first batch."""
    import datasets

    from torchtitan.datasets.loader import DataLoader
    from torchtitan.datasets.sources import load_text_dataset
    from torchtitan.datasets.text import TextDataset
    from torchtitan.datasets.tokenizer import build_tokenizer

    job_config = parse_args(TRAIN_ARGS)
    t = job_config.training
    tokenizer = build_tokenizer(ROOT / job_config.model.tokenizer_path)
    texts = list(load_text_dataset(t.dataset, t.dataset_path)["text"]) * copies
    paths = [Path(tmp, f"shard-{f:05d}.jsonl") for f in range(files)]
    for f, path in enumerate(paths):
        path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts[f::files]))
    result = {"files": files, "documents": len(texts)}
    for dp in (1, 64):
        ds = datasets.load_dataset("json", data_files=[str(p) for p in paths], split="train", streaming=True)
        dataset = TextDataset(t.dataset, ds, tokenizer, t.seq_len, t.batch_size, dp, 0)
        batches = iter(DataLoader(dataset, t.batch_size))
        next(batches)
        result[dp] = loader_rate(batches, seconds)
    return result


def part_pretokenized(tmp: str, seconds: float = 3.0) -> dict:
    """Pretokenize the corpus 16 times over (18M tokens: on the corpus once, 0.4 s of work, starting the
    worker processes dominates) with 1 and 2 workers, 1,024 documents per shard (tokens/s, wall time: the
    workers are other processes), then the tokens/s of rank 0's memory-mapped loader at simulated DP 8,
    in order and shuffled."""
    from torchtitan.datasets.build import DataSource, build_dataset
    from torchtitan.datasets.layout import BatchLayout
    from torchtitan.datasets.loader import DataLoader
    from torchtitan.datasets.pretokenized import pretokenize
    from torchtitan.datasets.sources import load_text_dataset
    from torchtitan.datasets.tokenizer import build_tokenizer

    job_config = parse_args(TRAIN_ARGS)
    t = job_config.training
    path = str(ROOT / job_config.model.tokenizer_path)
    tokenizer = build_tokenizer(path)
    ds = load_text_dataset(t.dataset, t.dataset_path)
    result = {}
    for workers in (1, 2):
        output = Path(tmp, f"pretokenized-{workers}")
        start = time.perf_counter()
        texts = (batch["text"] for _ in range(16) for batch in ds.iter(batch_size=1024))
        manifest = pretokenize(texts, path, tokenizer.n_words, output, workers, {"dataset": t.dataset})
        result[f"pretokenize_{workers}"] = manifest["num_tokens"] / (time.perf_counter() - start)
    for order, shuffle in (("in_order", False), ("shuffled", True)):
        source = DataSource(t.dataset, str(output), shuffle=shuffle)
        dataset = build_dataset(source, tokenizer, t.seq_len, BatchLayout(t.batch_size, 8, 0))
        batches = iter(DataLoader(dataset, t.batch_size))
        next(batches)
        result[order] = loader_rate(batches, seconds)
    return result


def part_checkpoint(tmp: str) -> dict:
    sys.path.insert(0, str(ROOT / "scripts"))
    import benchmark_checkpoint
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    folder = os.path.join(tmp, "checkpoint")
    sync = benchmark_checkpoint.run(mode="disabled", folder=folder + "_sync", saves=3, device=device)
    async_ = benchmark_checkpoint.run(mode="async", folder=folder + "_async", saves=3, device=device)
    dist.destroy_process_group()
    # The first async save also starts the background writer: the later ones are the steady state.
    sync_s, async_s = sum(sync) / len(sync), sum(async_[1:]) / len(async_[1:])
    return {"value": async_s / sync_s, "sync_blocked_s": sync, "async_blocked_s": async_}


def part_fsdp_memory(tmp: str) -> dict:
    return benchmark_memory.fsdp_memory(TRAIN_ARGS)


MOE_ARGS = ["--model.name", "qwen3_moe", "--model.tokenizer_path", "assets/tokenizer/kjv_bpe_hf"]


def part_moe(tmp: str) -> dict:
    """The Qwen3-MoE debug model (a dense layer of 768 hidden units, then 3 sparse layers whose tokens
    each take 2 experts of 256) vs a dense Qwen3 with the same active parameters (4 layers of 576
    hidden units; the routers' 6k weights aside), in the same minimal loop, on its recipe's batch."""
    from torchtitan.models.qwen3 import qwen3_configs

    dense_args = replace(qwen3_configs["debugmodel"], n_layers=4, hidden_dim=(768 + 3 * 2 * 256) // 4)
    dense_extra = ["--model.name", "qwen3", "--model.tokenizer_path", "assets/tokenizer/kjv_bpe_hf"]
    batch = ["--training.batch_size", "8", "--training.seq_len", "256"]  # qwen3_moe_debug.toml's
    moe = reference_step_time([*MOE_ARGS, *batch])
    dense = reference_step_time([*dense_extra, *batch], model_args=dense_args)
    return {"value": step_ratio(moe, dense), "moe": moe, "dense": dense}


MOE_EP_ARGS = [
    "--job.config_file",
    str(ROOT / "train_configs" / "qwen3_moe_debug.toml"),
    "--checkpoint.enable_checkpoint",
    "false",
    "--validation.enable",
    "false",
    "--parallelism.data_parallel_shard_degree",
    "2",
    "--parallelism.expert_parallel_degree",
    "2",
]
PROFILED_STEPS = 8  # steady steps profiled by the all-to-all part
FUNCOL = "_c10d_functional::"  # torch's functional collectives, as the profiler names their ops


def all_to_all_exchanges(events: list) -> list[float]:
    """Microseconds spent in each of the experts' all-to-alls among `events` (one thread's profiler
    events, in start order): a funcol all_to_all_single (its launch, in forward or in an autograd
    backward), then the funcol waits and autograd wrapping that follow it up to the next functional
    collective's launch. Expert parallelism waits for each all-to-all's result before launching
    another collective, so those waits are its; FSDP's collectives are c10d's own ops, not funcol's."""
    exchanges: list[float] = []
    launched, counted_until = "", 0.0
    for event in events:
        if not event.name.startswith(FUNCOL):
            continue
        op = event.name.removeprefix(FUNCOL)
        if op not in ("wait_tensor", "_wrap_tensor_autograd"):
            launched = op
            if op == "all_to_all_single":
                exchanges.append(0.0)
        if launched == "all_to_all_single" and event.time_range.start >= counted_until:  # not nested
            exchanges[-1] += event.time_range.elapsed_us()
            counted_until = event.time_range.end
    return exchanges


def part_moe_all_to_all(tmp: str) -> dict:
    """Share of an expert-parallel step spent in the all-to-all token exchange: train.py on the
    Qwen3-MoE debug recipe at EP 2 (2 FSDP ranks), each rank profiled over PROFILED_STEPS steady
    steps (from one optimizer step to the next), in wall time, as waiting for the other rank's tokens
    is part of the exchange's cost. The ranks make the same exchanges in the same order; the one that
    arrives last at an exchange blocks the least, for the exchange itself (`exchange_ms`): the rest
    of a rank's time in it is waiting for that rank."""
    import torch.distributed as dist

    profiler = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU],
        schedule=torch.profiler.schedule(wait=STEADY_FROM - 1, warmup=1, active=PROFILED_STEPS, repeat=1),
    )
    argv = [*MOE_EP_ARGS, "--training.steps", str(STEADY_FROM + PROFILED_STEPS)]
    with profiler:
        run_train([*argv, "--job.dump_folder", os.path.join(tmp, "moe_ep")], profiler.step)
    steps = [e for e in profiler.events() if e.name.startswith("ProfilerStep")]  # "ProfilerStep*"
    assert len(steps) == PROFILED_STEPS, [e.name for e in steps]
    loop = sorted(
        (e for e in profiler.events() if e.thread == steps[0].thread), key=lambda e: e.time_range.start
    )
    mine = (sum(e.time_range.elapsed_us() for e in steps) / 1e3 / PROFILED_STEPS, all_to_all_exchanges(loop))
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    dist.barrier()  # no rank tears gloo down while another still reads from it
    dist.destroy_process_group()
    ranks = [
        {"step_ms": step_ms, "all_to_all_ms": sum(ex) / 1e3 / PROFILED_STEPS, "exchanges": len(ex)}
        for step_ms, ex in gathered
    ]
    assert len({len(ex) for _, ex in gathered}) == 1, "the ranks' exchanges differ"
    exchange_ms = sum(map(min, zip(*(ex for _, ex in gathered)))) / 1e3 / PROFILED_STEPS
    mean_step_ms = sum(r["step_ms"] for r in ranks) / len(ranks)
    return {
        "value": sum(r["all_to_all_ms"] / r["step_ms"] for r in ranks) / len(ranks),
        "ranks": ranks,
        "exchange_ms": exchange_ms,
        "exchange_share": exchange_ms / mean_step_ms,
        "load_average": os.getloadavg()[0],
    }


def part_chunked_loss(tmp: str) -> dict:
    return benchmark_memory.chunked_loss(TRAIN_ARGS, LOSS_CHUNK_TOKENS)


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


PARTS = {
    "overhead": part_overhead,
    "compile": part_compile,
    "data": part_data,
    "data_sharding": part_data_sharding,
    "data_streaming": part_data_streaming,
    "pretokenized": part_pretokenized,
    "checkpoint": part_checkpoint,
    "fsdp_memory": part_fsdp_memory,
    "chunked_loss": part_chunked_loss,
    "moe": part_moe,
    "moe_all_to_all": part_moe_all_to_all,
    "context_parallel": part_context_parallel,
}


def run_part(name: str, tmp: str, threads: int, nproc: int = 1, cpu: bool = False) -> dict:
    """Run one part in fresh process(es), on the CPU alone if `cpu` (GPUs hidden); its train.py logs
    go to {tmp}/{name}-{nproc}.log."""
    result = os.path.join(tmp, f"{name}-{nproc}.json")
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT))
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
        launcher += ["--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0"]
    cmd = [*launcher, __file__, "--part", name, "--tmp", tmp, "--result", result]
    with open(os.path.join(tmp, f"{name}-{nproc}.log"), "w") as log:
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(
            f"benchmark part {name} failed; see {log.name}:\n" + Path(log.name).read_text()[-3000:]
        )
    return json.loads(Path(result).read_text())


def add_figure(
    figures: list[dict], name: str, value: float, goal: str, ok: bool, detail: str, data: dict
) -> None:
    figures.append({"figure": name, "value": value, "goal": goal, "met": ok, "detail": detail, **data})
    print(f"  {name}: {value:.3f} ({detail})", flush=True)


def context_parallel_figures(tmp: str, threads: int, add: Callable[..., None]) -> None:
    """The context-parallel rows: the part in 1 process (CP 1) and in 2 (CP 2), on the CPU, in CPU
    time whatever the device (the worst rank of the two counts)."""
    one = run_part("context_parallel", tmp, threads, cpu=True)["ranks"][0]
    two = run_part("context_parallel", tmp, threads, 2, cpu=True)["ranks"]

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


def run_all(threads: int, tmp: str, only: str | None = None) -> dict:
    """Every figure, or only those of one group of rows (`ROWS`)."""
    job_config = parse_args(TRAIN_ARGS)
    t = job_config.training
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"{os.cpu_count()} CPU cores"
    setup = {
        "device": device,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads_per_process": threads,
        "model": f"{job_config.model.name} {job_config.model.flavor}",
        "batch": f"{t.batch_size} x {t.seq_len} tokens, {t.mixed_precision_param}",
        "timing": f"best of {WINDOWS} windows of {LOG_FREQ} steps, after {STEADY_FROM} warmup steps",
    }
    figures: list[dict] = []

    def add(name: str, value: float, goal: str, ok: bool, detail: str, data: dict) -> None:
        add_figure(figures, name, value, goal, ok, detail, data)

    print(f"Setup: {json.dumps(setup)}", flush=True)
    if only is not None:
        ROWS[only](tmp, threads, add)
        return {"setup": setup, "figures": figures}
    clock = "wall" if ON_GPU else "cpu"
    setup["clock"] = f"{clock} time" + ("" if ON_GPU else " of the measuring process (wall time in brackets)")

    def ms(step: dict) -> str:
        return f"{1e3 * step[clock]:.1f} ms/step ({1e3 * step['wall']:.1f})"

    o = run_part("overhead", tmp, threads)
    add(
        "framework overhead",
        o["value"],
        "<= 1.05",
        o["value"] <= 1.05,
        f"train.py {ms(o['train'])} vs hand-written loop, best of before/after: "
        + ", ".join(ms(r) for r in o["reference"]),
        o,
    )

    one, four = (
        run_part("fsdp_memory", tmp, threads)["ranks"],
        run_part("fsdp_memory", tmp, threads, 4)["ranks"],
    )
    total = [sum(r.values()) for r in four]
    ratio = max(total) / sum(one[0].values())
    add(
        "FSDP memory scaling",
        ratio,
        "<= 0.30",
        ratio <= 0.30,
        f"largest rank of 4 holds {max(total) / 2**20:.2f} MiB of params+grads+optimizer state, "
        f"1 rank {sum(one[0].values()) / 2**20:.2f} MiB",
        {"world_size_1": one, "world_size_4": four},
    )

    c = run_part("checkpoint", tmp, threads)
    add(
        "checkpoint",
        c["value"],
        "<= 0.15",
        c["value"] <= 0.15,
        f"async save blocks {1e3 * sum(c['async_blocked_s'][1:]) / len(c['async_blocked_s'][1:]):.0f} ms, "
        f"sync {1e3 * sum(c['sync_blocked_s']) / len(c['sync_blocked_s']):.0f} ms "
        "(134M-param model + AdamW; async steady state, past the first save)",
        c,
    )

    d = run_part("data", tmp, threads)
    consumed = o["train"]["tokens"] / o["train"][clock]
    ratio = d[clock] / consumed
    add(
        "data pipeline",
        ratio,
        ">= 20",
        ratio >= 20,
        f"loader {d[clock]:,.0f} tokens/s ({d['wall']:,.0f}), train.py consumes {consumed:,.0f}",
        d,
    )

    ds = run_part("data_sharding", tmp, threads)
    tokenized = {dp: r["tokenized_per_trained"] for dp, r in ds.items()}
    add(
        "data tokenized",
        max(tokenized.values()),
        "<= 1.25",
        max(tokenized.values()) <= 1.25,
        "per trained token at DP " + ", ".join(f"{dp}: {v:.3f}" for dp, v in tokenized.items()),
        ds,
    )
    scale = ds["64"][clock] / ds["1"][clock]
    add(
        "data at scale",
        scale,
        ">= 0.8",
        scale >= 0.8,
        f"one rank's loader at DP 64 {ds['64'][clock]:,.0f} tokens/s ({ds['64']['wall']:,.0f}), "
        f"at DP 1 {ds['1'][clock]:,.0f} ({ds['1']['wall']:,.0f})",
        ds,
    )

    st = run_part("data_streaming", tmp, threads)
    scale = st["64"][clock] / st["1"][clock]
    add(
        "streaming data at scale",
        scale,
        ">= 0.8",
        scale >= 0.8,
        f"one rank's loader at DP 64 {st['64'][clock]:,.0f} tokens/s ({st['64']['wall']:,.0f}), "
        f"at DP 1 {st['1'][clock]:,.0f} ({st['1']['wall']:,.0f}); {st['documents']:,} documents streamed "
        f"from {st['files']} local jsonl files",
        st,
    )

    p = run_part("pretokenized", tmp, threads)
    rate = min(p["in_order"][clock], p["shuffled"][clock])
    add(
        "pre-tokenized loader",
        rate,
        ">= 5M",
        rate >= 5e6,
        f"one rank's loader {p['in_order'][clock]:,.0f} tokens/s ({p['in_order']['wall']:,.0f}) in order, "
        f"{p['shuffled'][clock]:,.0f} ({p['shuffled']['wall']:,.0f}) shuffled",
        p,
    )
    speedup = p["pretokenize_2"] / p["pretokenize_1"]
    add(
        "pretokenize",
        speedup,
        "> 1",
        speedup > 1,
        f"{p['pretokenize_1']:,.0f} tokens/s with 1 worker, {p['pretokenize_2']:,.0f} with 2 (wall time)",
        p,
    )

    k = run_part("compile", tmp, threads)
    add(
        "compile",
        k["value"],
        "< 1 (faster)",
        k["value"] < 1,
        f"compiled {ms(k['compiled'])}, eager {ms(k['eager'])}",
        k,
    )

    m = run_part("chunked_loss", tmp, threads)
    unfused, chunked = m["unfused"]["peak"], m["chunked"]["peak"]
    add(
        "chunked-loss memory",
        chunked / unfused,
        "saves >= logits",
        unfused - chunked >= m["logits_bytes"],
        f"peak {chunked / 2**30:.2f} GiB with {LOSS_CHUNK_TOKENS}-token chunks, {unfused / 2**30:.2f} GiB "
        f"without: saves {(unfused - chunked) / 2**30:.2f} GiB, the fp32 logits are "
        f"{m['logits_bytes'] / 2**30:.2f} GiB (2 x 2048 tokens, vocabulary 128256)",
        m,
    )
    add(
        "chunked-loss step time",
        step_ratio(m["chunked"], m["unfused"]),
        "(reported)",
        True,
        f"chunked {ms(m['chunked'])}, unfused {ms(m['unfused'])}",
        m,
    )
    e = run_part("moe", tmp, threads)
    add(
        "MoE step time",
        e["value"],
        "<= 1.5",
        e["value"] <= 1.5,
        f"Qwen3-MoE debugmodel {ms(e['moe'])}, dense Qwen3 of the same active parameters "
        f"{ms(e['dense'])} (a hand-written loop, one process)",
        e,
    )
    a = run_part("moe_all_to_all", tmp, threads, 2, cpu=True)  # gloo: the profile is host time
    add(
        "MoE all-to-all share",
        a["value"],
        "(reported)",
        True,
        "Qwen3-MoE debugmodel, EP 2 on 2 FSDP ranks (CPU, gloo), 8 x 256 tokens each, train.py profiled "
        "(wall time): "
        + ", ".join(
            f"rank {i} {r['all_to_all_ms']:.1f} of {r['step_ms']:.1f} ms/step"
            for i, r in enumerate(a["ranks"])
        )
        + f"; the exchange itself (the later rank's time) {a['exchange_ms']:.1f} ms/step, "
        f"{a['exchange_share']:.1%} of a step; the rest is waiting for the other rank",
        a,
    )
    context_parallel_figures(tmp, threads, add)
    return {"setup": setup, "figures": figures}


ROWS = {"context_parallel": context_parallel_figures}  # the groups of rows `--only` measures alone


def print_table(results: dict) -> None:
    print("\nSetup: " + ", ".join(f"{k}: {v}" for k, v in results["setup"].items()))
    name = max(len("figure"), *(len(f["figure"]) for f in results["figures"]))
    goal = max(len("goal"), *(len(f["goal"]) for f in results["figures"]))
    print(f"{'figure':<{name}} {'value':>8}  {'goal':<{goal}} {'met':<4} detail")
    for f in results["figures"]:
        met = "yes" if f["met"] else "NO"
        print(f"{f['figure']:<{name}} {f['value']:8.3f}  {f['goal']:<{goal}} {met:<4} {f['detail']}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", help="write the figures and their raw measurements to this JSON file")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    parser.add_argument("--only", choices=list(ROWS), help="measure only this group of rows")
    parser.add_argument("--part", choices=list(PARTS), help=argparse.SUPPRESS)
    parser.add_argument("--tmp", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.part:  # a worker: measure one part, write its result (rank 0)
        result = PARTS[args.part](args.tmp)
        if int(os.environ.get("RANK", "0")) == 0:
            Path(args.result).write_text(json.dumps(result))
        return
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="titan-benchmark-") as tmp:
        results = run_all(args.threads, tmp, args.only)
    results["seconds"] = time.perf_counter() - start
    print_table(results)
    print(f"({results['seconds']:.0f} s)")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
