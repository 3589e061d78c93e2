"""benchmark_gpu.py's train.py parts: the recipes as train.py runs them (the 1B Llama and its variants:
block_causal, the chunked loss, Muon, float8; Llama 3 8B's width with 4 layers; Qwen3-30B-A3B's with 2),
the host-device syncs of a step, and the PyPI torchtitan wheel on llama1b's shape. train.py's main()
runs in the part's process, which benchmark_gpu.py starts fresh for each part."""

import json
import os
import runpy
import subprocess
import time
from pathlib import Path

import torch

from torchtitan.config.parser import parse_args

ROOT = Path(__file__).resolve().parents[2]

STEPS, LOG_FREQ = 30, 10
COMMON = ["--checkpoint.enable_checkpoint", "false", "--validation.enable", "false", "--metrics.log_freq"]


def train_figures(
    out: Path,
    name: str,
    argv: list[str],
    small: bool,
    layers: tuple[str, int] | None,
    steps: int = STEPS,
    small_extra: tuple[str, ...] = (),
) -> dict:
    """train.py's main() in this process; `layers` = (flavour, n_layers) trains that flavour cut to
    n_layers (model.n_layers); `small_extra`: options after --small's own
    (e.g. a variant's shape at the debug model's size)."""
    if small:
        argv = [
            *argv,
            "--model.flavor",
            "debugmodel",
            "--model.vocab_size",
            "-1",
            "--training.seq_len",
            "256",
            *small_extra,
        ]
        if not torch.cuda.is_available():  # bf16 matmuls are slow on most CPUs
            argv += ["--training.mixed_precision_param", "float32"]
    elif layers is not None:
        argv = [*argv, "--model.flavor", layers[0], "--model.n_layers", str(layers[1])]
    dump = out / name
    steps, log_freq = (4, 2) if small else (steps, LOG_FREQ)
    argv = [*argv, *COMMON, str(log_freq), "--training.steps", str(steps), "--job.dump_folder", str(dump)]
    train_main = runpy.run_path(str(ROOT / "train.py"))["main"]  # a program: executed, not imported
    start = time.perf_counter()
    code = train_main(parse_args(argv))
    wall = time.perf_counter() - start
    with open(dump / "metrics.jsonl") as f:
        records = [r for r in map(json.loads, f) if "tps" in r]
    last = records[-1]
    counters = torch._dynamo.utils.counters
    return {
        "exit": code,
        "tps": round(last["tps"]),
        "mfu_pct": None if last["mfu"] is None else round(last["mfu"], 2),
        "memory_gib": round(last["memory_gib"], 2),
        "step_ms": round(1000 * last["step_time"], 1),
        "wall_s": round(wall, 1),
        "unique_graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
        "argv": " ".join(argv),
    }


LLAMA_1B = [  # full logits and the causal mask, as torchtitan_1b runs; the recipe chunks and masks documents
    "--job.config_file", str(ROOT / "train_configs" / "llama3_1b.toml"),
    "--training.global_batch_size", "-1", "--training.loss_chunk_tokens", "0",
    "--model.attn_mask_type", "causal",
]  # fmt: skip


def part_llama1b(out: Path, small: bool) -> dict:
    return train_figures(out, "llama1b", LLAMA_1B, small, None)


def part_llama1b_chunked_loss(out: Path, small: bool) -> dict:
    return train_figures(
        out, "llama1b_chunked_loss", [*LLAMA_1B, "--training.loss_chunk_tokens", "2048"], small, None
    )


def part_llama1b_block_causal(out: Path, small: bool) -> dict:
    """llama1b with packed documents attending within themselves (FlexAttention), as the recipe has it."""
    argv = [*LLAMA_1B, "--model.attn_mask_type", "block_causal"]
    return train_figures(out, "llama1b_block_causal", argv, small, None)


def fp8(out: Path, small: bool, recipe: str) -> dict:
    argv = [*LLAMA_1B, "--float8.enable_float8_linear", "true", "--float8.recipe_name", recipe]
    return train_figures(out, f"llama1b_fp8_{recipe}", argv, small, None)


