"""GPU figures in one run, for a short loan of one H100 or H200: each part in a fresh process, in
priority order, and a part that would not fit in the time left is skipped, so one call of about 8
minutes prints one table (docs/performance.md keeps the figures, with their setup).

    .venv/bin/python scripts/benchmarks/benchmark_gpu.py --out DIR [--budget 480]
        [--only llama1b,moe_grouped_mm]
        [--small]

| part | what |
| --- | --- |
| llama1b | train.py, 1B recipe, 4 x 2048 tokens per optimizer step, full logits (not chunked) |
| torchtitan_1b | the PyPI torchtitan wheel on the same shape, batch, compile and AC (if installed) |
| moe_grouped_mm | a Qwen3-30B-A3B-width expert layer, forward + backward: a grouped GEMM per projection |
|  | vs the per-expert loop, and the values of both vs float32 on the CPU |
| llama8b_4layers | Llama 3 8B's width with 4 layers, 1 x 8192 tokens, compiled |
| llama1b_block_causal | llama1b with block_causal attention (FlexAttention), as the recipe has it |
| attention_block_causal | block_causal attention (FlexAttention, compiled block mask) vs causal SDPA: time |
|  | and memory at 8K and 32K tokens with 8 and 64 documents; values and gradients vs the CPU path in fp32 |
| cp_attention_cuda | context parallel's CUDA attention (SDPA lower-right per chunk; FlexAttention with |
|  | documents) for each CP 2 rank's pieces, in one process: values and gradients vs the CPU path in fp32 |
| cp_compiled_block_causal | CP's attention on a 1-rank mesh, compiled blocks, block_causal: vs no CP |
| cp2_one_gpu | train.py at CP 2, two processes sharing the GPU over gloo, vs one process: fp32, bf16 losses |
| fsdp2_one_gpu | train.py at FSDP 2 the same way, bf16, compiled, blocks gathered in bf16 and in fp32: |
|  | losses, memory, graphs |
| llama1b_muon | llama1b with optimizer.name Muon (bf16 Newton-Schulz) |
| llama1b_chunked_loss | llama1b with training.loss_chunk_tokens 2048, as the recipe has it |
| llama1b_fp8_tensorwise, llama1b_fp8_rowwise | llama1b with float8 linear layers (torchao) |
| qwen3_moe_2layers | Qwen3-30B-A3B's width with 2 layers, 2 x 4096 tokens, compiled |
| host_syncs | the host-device syncs of each step (CUDA's sync debug mode), Qwen3-MoE debug recipe |
| deepseek_v3_671b_width | our DeepSeek-V3 at the 671B flavour's width, 2 layers (1 dense, 1 MoE; 32 experts |
|  | on an H200, 16 on an H100), 1 x 4096 tokens, bf16, compiled, then torchtitan 0.3.0's deepseek_v3 |
|  | at the same shape and routing (compare_torchtitan, TT_MODEL=dsv3): tokens/s, MFU on active |
|  | parameters, memory, graphs, ours / torchtitan |
| mla_attention | MLA's Attention module (671B width, 4096 tokens) forward + backward, eager and compiled, |
|  | against causal SDPA on its head dims (qk 192, v 128, 128 heads) per backend, and v padded to 192 |
| mfu_levers_1b | llama1b with one lever at a time, ratios to llama1b: SDPA's cuDNN backend alone, |
|  | 2 x 4096 tokens a step, inductor's coordinate_descent_tuning, the chunked loss |
| chat_vs_pretrain | the 1B recipe (block_causal, chunked loss) on packed conversations (kjv_chat) |
|  | vs pre-training text (kjv) at 4 x 2048 tokens a step |

A train.py part reports its last logged window (steps 21-30): tokens/s per GPU, MFU and the peak
memory the CUDA allocator reserved, as train.py's own log line computes them, plus the graphs
dynamo compiled (unique graphs, graph breaks). Each part is a function of `gpu_train.py`,
`gpu_kernels.py` or `gpu_parallel.py`, run in a process of its own; SIGTERM or Ctrl-C stops the
running one with every process it started. `--small` runs every part on tiny shapes on whatever
device there is, CPU included: a check of the script before a loan, not a figure; without it, a
machine without CUDA is refused at once (one line, exit code 2). Check it under the device machine's
torch too (2.11): `python -m venv V && V/bin/pip install torch==2.11.0 numpy tomli tiktoken datasets
tokenizers safetensors` (PyPI's CUDA build, about 5 GB, runs on the CPU), then
`PYTHONPATH=. V/bin/python scripts/benchmarks/benchmark_gpu.py --small --out DIR`.

The last four parts run their variants one after the other in one process (gpu_recipes.py's
side_by_side: dynamo reset between them), each row with its ratio to the first. Next loan (issue 60),
one call of about 9 minutes (estimates 90 + 150 + 240 + 40 = 520 s), after bringing the wheels
here, once (`.whl/` is git-ignored: the call carries it):

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 -d .whl torchtitan==0.3.0 tyro==1.0.17 docstring_parser==0.18.0 \
        typeguard==4.6.1 torchdata==0.11.0 spmd_types==0.2.3 datasets==5.2.0 dill==0.4.1 \
        multiprocess==0.70.19 torchao==0.18.0          # 5.8 MB

    run(carry=[".whl"], timeout_s=590, command=
        "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target
         /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit; PYTHONUNBUFFERED=1 python3
         scripts/benchmarks/benchmark_gpu.py --out $OUT/bench --budget 520
         --only cp2_one_gpu,fsdp2_one_gpu,deepseek_v3_671b_width,mla_attention")

and on a later loan `--only mfu_levers_1b,chat_vs_pretrain --budget 480` (330 + 140 s). Checked with
`--small` on the CPU under torch 2.13; the APIs the new parts use (torch.backends.cuda's
enable_*_sdp, torch.nn.attention.sdpa_kernel and SDPBackend.CUDNN_ATTENTION, inductor's
coordinate_descent_tuning, torch._dynamo.utils.counters) checked present in torch 2.11.0's wheel.
"""

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
# Run as a program, this folder is on sys.path: the repository root takes its place, so that the modules
# here are the package's (scripts.benchmarks.gpu_train), never top-level ones.
sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p).resolve() != ROOT / "scripts" / "benchmarks")]

