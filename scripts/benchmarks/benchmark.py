"""Performance figures of the trainer, each a ratio of two things measured side by side in one run.

    .venv/bin/python scripts/benchmarks/benchmark.py [--out results.json] [--threads 1]
        [--only context_parallel]

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
| CP attention work | block_causal: the busiest rank's attention work / the idlest's, CP 4, 8, 128K | <= 1.3 |
| MLA CP 2 gathered bytes | DeepSeek-V3: per-head K/V bytes all-gathered per layer / latents' | (reported) |
| Gated DeltaNet per token | Qwen3.5's linear-attention layer: time per token at 8K / at 1K tokens | <= 1.3 |
| hybrid step time | Qwen3.5's debug model (3 Gated DeltaNet, 1 attention) / all attention, 8K | (reported) |
| Muon step time | train.py's step time with Muon / with AdamW, 1 process and FSDP 2 | (reported) |

Each part runs in a fresh process (train.py's main() disables GC, compiles, may start process
groups), on the debug model, one process per rank, `--threads` intra-op threads each. train.py's
step time is its own: the `step_time` metrics.jsonl logs for its best window of 4 steps past
the first 8 (the best of 8 windows resists noise from other processes on a shared machine). On
CPU the figures use the CPU time of the measuring process over the same windows (other processes
on the cores stretch wall time, not CPU time; on a quiet machine the two agree), with wall time
printed beside. The hand-written loop runs in the same process as train.py, before and after
it, timed the same way, on the same model, batch and optimizer, with one fixed batch and torch's
own clip_grad_norm_.
The checkpoint figure comes from scripts/benchmarks/checkpoint.py (a 134M-parameter model); the
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
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
# Run as a program, this folder is on sys.path: the repository root takes its place, so that the modules
# here are the package's (scripts.benchmarks.data), never top-level ones (data).
sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p).resolve() != ROOT / "scripts" / "benchmarks")]

# One module per group of rows, each with the parts it runs in fresh processes and the rows it adds.
from scripts.benchmarks import (  # noqa: E402
    attention,
    checkpoint,
    context_parallel,
    data,
    linear_attention,
    memory,
    moe,
    optimizer,
    step,
)
from scripts.benchmarks.step import CLOCK, LOG_FREQ, ON_GPU, STEADY_FROM, TRAIN_ARGS, WINDOWS  # noqa: E402
from torchtitan.config.parser import parse_args  # noqa: E402

PARTS: dict[str, Callable[[str], dict]] = {
    "overhead": step.part_overhead,
    "compile": step.part_compile,
    "data": data.part_data,
    "data_sharding": data.part_data_sharding,
    "data_streaming": data.part_data_streaming,
    "pretokenized": data.part_pretokenized,
    "checkpoint": checkpoint.part_checkpoint,
    "fsdp_memory": memory.part_fsdp_memory,
    "chunked_loss": memory.part_chunked_loss,
    "moe": moe.part_moe,
    "moe_layer": moe.part_moe_layer,
    "moe_all_to_all": moe.part_moe_all_to_all,
    "deepseek_v3": moe.part_deepseek_v3,
    "context_parallel": context_parallel.part_context_parallel,
    "mla_gather": context_parallel.part_mla_gather,
    "attention_mask": attention.part_attention_mask,
    "linear_attention": linear_attention.part_linear_attention,
    "adamw": optimizer.part_adamw,
    "muon": optimizer.part_muon,
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
    print(f"  part {name} on {nproc} process{'es' if nproc > 1 else ''}...", end="", flush=True)
    start = time.perf_counter()
    with open(os.path.join(tmp, f"{name}-{nproc}.log"), "w") as log:
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    print(f" {time.perf_counter() - start:.0f} s", flush=True)
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

    def part(name: str, nproc: int = 1, cpu: bool = False) -> dict:
        return run_part(name, tmp, threads, nproc, cpu)

    print(f"Setup: {json.dumps(setup)}", flush=True)
    if only is not None:
        ROWS[only](part, add)
        return {"setup": setup, "figures": figures}
    setup["clock"] = f"{CLOCK} time" + ("" if ON_GPU else " of the measuring process (wall time in brackets)")
    overhead = step.overhead_rows(part, add)
    memory.fsdp_memory_rows(part, add)
    checkpoint.checkpoint_rows(part, add)
    data.data_rows(part, add, trained=overhead["train"])
    step.compile_rows(part, add)
    memory.chunked_loss_rows(part, add)
    moe.moe_rows(part, add)
    context_parallel.context_parallel_rows(part, add)
    context_parallel.cp_balance_rows(part, add)
    context_parallel.mla_gather_rows(part, add)
    attention.attention_mask_rows(part, add)
    linear_attention.linear_attention_rows(part, add)
    optimizer.optimizer_rows(part, add)
    return {"setup": setup, "figures": figures}


# The groups of rows `--only` measures alone.
ROWS = {
    "context_parallel": context_parallel.context_parallel_rows,
    "cp_balance": context_parallel.cp_balance_rows,
    "mla_gather": context_parallel.mla_gather_rows,
    "moe": moe.moe_rows,
    "attention_mask": attention.attention_mask_rows,
    "linear_attention": linear_attention.linear_attention_rows,
    "optimizer": optimizer.optimizer_rows,
}


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
