"""Loss parity of parallel layouts with one process, on CPU (gloo), in fp32.

Every layout trains a debug model (Llama 3's, or Qwen3's: `model`) for a few steps on the same global
batches as a 1-process reference run (same global batch size and model) and must log the same
per-step loss and gradient norm, and the same validation loss (steps 5 and 10, the same global
validation batch), within a tolerance: data, tensor, sequence and pipeline parallelism, gradient
accumulation, activation checkpointing and compilation change how the work is split, never what is
computed.

Usage: python scripts/parity_matrix.py [--only SUBSTRING ...] [--steps 10] [--tol 1e-5] [--keep DIR]
       python scripts/parity_matrix.py --dtype bfloat16 [--only SUBSTRING ...] [--bound 1.5]

Prints a table of the largest |loss - reference| and |grad_norm - reference| per layout (and, for
mixture-of-experts models, of the auxiliary loss and the expert load) and exits
non-zero if any layout fails or differs by more than the tolerance. The full matrix takes about 10
minutes on 2 CPU cores (4-process layouts and the cold torch.compile are the slow ones).

With `--dtype bfloat16` every layout trains in bf16 (fp32 reductions) on 256-token sequences with 10
warm-up steps, for 16 steps, and is compared with the fp32 one-process run: its largest |loss - fp32|
must be at most `--bound` times one bf16 process's (docs/numerics.md). After a loss spike bf16 runs of
any layout, one process included, drift apart chaotically, so the comparison stops before the fp32
run's first spike (a step whose loss exceeds the previous one's by more than SPIKE): after step 16 for
the debug model at 256 tokens, earlier for some models and lengths.
"""

import dataclasses
import math
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from launch import VALIDATION, read_metrics, run_train, validation_losses  # noqa: E402

from torchtitan.config.parser import OneLineParser, positive_int  # noqa: E402
from torchtitan.errors import run_with_exit_codes  # noqa: E402

AC_FULL = ("--activation_checkpoint.mode", "full")
AC_OP = ("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op")
AC_EVERY_2 = ("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2")
COMPILE = ("--training.compile", "true")
CHUNKED_LOSS = ("--training.loss_chunk_tokens", "48")  # divides neither 64- nor 128-token micro-batches
TP_DEGREE = "--parallelism.tensor_parallel_degree"
PP_DEGREE = "--parallelism.pipeline_parallel_degree"
CP_DEGREE = "--parallelism.context_parallel_degree"
VALIDATION_BATCH = 4  # sequences per global validation batch, the same in every layout
# The bf16 comparison's setup (issue #28): longer sequences and warm-up than the fp32 matrix's.
BF16_SETUP = ("--training.seq_len", "256", "--lr_scheduler.warmup_steps", "10")
BF16 = ("--training.mixed_precision_param", "bfloat16", "--training.mixed_precision_reduce", "float32")
BF16_STEPS = 16
SPIKE = 0.1  # a rise of the fp32 loss over one step that ends the bf16 comparison (batch noise: < 0.08)