from scripts.benchmarks import gpu_kernels, gpu_parallel, gpu_recipes, gpu_train  # noqa: E402
from torchtitan.errors import EXIT_BAD_INPUT  # noqa: E402

PARTS = {  # name: (function, estimated seconds on an H100), in priority order
    "llama1b": (gpu_train.part_llama1b, 75),
    "torchtitan_1b": (gpu_train.part_torchtitan_1b, 100),
    "moe_grouped_mm": (gpu_kernels.part_moe_grouped_mm, 30),
    "llama1b_block_causal": (gpu_train.part_llama1b_block_causal, 60),
    "attention_block_causal": (gpu_kernels.part_attention_block_causal, 60),
    "cp_attention_cuda": (gpu_kernels.part_cp_attention_cuda, 30),
    "cp_compiled_block_causal": (gpu_parallel.part_cp_compiled_block_causal, 40),
    "cp2_one_gpu": (gpu_parallel.part_cp2_one_gpu, 90),
    "fsdp2_one_gpu": (gpu_parallel.part_fsdp2_one_gpu, 150),
    "llama1b_muon": (gpu_train.part_llama1b_muon, 75),
    "host_syncs": (gpu_train.part_host_syncs, 30),
    "llama8b_4layers": (gpu_train.part_llama8b_4layers, 70),
    "llama1b_chunked_loss": (gpu_train.part_llama1b_chunked_loss, 50),
    "llama1b_fp8_tensorwise": (gpu_train.part_llama1b_fp8_tensorwise, 70),
    "llama1b_fp8_rowwise": (gpu_train.part_llama1b_fp8_rowwise, 70),
    "qwen3_moe_2layers": (gpu_train.part_qwen3_moe_2layers, 70),
    # Issue 60's, in its order: run with --only (the docstring's command), after cp2/fsdp2 above.
    "deepseek_v3_671b_width": (gpu_recipes.part_deepseek_v3_671b_width, 240),
    "mla_attention": (gpu_kernels.part_mla_attention, 40),
    "mfu_levers_1b": (gpu_recipes.part_mfu_levers_1b, 330),
    "chat_vs_pretrain": (gpu_recipes.part_chat_vs_pretrain, 140),
}


def run_parts(out: Path, names: list[str], budget: float, small: bool) -> dict:
    """Each part in a fresh process (train.py's main() disables GC and compiles), skipped when its
    estimate does not fit in what is left of `budget`, stopped when it runs past it."""
    start, results = time.perf_counter(), {}
    for name in names:
        left = budget - (time.perf_counter() - start)
        if not small and left < PARTS[name][1]:
            results[name] = {"skipped": f"{left:.0f} s left, needs about {PARTS[name][1]} s"}
            continue
        cmd = [sys.executable, __file__, "--part", name, "--out", str(out)] + (["--small"] if small else [])
        log = out / f"{name}.log"
        began = time.perf_counter()
        code = run_part(cmd, log, timeout=max(left, 1))
        result_file = out / f"{name}.json"
        if code == 0 and result_file.exists():
            results[name] = json.loads(result_file.read_text())
        else:
            tail = log.read_text().strip().splitlines()[-3:]
            results[name] = {"failed": f"exit {code}: {' | '.join(tail)[-400:]}"}
        results[name]["part_s"] = round(time.perf_counter() - began, 1)
        (out / "results.json").write_text(json.dumps(results, indent=1))
        print(f"{name}: {json.dumps(results[name])}", flush=True)
    return results


