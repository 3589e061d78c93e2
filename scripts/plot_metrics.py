"""Plot and compare training runs from the metrics.jsonl their dump folders hold.

    python scripts/plot_metrics.py RUN_DIR [RUN_DIR ...] -o plot.png
    python scripts/plot_metrics.py --compare RUN_A RUN_B [--tol 1e-5]

The plot overlays the runs' loss, gradient norm, tokens/s and memory against the step. The
comparison prints the loss of every step both runs logged and exits with 1 when they differ by
more than the tolerance (or log different steps), so a script can check that a change of layout
or code leaves training unchanged. A run directory may also be given as its metrics.jsonl.
"""

import argparse
import json
import math
import sys
from pathlib import Path

# (metrics.jsonl key, panel title) for the 2 x 2 grid.
PANELS = [
    ("loss", "loss"),
    ("grad_norm", "gradient norm (before clipping)"),
    ("tps", "tokens / s per device"),
    ("memory_gib", "peak memory (GiB)"),
]


class MetricsError(ValueError):
    """A missing or unreadable metrics file."""


def load_metrics(run: str) -> dict[int, dict]:
    """Records by step. A resumed run appends to the file, so a step logged twice keeps its latest
    record: the one the resumed run wrote."""
    path = Path(run)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise MetricsError(f"{run}: no metrics.jsonl there (give a run's job.dump_folder or the file)")
    records = {}
    with path.open() as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                records[int(record["step"])] = record
            except (ValueError, KeyError, TypeError) as e:
                raise MetricsError(f"{path}, line {line_no}: not a metrics record ({e})") from None
    if not records:
        raise MetricsError(f"{path}: no records")
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


def plot(runs: list[str], output: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [load_metrics(r) for r in runs]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex=True, constrained_layout=True)
    for (key, title), ax in zip(PANELS, axes.flat):
        for label, records in zip(run_labels(runs), metrics):
            points = [(s, r[key]) for s, r in records.items() if r.get(key) is not None]
            if points:
                steps, values = zip(*points)
                ax.plot(steps, values, marker="." if len(steps) < 50 else None, label=label, linewidth=1.5)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.ticklabel_format(axis="y", style="plain", useOffset=False)
    for ax in axes[1]:
        ax.set_xlabel("step")
    axes[0][0].legend(fontsize="small")
    fig.savefig(output, dpi=120)
    print(f"wrote {output}")


def compare(run_a: str, run_b: str, tol: float) -> bool:
    """Print the per-step loss difference; True when every common step is within `tol` and both
    runs logged the same steps."""
    a, b = load_metrics(run_a), load_metrics(run_b)
    common = sorted(a.keys() & b.keys())
    print(f"{'step':>6}  {'loss A':>12}  {'loss B':>12}  {'|A - B|':>10}")
    worst_step, worst = None, 0.0
    for step in common:
        diff = abs(a[step]["loss"] - b[step]["loss"])
        if math.isnan(diff):
            diff = 0.0 if math.isnan(a[step]["loss"]) and math.isnan(b[step]["loss"]) else math.inf
        flag = "  <- over tolerance" if diff > tol else ""
        print(f"{step:>6}  {a[step]['loss']:>12.6f}  {b[step]['loss']:>12.6f}  {diff:>10.3e}{flag}")
        if worst_step is None or diff > worst:
            worst_step, worst = step, diff
    only = {"A": sorted(a.keys() - b.keys()), "B": sorted(b.keys() - a.keys())}
    for name, steps in only.items():
        if steps:
            print(f"steps logged only by {name}: {steps}")
    if not common:
        print("FAIL: no step was logged by both runs")
        return False
    if worst > tol:
        print(f"FAIL: loss differs by {worst:.3e} at step {worst_step}, over the tolerance {tol:g}")
        return False
    if only["A"] or only["B"]:
        print("FAIL: the runs logged different steps")
        return False
    print(f"OK: largest loss difference {worst:.3e} (step {worst_step}), within the tolerance {tol:g}")
    return True


def main(argv: list[str] | None = None) -> int:
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
    try:
        if args.compare:
            return 0 if compare(*args.compare, args.tol) else 1
        plot(args.runs, args.output)
    except MetricsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
