"""The default recipe's stored loss curve, which CI holds the code to (tests/test_loss_curve.py).

    python scripts/loss_curve.py            # train the recipe and compare it with the stored curve
    python scripts/loss_curve.py --update   # train it and store its curve

The curve is train_configs/debug_model.toml's 100 steps on one process, trained in float64
(training.float64: the recipe otherwise as `./run_llama_train.sh` trains it): every step's loss and
gradient norm, and the validation loss at steps 50 and 100, in tests/assets/losses/debug_model.json.
float64 makes it the same on any x86-64 machine by construction. In fp32 it could not be: kernels that
add in another order round differently by ~1e-7 relative, and 100 steps of training grow that to
1e-6-1e-5 (an AVX-512 and an AVX2 machine 1e-5 apart by step 17; an Intel Xeon and an AMD EPYC 5e-6
apart by step 17, 155 values beyond 1e-6) even with every kernel choice pinned: ATen's AVX2 kernels,
MKL's COMPATIBLE,STRICT path, which MKL_VERBOSE shows honoured on the Intel machine and on the AMD one
alike (`CNR:COMPATIBLE,STRICT`; MKL_CBWR=AVX2 it ignores on AMD: `CNR:AUTO`), and two threads. In
float64 the same reorderings move sums by ~1e-16 relative: tests/test_loss_curve.py lists the kernel
paths measured (MKL's code paths, ATen's SIMD width, the thread count) and how far each moves the
curve, all within TOL, while a wrong normalisation of the loss moves it by 4e4 TOL.
One thing float64 does not cover: the init is sampled in float32, as the recipe samples it (so the
curve is the fp32 command's run in higher precision, and README's quoted line stays checkable against
it), and ATen's fp32 samplers round differently by SIMD width (an ulp on 40% of trunc_normal_'s values
between its baseline and AVX2 kernels). The run pins ATen to its AVX2 kernels (ATEN_CPU_CAPABILITY),
which every x86-64 machine CI runs on has: the same instructions, the same samples, on Intel and AMD.
The run uses two intra-op threads (OMP_NUM_THREADS), whatever the cores: small matrices gain nothing
from more.
A change that moves the numerics (the model, its init, the data order, the optimizer, the loss) makes
the comparison fail; when the move is meant, --update stores the new curve and the commit says why.
Exit code 1 when a value differs from the stored one by more than --tol (default TOL).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
CURVE = ROOT / "tests" / "assets" / "losses" / "debug_model.json"
RECIPE = "train_configs/debug_model.toml"
# The largest difference from the stored curve that counts as the same numerics (the docstring says why).
TOL = 1e-7
# Every step logged; no checkpoints (they take time and change nothing).
ARGS = [
    *("--job.config_file", RECIPE, "--training.float64", "true"),
    *("--metrics.log_freq", "1", "--checkpoint.enable_checkpoint", "false"),
]


def start(dump_folder: Path, niceness: int = 0) -> subprocess.Popen:
    """train.py run as a program on the recipe, its output in dump_folder/train.log; `niceness`: its
    CPU priority (19, the lowest: it takes only the time other processes leave idle)."""
    env = dict(os.environ, OMP_NUM_THREADS="2", WANDB_MODE="disabled", PYTHONPATH=str(ROOT))
    env["ATEN_CPU_CAPABILITY"] = "avx2"  # the init's fp32 samples, the same on every x86-64 (docstring)
    cmd = [sys.executable, str(ROOT / "train.py"), *ARGS, "--job.dump_folder", str(dump_folder)]
    if niceness:
        cmd = ["nice", "-n", str(niceness), *cmd]
    dump_folder.mkdir(parents=True, exist_ok=True)
    with open(dump_folder / "train.log", "w") as log:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def finish(process: subprocess.Popen, dump_folder: Path) -> dict:
    """The curve of a run `start` began, once it ends, read back from its metrics.jsonl."""
    if process.wait() != 0:
        log = (dump_folder / "train.log").read_text()
        raise RuntimeError(f"train.py exited with {process.returncode}:\n{log[-3000:]}")
    records = [json.loads(line) for line in (dump_folder / "metrics.jsonl").read_text().splitlines()]
    return {
        "command": ["train.py", *ARGS],
        "torch": torch.__version__,
        "loss": {r["step"]: r["loss"] for r in records if "loss" in r},
        "grad_norm": {r["step"]: r["grad_norm"] for r in records if "grad_norm" in r},
        "validation_loss": {r["step"]: r["validation_loss"] for r in records if "validation_loss" in r},
    }


def train(dump_folder: Path) -> dict:
    """The recipe's curve, its progress printed every 10 steps (a run takes minutes)."""
    process, shown = start(dump_folder), 0
    while process.poll() is None:
        time.sleep(2)
        metrics = dump_folder / "metrics.jsonl"
        steps = metrics.read_text().count('"loss"') if metrics.exists() else 0
        if steps >= shown + 10:
            shown = steps - steps % 10
            print(f"step {shown}/100", flush=True)
    return finish(process, dump_folder)


def stored() -> dict:
    curve = json.loads(CURVE.read_text())
    for key in ("loss", "grad_norm", "validation_loss"):
        curve[key] = {int(step): value for step, value in curve[key].items()}
    return curve


def differences(run: dict, reference: dict, tol: float) -> list[str]:
    """One line per value of `run` more than `tol` away from `reference`'s (or missing on one side)."""
    lines = []
    for key in ("loss", "grad_norm", "validation_loss"):
        if sorted(run[key]) != sorted(reference[key]):
            lines.append(f"{key}: logged at steps {sorted(run[key])}, stored at {sorted(reference[key])}")
            continue
        for step, value in run[key].items():
            if abs(value - reference[key][step]) > tol:
                lines.append(f"{key} at step {step}: {value!r}, stored {reference[key][step]!r}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--update", action="store_true", help="store this run's curve")
    parser.add_argument(
        "--tol", type=float, default=TOL, help=f"largest difference allowed (default {TOL:g})"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="loss-curve-") as tmp:
        run = train(Path(tmp))
    if args.update:
        CURVE.parent.mkdir(parents=True, exist_ok=True)
        CURVE.write_text(json.dumps(run, indent=1) + "\n")
        print(f"stored {len(run['loss'])} steps in {CURVE.relative_to(ROOT)}")
        return 0
    lines = differences(run, stored(), args.tol)
    print("\n".join(lines) or f"the curve is the stored one (within {args.tol:g})")
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())