def run_part(cmd: list[str], log: Path, timeout: float) -> int | str:
    """`cmd`'s exit code, or "timeout" once it has run `timeout` seconds. The part runs in a process
    group of its own, killed whole however this call ends (the part done or timed out, or this process
    stopped by SIGTERM or Ctrl-C): a train.py part takes SIGTERM for a preemption and would finish its
    step first, and the two-rank parts and the torchtitan comparison start processes of their own,
    which would outlive it holding the GPU."""
    with open(log, "w") as f:
        part = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return part.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout"
    finally:
        with contextlib.suppress(ProcessLookupError):  # the group is gone: nothing is left of the part
            os.killpg(part.pid, signal.SIGKILL)
        part.wait()


def print_table(results: dict) -> None:
    print("\n| part | tokens/s | MFU % | memory GiB | step ms | graphs (breaks) | part s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, r in results.items():
        if "rows" in r:  # side by side in one process: each row with its ratio to the first
            for variant, row in r["rows"].items():
                if "tps" not in row:
                    print(f"| {name}: {variant} | {json.dumps(row)} | | | | | {r['part_s']} |")
                    continue
                graphs = f"{row['unique_graphs']} ({row['graph_breaks']})"
                tps = f"{row['tps']:,} (x{row.get('tps_ratio', '?')})"
                cells = [tps, row["mfu_pct"], row["memory_gib"], row["step_ms"], graphs, r["part_s"]]
                print(f"| {name}: {variant} | " + " | ".join(map(str, cells)) + " |")
            theirs = r.get("torchtitan_dsv3")
            if theirs is not None:
                cells = (
                    [theirs]
                    if isinstance(theirs, str)
                    else [f"{theirs['tps']:,}", theirs["mfu"], theirs["memory_gib"]]
                )
                print(f"| {name}: torchtitan 0.3.0 | " + " | ".join(map(str, cells)) + " |")
            continue
        if "tps" in r:
            graphs = f"{r['unique_graphs']} ({r['graph_breaks']})"
            cells = [f"{r['tps']:,}", r["mfu_pct"], r["memory_gib"], r["step_ms"], graphs, r["part_s"]]
        elif "torchtitan" in r:
            t = r["torchtitan"]
            cells = [f"{t['tps']:,}", t["mfu"], t["memory_gib"], "", "", r["part_s"]]
        elif "speedup" in r:
            errors = {k: v for k, v in r.items() if k.endswith("_error")}
            what = f"loop {r['loop_ms']} ms, grouped {r['grouped_ms']} ms: x{r['speedup']}; errors {errors}"
            cells = [what, "", "", "", "", r["part_s"]]
        else:
            what = json.dumps({k: v for k, v in r.items() if k != "part_s"})
            cells = [what, "", "", "", "", r.get("part_s", "")]
        print(f"| {name} | " + " | ".join(map(str, cells)) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for each part's log and results.json")
    parser.add_argument("--budget", type=float, default=480, help="seconds for all parts together")
    parser.add_argument("--only", help="comma-separated parts, in the given order")
    parser.add_argument("--small", action="store_true", help="tiny shapes on any device: checks the script")
    parser.add_argument("--part", help=argparse.SUPPRESS)  # one part, in this process
    args = parser.parse_args()
    if not args.small and not torch.cuda.is_available():  # else it would train the 1B model on the CPU
        refusal = "benchmark_gpu: no CUDA device here; --small checks the script on the CPU"
        parser.exit(EXIT_BAD_INPUT, refusal + "\n")
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("WANDB_MODE", "disabled")
    if args.part:
        result = PARTS[args.part][0](args.out, args.small)
        (args.out / f"{args.part}.json").write_text(json.dumps(result))
        return
    names = args.only.split(",") if args.only else list(PARTS)
    unknown = [n for n in names if n not in PARTS]
    if unknown:
        parser.error(f"--only: no part {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    env = f"torch {torch.__version__}"
    if torch.cuda.is_available():
        env += f", {torch.cuda.get_device_name()}"
    print(f"benchmark_gpu: {env}", flush=True)
    # SIGTERM leaves through run_part's `finally`, which kills the running part and what it started.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    print_table(run_parts(args.out, names, args.budget, args.small))


if __name__ == "__main__":
    main()