@dataclass(frozen=True)
class Layout:
    name: str
    nproc: int
    batch_size: int  # per data-parallel rank and micro-batch
    global_batch: int  # sequences per step; the reference runs them as one batch on one process
    args: tuple[str, ...] = ()
    # The model's options (and the sequence length), shared with the reference (default: Llama 3's).
    model: tuple[str, ...] = ()
    # The reference's micro-batch, in sequences (0: the whole global batch). A mixture of experts'
    # auxiliary loss is a micro-batch's (not linear in its tokens): a pipeline's is compared with one
    # process accumulating the same micro-batches.
    reference_microbatch: int = 0

    @property
    def reference(self) -> tuple[int, tuple[str, ...], int]:
        return self.global_batch, self.model, self.reference_microbatch

    @property
    def dp_degree(self) -> int:
        args = list(self.args)
        degrees = [
            int(args[args.index(option) + 1])
            for option in (TP_DEGREE, PP_DEGREE, CP_DEGREE)
            if option in args
        ]
        return self.nproc // math.prod(degrees)

    def argv(self, steps: int) -> list[str]:
        return [
            "--training.steps",
            str(steps),
            "--training.batch_size",
            str(self.batch_size),
            "--training.global_batch_size",
            str(self.global_batch),
            *VALIDATION,
            "--validation.batch_size",
            str(VALIDATION_BATCH // self.dp_degree),
            *self.model,
            *self.args,
        ]


def pp(n: int, schedule: str = "1F1B") -> tuple[str, ...]:
    return (PP_DEGREE, str(n), "--parallelism.pipeline_parallel_schedule", schedule)


def ep(n: int) -> tuple[str, ...]:
    return ("--parallelism.expert_parallel_degree", str(n))


def cp(n: int) -> tuple[str, ...]:
    return (CP_DEGREE, str(n))


def replicate(n: int) -> tuple[str, ...]:
    return ("--parallelism.data_parallel_replicate_degree", str(n))


def tp(n: int, loss_parallel: bool = True) -> tuple[str, ...]:
    return (
        TP_DEGREE,
        str(n),
        "--parallelism.enable_loss_parallel",
        str(loss_parallel).lower(),
    )


FSDP_KNOBS = (
    "--parallelism.fsdp_reshard_after_forward",
    "always",
    "--parallelism.fsdp_forward_prefetch",
    "2",
    "--parallelism.fsdp_backward_prefetch",
    "2",
)
# The blocks gathered whole in fp32 (one FSDP unit and one compiled graph each), autocast rounding.
FP32_GATHER = ("--parallelism.fsdp_gather_dtype", "float32")

# Qwen3's debug flavours on the bundled tokenizer.json: embeddings tied to the output layer (as in 0.6B
# to 4B) and untied (8B and up; pipeline stages cannot share a tied table).
QWEN3 = ("--model.name", "qwen3", "--model.tokenizer_path", "assets/tokenizer/kjv_bpe_hf")
QWEN3_UNTIED = (*QWEN3, "--model.flavor", "debugmodel")
QWEN3_TIED = (*QWEN3, "--model.flavor", "debugmodel_tied")
# Qwen3-MoE's debug flavour (8 experts, top 2, a dense first layer), its experts balanced by the auxiliary
# loss (the default) or by DeepSeek-V3's routing bias alone.
# Context parallelism splits sequences: long enough ones (512 tokens) that each rank's chunks span
# many positions. The reference runs the same length.
LONG = ("--training.seq_len", "512")
QWEN3_LONG = (*QWEN3_UNTIED, *LONG)
# CI's context-parallel runs (tests/): 256 tokens, still 8 chunks of 32 at CP 4, at half the time.
QWEN3_CP_CI = (*QWEN3_UNTIED, "--training.seq_len", "256")
QWEN3_MOE = ("--model.name", "qwen3_moe", "--model.tokenizer_path", "assets/tokenizer/kjv_bpe_hf")
QWEN3_MOE_BIAS = (*QWEN3_MOE, "--moe.aux_loss_coef", "0", "--moe.bias_update_rate", "0.01")
QWEN3_MOE_BOTH = (*QWEN3_MOE, "--moe.bias_update_rate", "0.01")
# Packed documents attending within themselves (model.attn_mask_type, docs/attention.md), on documents
# short enough (the verses of the bundled validation split, ~35 tokens) that every window holds some.
BLOCK_CAUSAL = (
    "--model.attn_mask_type",
    "block_causal",
    "--training.dataset_path",
    "tests/assets/verses.jsonl",
)
# Muon for the blocks' matrices (docs/optimizers.md), its Newton-Schulz in fp32 (exact, and fast on CPUs).
MUON = ("--optimizer.name", "Muon", "--optimizer.muon_ns_dtype", "float32")
QWEN3_MOE_MUON = (*QWEN3_MOE_BOTH, *MUON)
LLAMA_BLOCK = (*LONG, *BLOCK_CAUSAL)
QWEN3_BLOCK = (*QWEN3_LONG, *BLOCK_CAUSAL)
QWEN3_CP_CI_BLOCK = (*QWEN3_CP_CI, *BLOCK_CAUSAL)
QWEN3_MOE_BLOCK = (*QWEN3_MOE, *BLOCK_CAUSAL)

MATRIX = [
    Layout("FSDP 2", 2, 2, 4),
    Layout("DDP 2", 2, 2, 4, replicate(2)),
    Layout("HSDP 2x2", 4, 1, 4, replicate(2)),
    Layout("TP 2 (SP, loss parallel)", 2, 4, 4, tp(2)),
    Layout("TP 2 (SP, gathered logits)", 2, 4, 4, tp(2, loss_parallel=False)),
    Layout("FSDP 2 x TP 2", 4, 2, 4, tp(2)),
    Layout("DDP 2 x TP 2", 4, 2, 4, replicate(2) + tp(2)),
    Layout("GA 2 x batch 2 (1 process)", 1, 2, 4),
    Layout("FSDP 2 + GA 2", 2, 1, 4),
    Layout("HSDP 2x2 + GA 2", 4, 1, 8, replicate(2)),
    Layout("FSDP 2, reshard always, prefetch 2", 2, 2, 4, FSDP_KNOBS),
    Layout("FSDP 2, reshard never", 2, 2, 4, ("--parallelism.fsdp_reshard_after_forward", "never")),
    Layout("FSDP 2, gathered in fp32 + compile", 2, 2, 4, FP32_GATHER + COMPILE),
    Layout("HSDP 2x2, gathered in fp32", 4, 1, 4, replicate(2) + FP32_GATHER),
    Layout("AC full", 1, 4, 4, AC_FULL),
    Layout("AC selective op", 1, 4, 4, AC_OP),
    Layout("AC selective every 2nd block", 1, 4, 4, AC_EVERY_2),
    Layout("FSDP 2 x TP 2 + AC selective op", 4, 2, 4, tp(2) + AC_OP),
    Layout("compile", 1, 4, 4, COMPILE),
    Layout("compile + AC selective op", 1, 4, 4, COMPILE + AC_OP),
    Layout("chunked loss (1 process)", 1, 4, 4, CHUNKED_LOSS),
    Layout("DDP 2 + chunked loss", 2, 2, 4, replicate(2) + CHUNKED_LOSS),
    Layout("TP 2 (SP, loss parallel) + chunked loss", 2, 4, 4, tp(2) + CHUNKED_LOSS),
    Layout("FSDP 2 + GA 2 + chunked loss, reshard always", 2, 1, 4, FSDP_KNOBS + CHUNKED_LOSS),
    Layout("compile + AC selective op + chunked loss", 1, 4, 4, COMPILE + AC_OP + CHUNKED_LOSS),
    # Tied under TP: test_parallelisms.py checks a step's gradients; over 10 steps Adam amplifies the
    # rounding of the table's two summed gradients past 1e-5 in the gradient norm (docs/models.md).
    Layout("Qwen3 tied: FSDP 2", 2, 2, 4, model=QWEN3_TIED),
    Layout("Qwen3 tied: HSDP 2x2", 4, 1, 4, replicate(2), QWEN3_TIED),
    Layout("Qwen3 untied: TP 2 (SP, loss parallel)", 2, 4, 4, tp(2), QWEN3_UNTIED),
    Layout("Qwen3 untied: FSDP 2 x TP 2 + AC selective op", 4, 2, 4, tp(2) + AC_OP, QWEN3_UNTIED),
    Layout("Qwen3 untied: TP 2 + chunked loss + GA 2", 2, 2, 4, tp(2) + CHUNKED_LOSS, QWEN3_UNTIED),
    Layout("Qwen3 untied: PP 2, 1F1B", 2, 4, 4, pp(2), QWEN3_UNTIED),
    Layout("Qwen3 untied: PP 2, Interleaved1F1B", 2, 4, 4, pp(2, "Interleaved1F1B"), QWEN3_UNTIED),
    Layout("Qwen3 untied: compile + AC selective op", 1, 4, 4, COMPILE + AC_OP, QWEN3_UNTIED),
    Layout("Qwen3-MoE: FSDP 2", 2, 2, 4, model=QWEN3_MOE),
    Layout("Qwen3-MoE: HSDP 2x2", 4, 1, 4, replicate(2), QWEN3_MOE),
    Layout("Qwen3-MoE: FSDP 2 + AC full", 2, 2, 4, AC_FULL, QWEN3_MOE),
    Layout("Qwen3-MoE: compile + AC selective op", 1, 4, 4, COMPILE + AC_OP, QWEN3_MOE),
    Layout("Qwen3-MoE: FSDP 2 + chunked loss", 2, 2, 4, CHUNKED_LOSS, QWEN3_MOE),
    Layout("Qwen3-MoE: FSDP 2, gathered in fp32 + compile", 2, 2, 4, FP32_GATHER + COMPILE, QWEN3_MOE),
    Layout("Qwen3-MoE bias: FSDP 2", 2, 2, 4, model=QWEN3_MOE_BIAS),
    Layout("Qwen3-MoE bias: FSDP 2 + GA 2 + AC full", 2, 1, 4, AC_FULL, QWEN3_MOE_BIAS),
    Layout("Qwen3-MoE bias: PP 2, 1F1B", 2, 4, 4, pp(2), QWEN3_MOE_BIAS),
    Layout("Qwen3-MoE bias: PP 2, Interleaved1F1B", 2, 4, 4, pp(2, "Interleaved1F1B"), QWEN3_MOE_BIAS),
    Layout("Qwen3-MoE: EP 2", 2, 2, 4, ep(2), QWEN3_MOE),
    Layout("Qwen3-MoE: EP 2 on FSDP 4", 4, 1, 4, ep(2), QWEN3_MOE),
    Layout("Qwen3-MoE: EP 2, HSDP 2x2", 4, 1, 4, ep(2) + replicate(2), QWEN3_MOE),
    Layout("Qwen3-MoE: EP 2 + AC full + chunked loss", 2, 2, 4, ep(2) + AC_FULL + CHUNKED_LOSS, QWEN3_MOE),
    Layout("Qwen3-MoE: EP 2 + AC every 2nd block", 2, 2, 4, ep(2) + AC_EVERY_2, QWEN3_MOE),
    Layout("Qwen3-MoE: EP 2 + compile", 2, 2, 4, ep(2) + COMPILE, QWEN3_MOE),
    Layout("Qwen3-MoE bias: EP 2", 2, 2, 4, ep(2), QWEN3_MOE_BIAS),
    Layout("Qwen3-MoE bias: EP 2 + GA 2", 2, 1, 4, ep(2), QWEN3_MOE_BIAS),
    Layout("Qwen3-MoE bias: PP 2 x EP 2", 4, 2, 4, pp(2) + ep(2), QWEN3_MOE_BIAS),
    Layout("Qwen3-MoE: PP 2, 1F1B", 2, 4, 4, pp(2), QWEN3_MOE, reference_microbatch=2),
    Layout(
        "Qwen3-MoE: PP 2, Interleaved1F1B",
        2,
        4,
        4,
        pp(2, "Interleaved1F1B"),
        QWEN3_MOE,
        reference_microbatch=1,
    ),
    Layout(
        "Qwen3-MoE aux + bias: PP 2 x EP 2, GPipe, 1 micro-batch",
        4,
        2,
        4,
        pp(2, "GPipe") + ep(2) + ("--parallelism.pipeline_parallel_microbatches", "1"),
        QWEN3_MOE_BOTH,
    ),
    Layout("Qwen3-MoE: EP 2 x TP 2", 4, 2, 4, ep(2) + tp(2), QWEN3_MOE),
    Layout("Qwen3-MoE bias: EP 2 x TP 2", 4, 2, 4, ep(2) + tp(2), QWEN3_MOE_BIAS),
    Layout("Qwen3-MoE: FSDP 2 x TP 2", 4, 2, 4, tp(2), QWEN3_MOE),
    Layout("Qwen3-MoE: FSDP 2 x TP 2 + AC selective op", 4, 2, 4, tp(2) + AC_OP, QWEN3_MOE),
    Layout("Qwen3-MoE: EP 2 + AC selective op", 2, 2, 4, ep(2) + AC_OP, QWEN3_MOE),
    Layout("Qwen3-MoE: EP 2 + compile + AC selective op", 2, 2, 4, ep(2) + COMPILE + AC_OP, QWEN3_MOE),
    Layout(
        "Qwen3-MoE: EP 2 x TP 2 + AC full + chunked loss",
        4,
        2,
        4,
        ep(2) + tp(2) + AC_FULL + CHUNKED_LOSS,
        QWEN3_MOE,
    ),
    Layout("Llama, 512 tokens: CP 2", 2, 4, 4, cp(2), LONG),
    Layout("Llama, 512 tokens: CP 4", 4, 4, 4, cp(4), LONG),
    Layout("Llama, 512 tokens: CP 2 x FSDP 2", 4, 2, 4, cp(2), LONG),
    Layout("Llama, 512 tokens: CP 2 x TP 2", 4, 4, 4, cp(2) + tp(2), LONG),
    Layout("Llama, 512 tokens: PP 2 x CP 2", 4, 4, 4, pp(2) + cp(2), LONG),
    Layout("Qwen3 untied, 512 tokens: CP 2", 2, 4, 4, cp(2), QWEN3_LONG),
    Layout("Qwen3 untied, 512 tokens: CP 4", 4, 4, 4, cp(4), QWEN3_LONG),
    Layout("Qwen3 untied, 512 tokens: CP 2 x FSDP 2", 4, 2, 4, cp(2), QWEN3_LONG),
    Layout("Qwen3 untied, 512 tokens: HSDP 2 x CP 2", 4, 2, 4, cp(2) + replicate(2), QWEN3_LONG),
    Layout("Qwen3 untied, 512 tokens: CP 2 + GA 2 + AC full", 2, 2, 4, cp(2) + AC_FULL, QWEN3_LONG),
    Layout(
        "Qwen3 untied, 512 tokens: CP 2 + compile + AC selective op",
        2,
        4,
        4,
        cp(2) + COMPILE + AC_OP,
        QWEN3_LONG,
    ),
    Layout("Qwen3 untied, 512 tokens: CP 2 + chunked loss", 2, 4, 4, cp(2) + CHUNKED_LOSS, QWEN3_LONG),
    Layout(
        "Qwen3 untied, 512 tokens: CP 2 x TP 2 + GA 2 + AC selective op + chunked loss, reshard always",
        4,
        2,
        4,
        cp(2) + tp(2) + AC_OP + FSDP_KNOBS + CHUNKED_LOSS,
        QWEN3_LONG,
    ),
    Layout(
        "Qwen3 untied, 512 tokens: PP 2 x CP 2, 1F1B, 4 micro-batches",
        4,
        4,
        4,
        pp(2) + cp(2) + ("--parallelism.pipeline_parallel_microbatches", "4"),
        QWEN3_LONG,
    ),
    # Packed documents attending within themselves (block_causal), ~35-token documents in 512 tokens.
    Layout("Llama, 512 tokens, block_causal: FSDP 2", 2, 2, 4, model=LLAMA_BLOCK),
    Layout("Llama, 512 tokens, block_causal: TP 2", 2, 4, 4, tp(2), LLAMA_BLOCK),
    Layout("Llama, 512 tokens, block_causal: CP 2", 2, 4, 4, cp(2), LLAMA_BLOCK),
    Layout("Llama, 512 tokens, block_causal: CP 4", 4, 4, 4, cp(4), LLAMA_BLOCK),
    Layout("Llama, 512 tokens, block_causal: CP 2 x TP 2", 4, 4, 4, cp(2) + tp(2), LLAMA_BLOCK),
    Layout("Llama, 512 tokens, block_causal: PP 2, 1F1B", 2, 4, 4, pp(2), LLAMA_BLOCK),
    Layout("Llama, 512 tokens, block_causal: compile + AC op", 1, 4, 4, COMPILE + AC_OP, LLAMA_BLOCK),
    Layout("Qwen3 untied, 512 tokens, block_causal: CP 2 x FSDP 2", 4, 2, 4, cp(2), QWEN3_BLOCK),
    Layout("Qwen3 untied, 512 tokens, block_causal: PP 2 x CP 2, 1F1B", 4, 4, 4, pp(2) + cp(2), QWEN3_BLOCK),
    Layout("Qwen3-MoE, block_causal: EP 2", 2, 2, 4, ep(2), QWEN3_MOE_BLOCK),
    Layout("Qwen3-MoE, block_causal: PP 2, 1F1B", 2, 4, 4, pp(2), QWEN3_MOE_BLOCK, reference_microbatch=2),
    # Muon: each rank gathers the matrices it holds a shard or slice of (docs/optimizers.md).
    Layout("Muon: FSDP 2", 2, 2, 4, model=MUON),
    Layout("Muon: TP 2", 2, 4, 4, tp(2), MUON),
    Layout("Muon: FSDP 2 x TP 2 + GA 2", 4, 1, 4, tp(2), MUON),
    Layout("Muon: HSDP 2x2", 4, 1, 4, replicate(2), MUON),
    Layout("Muon: PP 2, 1F1B", 2, 4, 4, pp(2), MUON),
    Layout("Muon: GA 2 x batch 2 (1 process)", 1, 2, 4, model=MUON),
    Layout("Qwen3-MoE Muon: EP 2", 2, 2, 4, ep(2), QWEN3_MOE_MUON),
    Layout("Qwen3-MoE Muon: EP 2 on FSDP 4", 4, 1, 4, ep(2), QWEN3_MOE_MUON),
]


@dataclass
class Result:
    layout: Layout
    max_loss_diff: float = float("nan")
    max_grad_norm_diff: float = float("nan")
    step1_loss_diff: float = float("nan")
    max_validation_diff: float = float("nan")
    # Mixture-of-experts models: the auxiliary loss and the expert load (0 for dense models).
    max_moe_diff: float = 0.0
    seconds: float = 0.0
    error: str | None = None

    def ok(self, tol: float) -> bool:
        diffs = (self.max_loss_diff, self.max_grad_norm_diff, self.max_validation_diff, self.max_moe_diff)
        return self.error is None and all(diff <= tol for diff in diffs)


LAUNCH_LOG = "launch.log"  # a failed launch's output, in its dump folder


def last_words(output: str) -> str:
    """A failed launch's error in one line: its root cause as torchrun's summary of the failure gives
    it (the worker's error), or else the last line it printed."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    causes = [line.split(":", 1)[1].strip() for line in lines if line.startswith("traceback :")]
    if causes and not causes[-1].startswith("To enable traceback"):
        return causes[-1]
    return lines[-1] if lines else "no output"


def launch_output(folder: Path, chars: int = 6000) -> str:
    """The end of the output of the launch that failed in `folder`, if one did."""
    log = folder / LAUNCH_LOG
    return log.read_text()[-chars:] if log.exists() else ""


def run(folder: Path, nproc: int, argv: list[str]) -> tuple[list[dict] | None, str | None, float]:
    """(per-step metrics, error, seconds) of one launch of train.py; the validation losses by step
    are added to the metrics of their step."""
    start = time.perf_counter()
    result = run_train(nproc, folder, *argv, timeout=900)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        (folder / LAUNCH_LOG).write_text(result.stdout + result.stderr)
        return None, f"exit {result.returncode}: {last_words(result.stderr or result.stdout)}", seconds
    metrics = read_metrics(folder)
    for record in metrics:
        record["validation_loss"] = validation_losses(folder).get(record["step"])
    return metrics, None, seconds


def run_reference(
    folder: Path, global_batch: int, steps: int, model: tuple[str, ...] = (), microbatch: int = 0
) -> list[dict]:
    """The 1-process run every layout with this global batch size, model and reference micro-batch is
    compared with."""
    reference = Layout("reference", 1, microbatch or global_batch, global_batch, model=model)
    metrics, error, _ = run(folder, 1, reference.argv(steps))
    if error is not None:
        raise RuntimeError(f"the 1-process reference run failed: {error}")
    return metrics


def run_layout(layout: Layout, folder: Path, steps: int, reference: list[dict]) -> Result:
    metrics, error, seconds = run(folder, layout.nproc, layout.argv(steps))
    result = Result(layout, seconds=seconds, error=error)
    if metrics is None:
        return result
    if [m["step"] for m in metrics] != [m["step"] for m in reference]:
        result.error = "logged steps differ from the reference"
        return result
    result.max_loss_diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(reference, metrics))
    result.max_grad_norm_diff = max(abs(a["grad_norm"] - b["grad_norm"]) for a, b in zip(reference, metrics))
    result.step1_loss_diff = abs(reference[0]["loss"] - metrics[0]["loss"])
    for key in ("aux_loss", "expert_load"):
        if any((key in a) != (key in b) for a, b in zip(reference, metrics)):
            result.error = f"{key} is logged by one run and not the other"
            return result
        diffs = [abs(a[key] - b[key]) for a, b in zip(reference, metrics) if key in a]
        result.max_moe_diff = max([result.max_moe_diff, *diffs])
    validated = [(a["validation_loss"], b["validation_loss"]) for a, b in zip(reference, metrics)]
    if not any(a is not None for a, _ in validated) or any((a is None) != (b is None) for a, b in validated):
        result.error = "validated steps differ from the reference"
        return result
    result.max_validation_diff = max(abs(a - b) for a, b in validated if a is not None)
    return result


def steps_before_spike(losses: list[float]) -> int:
    """How many steps precede the first loss spike (all of them without one)."""
    return next((s for s in range(1, len(losses)) if losses[s] - losses[s - 1] > SPIKE), len(losses))


def max_loss_diff(a: list[dict], b: list[dict], steps: int) -> float:
    return max(abs(x["loss"] - y["loss"]) for x, y in zip(a[:steps], b[:steps]))


def bf16_matrix(layouts: list[Layout], folder: Path, bound: float) -> list[tuple]:
    """Per run: (name, processes, steps compared, max |loss - fp32 one process| over them, that / one bf16
    process's, status). Each reference key gets an fp32 and a bf16 one-process run on the reference's
    micro-batch; the steps compared are those before the fp32 run's first spike."""
    rows, references = [], {}
    for i, (batch, model, microbatch) in enumerate(sorted({layout.reference for layout in layouts})):
        reference = Layout("reference", 1, microbatch or batch, batch, model=(*BF16_SETUP, *model))
        fp32, error, _ = run(folder / f"reference-{i}-fp32", 1, reference.argv(BF16_STEPS))
        one, error_bf16, _ = run(folder / f"reference-{i}-bf16", 1, [*reference.argv(BF16_STEPS), *BF16])
        if error or error_bf16:
            raise RuntimeError(f"a one-process reference run failed: {error or error_bf16}")
        steps = steps_before_spike([m["loss"] for m in fp32])
        one_error = max_loss_diff(fp32, one, steps)
        references[batch, model, microbatch] = fp32, steps, one_error
        name = f"1 process, batch {batch} {' '.join(model)}".strip()
        rows.append((name, 1, steps, one_error, 1.0, "", "reference"))
        print(f"{name}: {one_error:.2e} over {steps} steps", flush=True)
    for i, layout in enumerate(layouts):
        fp32, steps, one_error = references[layout.reference]
        bf16 = dataclasses.replace(layout, model=(*BF16_SETUP, *layout.model))
        metrics, error, _ = run(folder / f"layout-{i}", layout.nproc, [*bf16.argv(BF16_STEPS), *BF16])
        if error is not None:
            rows.append((layout.name, layout.nproc, steps, math.nan, math.nan, "", f"FAIL {error}"))
        else:
            diff = max_loss_diff(fp32, metrics, steps)
            status = "ok" if diff <= bound * one_error else "FAIL"
            graphs = (
                f"{metrics[-1]['compiled_graphs']} ({metrics[-1]['graph_breaks']})"
                if "compiled_graphs" in metrics[-1]
                else ""
            )
            rows.append((layout.name, layout.nproc, steps, diff, diff / one_error, graphs, status))
        print(f"{layout.name}: {rows[-1][-1]}", flush=True)
    return rows


def run_matrix(layouts: list[Layout], folder: Path, steps: int) -> list[Result]:
    """Run the 1-process references (one per global batch size and model), then every layout against its
    one."""
    references = {}
    for i, (batch, model, microbatch) in enumerate(sorted({layout.reference for layout in layouts})):
        references[batch, model, microbatch] = run_reference(
            folder / f"reference-{i}", batch, steps, model, microbatch
        )
        print(f"reference, global batch {batch}/{microbatch} {' '.join(model)}: done", flush=True)
    results = []
    for i, layout in enumerate(layouts):
        reference = references[layout.reference]
        results.append(run_layout(layout, folder / f"layout-{i}", steps, reference))
        print(f"{layout.name}: {results[-1].error or 'done'} ({results[-1].seconds:.0f}s)", flush=True)
    return results


def format_table(results: list[Result], tol: float) -> str:
    rows = [
        ("layout", "procs", "max |dloss|", "max |dgrad_norm|", "step-1 |dloss|", "max |dval|", "max |dmoe|")
        + ("time", "")
    ]
    for r in results:
        status = "ok" if r.ok(tol) else f"FAIL {r.error or ''}".strip()
        rows.append(
            (
                r.layout.name,
                str(r.layout.nproc),
                f"{r.max_loss_diff:.2e}",
                f"{r.max_grad_norm_diff:.2e}",
                f"{r.step1_loss_diff:.2e}",
                f"{r.max_validation_diff:.2e}",
                f"{r.max_moe_diff:.2e}",
                f"{r.seconds:.0f}s",
                status,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def main() -> int:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", default=[], help="run layouts whose name contains one of these")
    parser.add_argument("--steps", type=positive_int, default=10, help="training steps per run (default 10)")
    parser.add_argument("--tol", type=float, default=1e-5, help="largest allowed difference (default 1e-5)")
    parser.add_argument("--keep", type=Path, help="keep the runs' outputs in this folder")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="see above")
    parser.add_argument("--bound", type=float, default=1.5, help="bfloat16: largest allowed error ratio")
    args = parser.parse_args()
    layouts = [layout for layout in MATRIX if not args.only or any(s in layout.name for s in args.only)]
    if not layouts:
        parser.error(f"no layout matches {args.only}")
    if args.dtype == "bfloat16":
        return bf16_main(layouts, args.keep, args.bound)
    with tempfile.TemporaryDirectory(prefix="parity-") as tmp:
        results = run_matrix(layouts, args.keep or Path(tmp), args.steps)
    print(format_table(results, args.tol))
    failed = [r for r in results if not r.ok(args.tol)]
    print(f"{len(results) - len(failed)}/{len(results)} layouts within {args.tol:g} of 1 process")
    return 1 if failed else 0


def bf16_main(layouts: list[Layout], keep: Path | None, bound: float) -> int:
    with tempfile.TemporaryDirectory(prefix="parity-bf16-") as tmp:
        rows = bf16_matrix(layouts, keep or Path(tmp), bound)
    header = (
        "layout",
        "procs",
        "steps",
        "bf16 max |loss - fp32 1 process|",
        "/ 1 bf16 process",
        "graphs",
        "",
    )
    cells = [header] + [
        (name, str(n), str(s), f"{d:.2e}", f"{r:.2f}", g, ok) for name, n, s, d, r, g, ok in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    print("\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells))
    failed = [row for row in rows if row[-1].startswith("FAIL")]
    print(f"{len(rows) - len(failed)}/{len(rows)} runs within {bound:g}x one bf16 process's error")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(run_with_exit_codes(main))
