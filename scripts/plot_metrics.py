"""Plot and compare training runs from the metrics.jsonl their dump folders hold.

    python scripts/plot_metrics.py RUN_DIR [RUN_DIR ...] -o plot.png
    python scripts/plot_metrics.py --compare RUN_A RUN_B [--tol 1e-5]

The plot overlays the runs' loss (the validation loss dashed, where [validation] was on), gradient
norm, tokens/s and memory against the step. The comparison prints the training and validation loss
of every step both runs logged and exits with 1 when they differ by more than the tolerance (or log
different steps), so a script can check that a change of layout or code leaves training unchanged.
A run directory may also be given as its metrics.jsonl.
"""

import argparse
import json
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from torchtitan.config.options import ConfigError  # noqa: E402
from torchtitan.config.paths import check_file, check_output_file  # noqa: E402
from torchtitan.errors import run_with_exit_codes  # noqa: E402

# (metrics.jsonl key, panel title) for the 2 x 2 grid.
PANELS = [
    ("loss", "loss"),
    ("grad_norm", "gradient norm (before clipping)"),
    ("tps", "tokens / s per device"),
    ("memory_gib", "peak memory (GiB)"),
]


def load_metrics(run: str, argument: str = "RUN_DIR") -> dict[int, dict]:
    """Records by step, a step's training and validation records merged. A resumed run appends to
    the file, so a step logged twice keeps its latest values: the ones the resumed run wrote."""
    path = os.path.join(run, "metrics.jsonl") if os.path.isdir(run) else run
    fix = "no metrics.jsonl there (give a run's job.dump_folder or the file)"
    check_file(argument, path, text=True, fix=fix, allow_empty=True)
    records = {}
    with open(path, errors="replace") as f:  # a bad byte past the part check_file reads spoils one line
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                records.setdefault(int(record["step"]), {}).update(record)
            except (ValueError, KeyError, TypeError) as e:
                raise ConfigError(f"{argument}: {path}, line {line_no}: not a metrics record ({e})") from None
    if not records:
        raise ConfigError(f"{argument}: {path}: no records")
    return dict(sorted(records.items()))


def run_labels(runs: list[str]) -> list[str]:
    """The shortest trailing part of each path that tells the runs apart."""
    parts = [Path(r).resolve().parts for r in runs]
    parts = [p[:-1] if p[-1] == "metrics.jsonl" else p for p in parts]
    for depth in range(1, max(len(p) for p in parts) + 1):
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return list(runs)


def draw(ax, records: dict[int, dict], key: str, label: str, color: str | None = None, style: str = "-"):
    """One run's curve of `key` (the line drawn, or None when the run never logged it)."""
    points = [(s, r[key]) for s, r in records.items() if r.get(key) is not None]
    if not points:
        return None
    steps, values = zip(*points)
    marker = "." if len(steps) < 50 else None
    return ax.plot(steps, values, style, color=color, marker=marker, label=label, linewidth=1.5)[0]


def plot(runs: list[str], output: str):
    """Write the figure to `output`; returns it."""
    try:  # optional: pyproject.toml's `plots` extra
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ConfigError(
            "plotting needs matplotlib, which is not installed: run `./scripts/install.sh --dev` or "
            "`.venv/bin/pip install matplotlib` (--compare needs nothing more)"
        ) from e

    metrics = [load_metrics(r) for r in runs]
    check_output_file("--output", output)
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex=True, constrained_layout=True)
    for (key, title), ax in zip(PANELS, axes.flat):
        for label, records in zip(run_labels(runs), metrics):
            line = draw(ax, records, key, label)
            if key == "loss" and line is not None:
                draw(ax, records, "validation_loss", f"{label} (validation)", line.get_color(), "--")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.ticklabel_format(axis="y", style="plain", useOffset=False)
    for ax in axes[1]:
        ax.set_xlabel("step")
    axes[0][0].legend(fontsize="small")
    fig.savefig(output, dpi=120)
    print(f"wrote {output}")
    return fig


def compare_key(a: dict[int, dict], b: dict[int, dict], key: str, tol: float) -> tuple[bool, str]:
    """Print `key` at every step both runs logged it; (whether it agrees, the verdict's detail)."""
    a = {step: r[key] for step, r in a.items() if r.get(key) is not None}
    b = {step: r[key] for step, r in b.items() if r.get(key) is not None}
    if not a and not b:
        return True, ""
    common = sorted(a.keys() & b.keys())
    print(f"{'step':>6}  {key + ' A':>18}  {key + ' B':>18}  {'|A - B|':>10}")
    worst_step, worst = None, 0.0
    for step in common:
        diff = abs(a[step] - b[step])
        if math.isnan(diff):
            diff = 0.0 if math.isnan(a[step]) and math.isnan(b[step]) else math.inf
        flag = "  <- over tolerance" if diff > tol else ""
        print(f"{step:>6}  {a[step]:>18.6f}  {b[step]:>18.6f}  {diff:>10.3e}{flag}")
        if worst_step is None or diff > worst:
            worst_step, worst = step, diff
    only = {"A": sorted(a.keys() - b.keys()), "B": sorted(b.keys() - a.keys())}
    for name, steps in only.items():
        if steps:
            print(f"steps with {key} only in {name}: {steps}")
    if not common:
        return False, f"no step has {key} in both runs"
    if worst > tol:
        return False, f"{key} differs by {worst:.3e} at step {worst_step}, over the tolerance {tol:g}"
    if only["A"] or only["B"]:
        return False, f"the runs logged {key} at different steps"
    return True, f"largest {key} difference {worst:.3e} (step {worst_step})"


def compare(run_a: str, run_b: str, tol: float) -> bool:
    """Print the per-step training and validation loss differences; True when every common step is
    within `tol` and both runs logged the same steps."""
    a, b = load_metrics(run_a, "RUN_A"), load_metrics(run_b, "RUN_B")
    verdicts = [compare_key(a, b, key, tol) for key in ("loss", "validation_loss")]
    failed = [detail for ok, detail in verdicts if not ok]
    if failed:
        print(f"FAIL: {'; '.join(failed)}")
        return False
    print(f"OK: {'; '.join(detail for _, detail in verdicts if detail)}, within the tolerance {tol:g}")
    return True


def main(argv: list[str] | None = None) -> int:
    """The exit code: 0, 1 for runs that differ, 2 and one line for a bad argument (errors.py's)."""
    return run_with_exit_codes(lambda: run(argv))


def run(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "runs", nargs="*", metavar="RUN_DIR", help="dump folders (or metrics.jsonl files) to plot"
    )
    parser.add_argument("-o", "--output", default="metrics.png", help="image to write (default: metrics.png)")
    parser.add_argument(
        "--compare", nargs=2, metavar=("RUN_A", "RUN_B"), help="compare the losses of two runs"
    )
    parser.add_argument(
        "--tol", type=float, default=1e-5, help="largest allowed |loss difference| (default 1e-5)"
    )
    args = parser.parse_args(argv)
    if not args.runs and not args.compare:
        parser.error("give run directories to plot, or --compare RUN_A RUN_B")
    if args.compare:
        return 0 if compare(*args.compare, args.tol) else 1
    plot(args.runs, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
