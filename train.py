"""Pre-train a language model: `torchrun ... train.py --job.config_file F [--section.key VALUE ...]`."""

import functools
import gc
import os
import warnings

import torch

from torchtitan.checkpoint.manager import CheckpointManager
from torchtitan.checkpoint.state import TrainState
from torchtitan.config.options import JobConfig
from torchtitan.config.paths import resolve_path
from torchtitan.config_rules import check_layout
from torchtitan.datasets.build import build_training_data_loader
from torchtitan.datasets.layout import BatchLayout
from torchtitan.datasets.tokenizer import build_tokenizer
from torchtitan.errors import EXIT_OK, bad_input
from torchtitan.logging import init_logger, logger
from torchtitan.metrics import MetricLogger, peak_flops
from torchtitan.models import build_model_args, model_spec
from torchtitan.objective import Objective
from torchtitan.optimizers import build_lr_scheduler, build_optimizer
from torchtitan.parallelisms.distributed import (
    clip_grad_norm_,
    global_mean_loss,
    init_distributed,
    set_collective_timeout,
)
from torchtitan.parallelisms.float8 import float8_scales_are_precomputed, precompute_float8_scales
from torchtitan.parallelisms.parallelize import DTYPES
from torchtitan.profiling import maybe_enable_profilers
from torchtitan.reliability.entry import exit_process, run_job
from torchtitan.reliability.guards import NonFiniteGuard, StopRequest
from torchtitan.train_step import TrainStep, parallelize_model
from torchtitan.validation import Validator