def part_llama1b_fp8_tensorwise(out: Path, small: bool) -> dict:
    return fp8(out, small, "tensorwise")


def part_llama1b_fp8_rowwise(out: Path, small: bool) -> dict:
    return fp8(out, small, "rowwise")


def part_llama8b_4layers(out: Path, small: bool) -> dict:
    argv = [
        "--job.config_file", str(ROOT / "train_configs" / "llama3_1b.toml"),
        "--model.attn_mask_type", "causal", "--model.name", "llama3",
        "--training.batch_size", "1", "--training.seq_len", "8192",
        "--training.global_batch_size", "-1",
    ]  # fmt: skip
    return train_figures(out, "llama8b_4layers", argv, small, ("8B", 4))


def part_qwen3_moe_2layers(out: Path, small: bool) -> dict:
    argv = [
        "--job.config_file", str(ROOT / "train_configs" / "qwen3_moe_debug.toml"),
        "--training.batch_size", "2", "--training.seq_len", "4096", "--training.global_batch_size", "-1",
        "--model.vocab_size", "151936", "--training.mixed_precision_param", "bfloat16",
        "--training.compile", "true",
        "--optimizer.implementation", "fused", "--lr_scheduler.warmup_steps", "10",
    ]  # fmt: skip
    return train_figures(out, "qwen3_moe_2layers", argv, small, ("30B-A3B", 2))


def part_llama1b_muon(out: Path, small: bool) -> dict:
    return train_figures(out, "llama1b_muon", [*LLAMA_1B, "--optimizer.name", "Muon"], small, None)


def part_host_syncs(out: Path, small: bool) -> dict:
    """CUDA's sync debug mode over the Qwen3-MoE debug recipe, eager, bf16, 6 steps logging at 1, 3
    and 6: the host-device syncs counted between one step's update and the next one's, from step 1
    on (docs/performance.md: only the logging steps' should remain)."""
    import warnings

    from torchtitan.metrics import MetricLogger

    per_step, steps_done, step_done = {}, [0], MetricLogger.step_done

    def counting_step_done(self) -> None:
        steps_done[0] += 1
        if steps_done[0] == 1 and torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("warn")
        step_done(self)

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" in str(message):
            where = f"step {steps_done[0]}"
            per_step[where] = per_step.get(where, 0) + 1

    MetricLogger.step_done = counting_step_done
    warnings.showwarning = record
    warnings.simplefilter("always")
    argv = [
        "--job.config_file", str(ROOT / "train_configs" / "qwen3_moe_debug.toml"),
        "--training.mixed_precision_param", "bfloat16", "--moe.bias_update_rate", "0.01",
        "--metrics.log_freq", "3", "--training.steps", "6", "--job.dump_folder", str(out / "host_syncs"),
        "--checkpoint.enable_checkpoint", "false", "--validation.enable", "false",
    ]  # fmt: skip
    code = runpy.run_path(str(ROOT / "train.py"))["main"](parse_args(argv))
    return {
        "exit": code,
        "device": "cuda" if torch.cuda.is_available() else "cpu (nothing counted)",
        **per_step,
    }


def part_torchtitan_1b(out: Path, small: bool) -> dict:
    """compare_torchtitan/run.sh: the torchtitan wheel, installed from .whl/ into its own
    folder so that this repository's torchtitan/ never shadows it."""
    env = {**os.environ, "TT_SITE": "/tmp/torchtitan_site", "TT_STEPS": str(STEPS)}
    if small:
        env.update(TT_SMOKE="1", TT_STEPS="8")
    runner = Path(__file__).parent / "compare_torchtitan" / "run.sh"
    subprocess.run(["bash", str(runner), str(out / "torchtitan_1b")], cwd=ROOT, env=env, timeout=200)
    summary = json.loads((out / "torchtitan_1b" / "torchtitan_summary.json").read_text())
    keep = ("tps", "mfu", "memory_gib", "steps", "exit_code", "tps_median", "mfu_ours_formula")
    return {"torchtitan": {k: summary.get(k) for k in keep}}
