r"""Print a checkpoint's held-out loss and perplexity, on any number of processes and any layout.

    .venv/bin/python scripts/evaluate.py --job.config_file F --job.dump_folder D [--checkpoint.load_step N |
        --checkpoint.initial_load_path P] [--validation.dataset_path ...] [--section.key VALUE ...]
    .venv/bin/python -m torchtitan.reliability.launcher --nproc_per_node 4 --local-ranks-filter 0 \
        scripts/evaluate.py ... --parallelism.tensor_parallel_degree 2

Several processes are started with the trainer's launcher (run_llama_train.sh's): it ends with the
first failed rank's code and one line, where plain torchrun shows a ChildFailedError traceback.

The model and the data come from the run's own options, as train.py reads them: the checkpoint is
checkpoint.load_step's, else the newest in {dump_folder}/{checkpoint.folder} (weights-only exports
included), else checkpoint.initial_load_path (a DCP checkpoint or a Hugging Face model folder); the
data is the [validation] section's (validation.steps global batches of validation.global_batch_size
sequences, or validation.batch_size per rank; -1: the whole split), whether or not validation.enable
is set. The weights are read through the
safe reader. Exit codes and one-line errors are train.py's.
"""

import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from torchtitan.checkpoint.folder import is_hf_folder, latest_checkpoint_path  # noqa: E402
from torchtitan.checkpoint.hf_reader import load_hf_weights  # noqa: E402
from torchtitan.checkpoint.load import check_model_record, load_model_weights  # noqa: E402
from torchtitan.checkpoint.state import merge_model_parts  # noqa: E402
from torchtitan.config.options import JobConfig  # noqa: E402
from torchtitan.config.paths import resolve_path  # noqa: E402
from torchtitan.config_rules import check_layout  # noqa: E402
from torchtitan.datasets.tokenizer import build_tokenizer  # noqa: E402
from torchtitan.errors import EXIT_OK, bad_input  # noqa: E402
from torchtitan.models import build_model_args, model_spec  # noqa: E402
from torchtitan.objective import Objective  # noqa: E402
from torchtitan.parallelisms.distributed import init_distributed  # noqa: E402
from torchtitan.reliability.entry import exit_process, run_job  # noqa: E402
from torchtitan.train_step import TrainStep, parallelize_model  # noqa: E402
from torchtitan.validation import Validator  # noqa: E402

# Seconds between two progress lines: quiet on a short evaluation, a sign of life on a long one.
PROGRESS_SECONDS = 30.0


class Progress:
    """Says on stderr what is evaluated, then how far it got every PROGRESS_SECONDS: the result
    comes only at the end, which on a large model and split is many minutes away."""

    def __init__(self, path: str, job_config: JobConfig, tokens_per_batch: int) -> None:
        validation = job_config.validation
        batches = "the whole split, in batches" if validation.steps == -1 else f"{validation.steps} batches"
        self.tokens_per_batch = tokens_per_batch
        self.start = self.last = time.perf_counter()
        print(
            f"Evaluating {path} on {validation.dataset_path or validation.dataset}: {batches} "
            f"of {tokens_per_batch:,} tokens",
            file=sys.stderr,
            flush=True,
        )

    def __call__(self, done: int) -> None:
        now = time.perf_counter()
        if now - self.last >= PROGRESS_SECONDS:
            self.last = now
            print(
                f"  {done} batches ({done * self.tokens_per_batch:,} tokens) in {now - self.start:.0f} s",
                file=sys.stderr,
                flush=True,
            )


def evaluate(job_config: JobConfig) -> int:
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # DCP on one process
    world_size, rank, device = init_distributed(job_config.comm.init_timeout_seconds)
    parallel_dims = check_layout(job_config, world_size, device.type)
    meshes = parallel_dims.build_meshes(device.type)
    path = latest_checkpoint_path(job_config)
    hf_folder = is_hf_folder(path)  # the family and shapes are checked as its weights are read
    if not hf_folder:
        check_model_record(path, job_config.model)
    with bad_input("model.tokenizer_path"):
        tokenizer = build_tokenizer(resolve_path(job_config.model.tokenizer_path))
    model_args = build_model_args(job_config, tokenizer.n_words, tokenizer.eos_id, tokenizer.bos_id)
    with torch.device("meta"):
        model = model_spec(job_config.model).build(model_args)
    objective = Objective(job_config, model_args, parallel_dims, meshes, device)
    model_parts, pipeline = parallelize_model(
        model, meshes.world, parallel_dims, job_config, device, objective
    )
    for part in model_parts:
        part.to_empty(device=device)
        part.init_weights(seed=job_config.training.seed)  # the buffers (RoPE), which are not saved
    if hf_folder:
        load_hf_weights(merge_model_parts(model_parts), path, job_config.model, model_args)
    else:
        load_model_weights(model_parts, path, verify=job_config.checkpoint.verify_checksums)
    train_step = TrainStep(
        model_parts, pipeline, objective, parallel_dims, job_config.training, device, meshes.cp
    )
    validator = Validator(job_config, train_step, tokenizer, meshes)
    progress = Progress(path, job_config, validator.tokens_per_batch) if rank == 0 else None
    result = validator.validate(progress)
    if rank == 0:
        print(
            f"{path}: loss {result.loss:.6f}  perplexity {result.perplexity:.4f}  "
            f"({result.tokens:,} tokens, {result.seconds:.1f} s)"
        )
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    return run_job(evaluate, argv, owns_dump_folder=False)  # it only reads: a running job may hold it


if __name__ == "__main__":
    exit_process(main())
