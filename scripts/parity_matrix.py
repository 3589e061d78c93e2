"""Loss parity of parallel layouts with one process, on CPU (gloo), in fp32.

Every layout (scripts/parity_layouts.py's MATRIX, then scripts/parity_layouts_qwen3_5.py's) trains a
debug model (Llama 3's, or another family's: `model`) for a few steps on the same global batches as a
1-process reference run (same global batch size and model) and must log the same per-step loss and
gradient norm, and the same validation loss (steps 5 and 10, the same global validation batch; V-shaped
pipeline schedules, which cannot evaluate, are compared without it), within a tolerance: data, tensor,
sequence and pipeline parallelism, gradient accumulation, activation checkpointing and compilation
change how the work is split, never what is computed.

Usage: python scripts/parity_matrix.py [--only SUBSTRING ...] [--steps 10] [--tol 1e-5] [--keep DIR]
       python scripts/parity_matrix.py --dtype bfloat16 [--only SUBSTRING ...] [--bound 1.5]

Prints a table of the largest |loss - reference| and |grad_norm - reference| per layout (and, for
mixture-of-experts models, of the auxiliary loss and the expert load; with multi-token prediction, of
its loss per depth) and exits
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
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # scripts.parity_layouts, tests/launch.py
from launch import read_metrics, run_train, validation_losses  # noqa: E402

from scripts.parity_layouts import MATRIX, Layout  # noqa: E402
from scripts.parity_layouts_qwen3_5 import QWEN3_5_LAYOUTS  # noqa: E402
from torchtitan.config.parser import OneLineParser, positive_int  # noqa: E402
from torchtitan.errors import run_with_exit_codes  # noqa: E402

# The bf16 comparison's setup (issue #28): longer sequences and warm-up than the fp32 matrix's.
BF16_SETUP = ("--training.seq_len", "256", "--lr_scheduler.warmup_steps", "10")
BF16 = ("--training.mixed_precision_param", "bfloat16", "--training.mixed_precision_reduce", "float32")
BF16_STEPS = 16
SPIKE = 0.1  # a rise of the fp32 loss over one step that ends the bf16 comparison (batch noise: < 0.08)


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
        diffs = (self.max_loss_diff, self.max_grad_norm_diff, self.max_moe_diff)
        if self.layout.validate:
            diffs += (self.max_validation_diff,)
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
        folder.mkdir(parents=True, exist_ok=True)  # a run refused before it made its dump folder
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
    # Multi-token prediction's loss per depth (mtp_loss_1, ...) is compared with the experts' metrics.
    mtp_keys = sorted({key for record in reference for key in record if key.startswith("mtp_loss_")})
    for key in ("aux_loss", "seq_aux_loss", "expert_load", *mtp_keys):
        if any((key in a) != (key in b) for a, b in zip(reference, metrics)):
            result.error = f"{key} is logged by one run and not the other"
            return result
        diffs = [abs(a[key] - b[key]) for a, b in zip(reference, metrics) if key in a]
        result.max_moe_diff = max([result.max_moe_diff, *diffs])
    if not layout.validate:
        return result
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
                f"{r.max_validation_diff:.2e}" if r.layout.validate else "none",
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
    layouts = [
        layout
        for layout in [*MATRIX, *QWEN3_5_LAYOUTS]
        if not args.only or any(s in layout.name for s in args.only)
    ]
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
