"""Estimate a training job's peak memory per rank without its hardware, or measure it here.

    NGPU=64 python scripts/estimate_memory.py --job.config_file F [--section.key VALUE ...]

builds the job's model and parallel layout with the trainer's own code (parallelisms.parallelize) on fake
tensors, over a fake process group of NGPU ranks (default 8), runs a training step under torch's
MemTracker and prints the peak of a steady-state step (the optimizer state already made), per
rank, split into parameters, gradients, optimizer state and activations. Nothing is allocated and
no GPU is needed. Several --job.config_file give a row each, the other options applying to all;
with pipeline parallelism each pipeline rank gets a row (their stages and in-flight micro-batches
differ). Two shortcuts, exact where they apply (estimate_ranks): with a multi-stage pipeline
schedule, one rank of each kind runs two micro-batches and every rank's step is composed from its
actions; otherwise blocks are alike, so a deep model is simulated at three small depths and
extrapolated. --full simulates the whole step, slowly. The simulations run side by side, one process
each, on the machine's CPUs. Every layout the trainer runs is covered: FSDP, HSDP, DDP, TP, CP, PP
(every schedule), activation checkpointing, gradient accumulation, multi-token prediction, and
mixtures of experts with expert parallelism (simulated whole: no depth extrapolation). Their
routing, which fake tensors cannot tell, is assumed balanced
(torchtitan/memory_estimation/routing.py): each expert takes an equal share of a rank's tokens x
top_k rows, and under EP each rank receives tokens x top_k rows; --expert-load F (1 <= F <= EP) has
the rank's experts receive F times that. Under context parallelism each rank runs seq_len / CP
tokens and gathers the keys and values of the whole sequence (multi-head latent attention: its
latents, expanded on each rank); its attention keeps an output and a log-sum-exp per query, as the
fused kernels do.

    torchrun --nproc_per_node N scripts/estimate_memory.py --measure --job.config_file F [...]

runs the same steps for real on this machine (NCCL on CUDA, gloo on CPU), PP included, and prints
each rank's measured peak: torch.cuda.max_memory_allocated, or on CPU the peak of the bytes the CPU
allocator holds, from the profiler's memory events.

Counted: tensors, as the allocator sees them. Not counted: the CUDA context, NCCL buffers and the
caching allocator's fragmentation (reserved over allocated), which together often add a few GiB.
training.compile is not applied (so this is eager-mode memory, an upper bound for compiled blocks).
"""

import logging
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from torchtitan.config.options import ConfigError  # noqa: E402
from torchtitan.config.parser import parse_args  # noqa: E402
from torchtitan.errors import run_with_exit_codes  # noqa: E402
from torchtitan.memory_estimation.measure import measure  # noqa: E402
from torchtitan.memory_estimation.report import estimate  # noqa: E402


def take_option(argv: list[str], name: str) -> tuple[list[str], list[str]]:
    """(the values of `name`, given as "name value" or "name=value"; the other arguments). A last
    `name` with no value stays among the others."""
    values, rest, i = [], [], 0
    while i < len(argv):
        if argv[i] == name and i + 1 < len(argv):
            values.append(argv[i + 1])
            i += 2
            continue
        if argv[i].startswith(f"{name}="):
            values.append(argv[i].split("=", 1)[1])
        else:
            rest.append(argv[i])
        i += 1
    return values, rest


def split_config_files(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the --job.config_file values, the other arguments)."""
    return take_option(argv, "--job.config_file")


def pop_expert_load(argv: list[str]) -> tuple[float, list[str]]:
    """(--expert-load F, default 1: balanced routing; the other arguments)."""
    loads, rest = take_option(argv, "--expert-load")
    if rest and rest[-1] == "--expert-load":
        loads.append("")
        rest = rest[:-1]
    try:
        load = float(loads[-1]) if loads else 1.0
    except ValueError:
        load = 0.0
    if not load >= 1:
        raise ConfigError(f"--expert-load: expected a number >= 1 (1: balanced routing), got {loads[-1]!r}")
    return load, rest


def main(argv: list[str] | None = None) -> int:
    """The exit code (errors.py's): 2 and one line for a bad option or file."""
    return run_with_exit_codes(lambda: run(sys.argv[1:] if argv is None else argv))


def run(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    # Torch's warnings that tell an estimator's user nothing (the simulation processes are forked, so
    # they inherit these filters): its profiler's schedule, a deprecation inside DeviceMesh's own
    # slicing, and FSDP2's caution about a view returned by a unit (the embedding under TP, the
    # experts), which no caller modifies in place: the parity tests check every layout's gradients.
    warnings.filterwarnings("ignore", message=".*Profiler won't be using warmup.*")
    warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh", category=UserWarning)
    warnings.filterwarnings(
        "ignore", message=r"FSDP2-wrapped module \(\w+\) returned a view tensor", category=UserWarning
    )
    # DTensor's advice to flatten the mesh for the gradient norm's all-reduces: once per process.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    expert_load, argv = pop_expert_load(argv)
    files, rest = split_config_files([a for a in argv if a not in ("--measure", "--full")])
    configs = [parse_args(["--job.config_file", f, *rest]) for f in files] or [parse_args(rest)]
    for job_config in configs:  # a training step's memory (an evaluation's forward holds less)
        job_config.validation.enable = False
    if "--measure" in argv:
        if len(configs) > 1:
            raise ConfigError("--measure: give one --job.config_file")
        measure(configs[0])
        return 0
    ngpu = os.environ.get("NGPU", "8")
    if not (ngpu.isascii() and ngpu.isdigit()) or int(ngpu) < 1:
        raise ConfigError(f"NGPU: expected a positive number of ranks, got {ngpu!r}")
    estimate(configs, int(ngpu), full="--full" in argv, expert_load=expert_load)
    return 0


if __name__ == "__main__":
    sys.exit(main())