def set_determinism(seed: int, deterministic: bool) -> None:
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def main(job_config: JobConfig) -> int:
    training = job_config.training
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # DCP on one process
    world_size, rank, device = init_distributed(job_config.comm.init_timeout_seconds)
    init_logger(rank)
    logger.info(f"Starting job: {job_config.job.description}")
    if job_config.job.print_args:
        logger.info(f"Configuration: {job_config.to_dict()}")

    cuda_capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    parallel_dims = check_layout(job_config, world_size, device.type, cuda_capability)
    meshes = parallel_dims.build_meshes(device.type)
    set_collective_timeout(job_config.comm.init_timeout_seconds)  # the mesh's groups too
    dp_degree, dp_rank = meshes.dp_degree_and_rank
    set_determinism(training.seed, training.deterministic)

    with bad_input("model.tokenizer_path"):
        tokenizer = build_tokenizer(resolve_path(job_config.model.tokenizer_path))
    spec = model_spec(job_config.model)
    model_args = build_model_args(job_config, tokenizer.n_words, tokenizer.eos_id, tokenizer.bos_id)
    if training.float64:  # every float tensor made without a dtype, and every upcast (llama.model.upcast)
        torch.set_default_dtype(torch.float64)
    with torch.device("meta"):
        model = spec.build(model_args)
    logger.info(f"Model {job_config.model.name} {job_config.model.flavor}: {model.num_params():,} parameters")
    num_flop_params = model.num_params(exclude_embedding=True)

    # What training minimises (torchtitan/objective/): the step, the pipeline and validation score with it.
    objective = Objective(job_config, model_args, parallel_dims, meshes, device)
    # model_parts: the modules this rank trains (its pipeline stages, or the whole model).
    model_parts, pipeline = parallelize_model(
        model, meshes.world, parallel_dims, job_config, device, objective
    )
    del model
    for part in model_parts:
        part.to_empty(device=device)
        part.init_weights(seed=training.seed)
        part.train()

    train_step = TrainStep(model_parts, pipeline, objective, parallel_dims, training, device, meshes.cp)
    # This rank's rows of each global batch, in the step's micro-batches (gradient accumulation).
    layout = BatchLayout(training.batch_size, dp_degree, dp_rank, train_step.grad_accum_steps)
    pin_memory = device.type == "cuda"
    data_loader = build_training_data_loader(
        training, tokenizer, layout, model_args.vocab_size, pin_memory, job_config.chat
    )

    optimizer = build_optimizer(model_parts, job_config.optimizer)
    lr_scheduler = build_lr_scheduler(optimizer, job_config.lr_scheduler, training.steps)
    train_state = TrainState()
    checkpoint = CheckpointManager(model_parts, optimizer, lr_scheduler, data_loader, train_state, job_config)
    resumed_step = checkpoint.load()
    if resumed_step is not None:
        logger.info(f"Resumed from step {resumed_step}")

    validator = None
    if job_config.validation.enable:
        validator = Validator(job_config, train_step, tokenizer, meshes)

    # The job's input is checked above; the dump folder is first written below (metrics.jsonl, W&B), so a
    # refused job leaves it as it was.
    # Per device, for tokens/s and MFU: pipeline, context- and tensor-parallel ranks share each token's work.
    tokens_per_rank = layout.grad_accum_steps * training.batch_size * training.seq_len
    metric_logger = MetricLogger(
        job_config,
        spec.flops_per_token(model_args, num_flop_params, training.seq_len),
        peak_flops(device, DTYPES[training.mixed_precision_param]),
        tokens_per_step=tokens_per_rank / (parallel_dims.pp * parallel_dims.cp * parallel_dims.tp),
        device=device,
        is_logging_rank=rank == 0,
    )
    params = [p for part in model_parts for p in part.parameters() if p.requires_grad]
    # Float8 FSDP all-gathers: the next step's weight scales, in one all-reduce after each update.
    precompute_scales = float8_scales_are_precomputed(job_config, parallel_dims)
    stop_request = StopRequest()  # SIGTERM/SIGUSR1: save and stop after a step
    nonfinite = NonFiniteGuard(training.skip_nonfinite_steps)
    logger.info(
        f"Training steps {train_state.step + 1} to {training.steps} (global batch "
        f"{layout.grad_accum_steps} x {training.batch_size * dp_degree} x {training.seq_len} tokens)"
    )

    gc.disable()
    gc.collect(1)
    batches = metric_logger.timed(iter(data_loader))
    with maybe_enable_profilers(job_config, rank, train_state.step) as profile_step:
        while train_state.step < training.steps:
            train_state.step += 1
            step = train_state.step
            if step % training.gc_freq == 0:
                gc.collect(1)

            optimizer.zero_grad()
            lr = lr_scheduler.get_last_lr()[0]  # this step's: the scheduler steps after the update
            loss = train_step.forward_backward(batches)
            grad_norm = clip_grad_norm_(params, training.max_norm, meshes.pp)
            if nonfinite.step_ok(step, grad_norm):
                optimizer.step()
                if precompute_scales:
                    precompute_float8_scales(model_parts)
            lr_scheduler.step()
            terms = objective.step_done()  # the loss terms' metrics (a mixture of experts' biases move)
            metric_logger.step_done()

            if metric_logger.should_log(step):
                loss_value = global_mean_loss(loss, meshes)
                metric_logger.log(
                    step,
                    loss_value,
                    grad_norm.item(),
                    lr,
                    nonfinite.skipped,
                    data_loader.tokens_by_source(),
                    {name: value.item() for name, value in terms.items()},
                    objective.trained_tokens,
                )
                nonfinite.check(step, loss_value)
            if validator is not None and validator.should_validate(step):
                result = validator.validate()
                metric_logger.log_validation(
                    step, result.loss, result.perplexity, result.tokens, result.seconds, validator.data
                )
            stop = stop_request.agreed(device)  # the same answer on every rank
            # Never save a non-finite state.
            before_save = functools.partial(nonfinite.check, step)
            checkpoint.maybe_save(step, step == training.steps, force=stop, before_save=before_save)
            if step == 1:
                set_collective_timeout(job_config.comm.train_timeout_seconds)
            profile_step()
            if stop:
                break

    checkpoint.close()
    metric_logger.close()
    if train_state.step < training.steps:
        return stop_request.finish(train_state.step, saved=checkpoint.enabled)
    if torch.distributed.is_initialized():
        # Ranks that tear their process group down while a peer still uses it can abort at exit.
        torch.distributed.barrier()
    logger.info("Training completed")
    return EXIT_OK


def run(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (torchtitan/errors.py lists them). Bad input, a
    non-finite step and a failed collective are one line on stderr; TITAN_DEBUG=1 shows a traceback."""
    return run_job(main, argv)


if __name__ == "__main__":
    exit_process(run())
