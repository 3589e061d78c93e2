"""Pre-train a Llama model: `torchrun ... train.py --job.config_file F [--section.key VALUE ...]`."""

import contextlib
import gc
import os
import sys
import time
import warnings

import torch
import torch.nn.functional as F
from torch.distributed.tensor.parallel import loss_parallel

from torchtitan.checkpoint import CheckpointManager, TrainState
from torchtitan.config_manager import ConfigError, JobConfig, Training, parse_args, resolve_path
from torchtitan.datasets.hf_datasets import build_hf_data_loader
from torchtitan.datasets.tokenizer import Tokenizer
from torchtitan.distributed import (
    clip_grad_norm_,
    dist_mean,
    dist_sum,
    init_distributed,
    set_collective_timeout,
)
from torchtitan.logging import init_logger, logger
from torchtitan.metrics import MetricLogger, StepMetrics, flops_per_token, peak_flops
from torchtitan.models.llama import Transformer, llama2_configs, llama3_configs
from torchtitan.optimizer import build_lr_scheduler, build_optimizer
from torchtitan.parallelisms.parallel_dims import ParallelDims
from torchtitan.parallelisms.parallelize_llama import (
    DTYPES,
    parallelize_llama,
    set_grad_all_reduce,
    validate_parallelism,
)
from torchtitan.parallelisms.pipeline_llama import pipeline_llama, validate_pipeline
from torchtitan.preflight import EXIT_COMM_FAILURE, EXIT_OK, check_job, debug_enabled
from torchtitan.profiling import maybe_enable_memory_snapshot, maybe_enable_profiling, validate_profiling
from torchtitan.reliability import NonFiniteGuard, StopRequest, bad_input, one_line_error

MODEL_CONFIGS = {"llama2": llama2_configs, "llama3": llama3_configs}


def loss_fn(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over the tokens of a batch (or of a pipeline micro-batch)."""
    return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten())


def gradient_accumulation_steps(training: Training, parallel_dims: ParallelDims) -> int:
    """Micro-batches per optimizer step: training.global_batch_size / (batch_size x DP degree)."""
    per_pass = training.batch_size * parallel_dims.dp_degree
    if training.global_batch_size == -1:
        return 1
    if training.global_batch_size < per_pass or training.global_batch_size % per_pass:
        raise ConfigError(
            f"training.global_batch_size: {training.global_batch_size} is not a multiple of batch_size x DP "
            f"degree = {training.batch_size} x {parallel_dims.dp_degree}; use -1 or a multiple of {per_pass}"
        )
    if training.global_batch_size > per_pass and parallel_dims.pp_enabled:
        raise ConfigError(
            "training.global_batch_size: gradient accumulation is not supported with pipeline parallelism; "
            "raise parallelism.pipeline_parallel_microbatches and training.batch_size instead"
        )
    return training.global_batch_size // per_pass


def check_layout(cfg: JobConfig, world_size: int, device_type: str) -> ParallelDims:
    """The job's parallel degrees, checked (with the flavour, the pipeline split and the batch
    arithmetic) before anything is built: a ConfigError names the first bad option."""
    parallel_dims = ParallelDims(
        dp_shard=cfg.parallelism.data_parallel_shard_degree,
        world_size=world_size,
        dp_replicate=cfg.parallelism.data_parallel_replicate_degree,
        tp=cfg.parallelism.tensor_parallel_degree,
        pp=cfg.parallelism.pipeline_parallel_degree,
        enable_loss_parallel=cfg.parallelism.enable_loss_parallel,
    )
    flavors = MODEL_CONFIGS[cfg.model.name]
    if cfg.model.flavor not in flavors:
        raise ConfigError(
            f"model.flavor: {cfg.model.name} has no flavor {cfg.model.flavor!r}; "
            f"choose one of {', '.join(flavors)}"
        )
    validate_parallelism(cfg, parallel_dims, flavors[cfg.model.flavor], device_type)
    if parallel_dims.pp_enabled:
        validate_pipeline(cfg, flavors[cfg.model.flavor].n_layers)
    gradient_accumulation_steps(cfg.training, parallel_dims)
    return parallel_dims


def set_determinism(seed: int, deterministic: bool) -> None:
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def main(job_config: JobConfig) -> int:
    cfg = job_config
    warnings.filterwarnings("ignore", message=".*set_vital.*")  # torchdata's own deprecated call
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # DCP on one process
    world_size, rank, device = init_distributed(cfg.comm.init_timeout_seconds)
    init_logger(rank)
    logger.info(f"Starting job: {cfg.job.description}")
    if cfg.job.print_args:
        logger.info(f"Configuration: {cfg.to_dict()}")

    parallel_dims = check_layout(cfg, world_size, device.type)
    validate_profiling(cfg.profiling, device)
    grad_accum_steps = gradient_accumulation_steps(cfg.training, parallel_dims)
    world_mesh = parallel_dims.build_mesh(device.type) if world_size > 1 else None
    set_collective_timeout(cfg.comm.init_timeout_seconds)  # the mesh's groups too
    dp_mesh = world_mesh[parallel_dims.dp_mesh_name()] if parallel_dims.dp_enabled else None
    pp_mesh = world_mesh["pp"] if parallel_dims.pp_enabled else None
    dp_degree, dp_rank = (dp_mesh.size(), dp_mesh.get_local_rank()) if dp_mesh is not None else (1, 0)
    set_determinism(cfg.training.seed, cfg.training.deterministic)

    with bad_input("model.tokenizer_path"):
        tokenizer = Tokenizer(resolve_path(cfg.model.tokenizer_path))
    if 0 < cfg.model.vocab_size < tokenizer.n_words:
        raise ConfigError(
            f"model.vocab_size: {cfg.model.vocab_size} is smaller than the tokenizer's {tokenizer.n_words} "
            "tokens; use -1 or a larger value"
        )
    with bad_input("training.dataset_path" if cfg.training.dataset_path else "training.dataset"):
        data_loader = build_hf_data_loader(
            cfg.training.dataset,
            cfg.training.dataset_path,
            tokenizer,
            batch_size=cfg.training.batch_size,
            seq_len=cfg.training.seq_len,
            dp_world_size=dp_degree,
            dp_rank=dp_rank,
            grad_accum_steps=grad_accum_steps,
        )

    model_args = MODEL_CONFIGS[cfg.model.name][cfg.model.flavor]
    model_args.vocab_size = max(cfg.model.vocab_size, tokenizer.n_words)
    model_args.max_seq_len = cfg.training.seq_len
    with torch.device("meta"):
        model = Transformer.from_model_args(model_args)
    num_params = model.num_params(exclude_embedding=False)
    num_flop_params = model.num_params(exclude_embedding=True)
    logger.info(f"Model {cfg.model.name} {cfg.model.flavor}: {num_params:,} parameters")

    # model_parts: the modules this rank trains (its pipeline stages, or the whole model).
    if parallel_dims.pp_enabled:
        pp_schedule, model_parts, has_first_stage, has_last_stage = pipeline_llama(
            model, world_mesh, parallel_dims, cfg, device, loss_fn
        )
        del model
    else:
        model = parallelize_llama(model, world_mesh, parallel_dims, cfg)
        model_parts = [model]
    for part in model_parts:
        part.to_empty(device=device)
        part.init_weights(seed=cfg.training.seed)
        part.train()

    optimizer = build_optimizer(model_parts, cfg.optimizer)
    lr_scheduler = build_lr_scheduler(optimizer, cfg.lr_scheduler, cfg.training.steps)
    train_state = TrainState()
    checkpoint = CheckpointManager(model_parts, optimizer, lr_scheduler, data_loader, train_state, cfg)
    resumed_step = checkpoint.load()
    if resumed_step is not None:
        logger.info(f"Resumed from step {resumed_step}")

    param_dtype = DTYPES[cfg.training.mixed_precision_param]
    # Without FSDP/DDP there is no MixedPrecisionPolicy to cast parameters, so autocast does it.
    autocast = (
        torch.autocast(device.type, dtype=param_dtype)
        if not parallel_dims.dp_enabled and param_dtype != torch.float32
        else contextlib.nullcontext()
    )
    head_dim = model_args.dim // model_args.n_heads
    metric_logger = MetricLogger(
        dump_folder=cfg.job.dump_folder,
        total_steps=cfg.training.steps,
        flops_per_token=flops_per_token(
            num_flop_params,
            model_args.n_layers,
            model_args.n_heads,
            head_dim,
            cfg.training.seq_len,
        ),
        peak_flops=peak_flops(device, param_dtype),
        device=device,
        enable_wandb=cfg.metrics.enable_wandb,
        color=cfg.metrics.enable_color_printing,
        is_logging_rank=rank == 0,
        config=cfg.to_dict(),
    )

    gc.disable()
    gc.collect(1)
    data_iterator = iter(data_loader)
    params = [p for part in model_parts for p in part.parameters() if p.requires_grad]
    # Per device, for tokens/s and MFU: pipeline and tensor-parallel ranks share the work of each token.
    tokens_per_rank = grad_accum_steps * cfg.training.batch_size * cfg.training.seq_len
    tokens_per_step = tokens_per_rank / (parallel_dims.pp * parallel_dims.tp)
    # Loss parallel: the cross entropy (forward and backward) on vocabulary-sharded logits.
    train_context = loss_parallel if parallel_dims.loss_parallel_enabled else contextlib.nullcontext
    # Compiled, the loss fuses the upcast, log-softmax and their backward over the (large) logits:
    # +3% tokens/s and -4 GiB on a 1B model (docs/performance.md).
    compile_loss = cfg.training.compile and not parallel_dims.loss_parallel_enabled
    step_loss_fn = torch.compile(loss_fn) if compile_loss else loss_fn
    window_start, window_steps, data_time = time.perf_counter(), 0, 0.0
    start = time.perf_counter()
    stop_request = StopRequest()  # SIGTERM/SIGUSR1: save and stop after a step
    nonfinite = NonFiniteGuard(cfg.training.skip_nonfinite_steps)
    logger.info(
        f"Training steps {train_state.step + 1} to {cfg.training.steps} (global batch "
        f"{grad_accum_steps} x {cfg.training.batch_size * dp_degree} x {cfg.training.seq_len} tokens)"
    )
    # Entered here and closed after the loop, rather than in a `with` around it, to keep the loop flat.
    profilers = contextlib.ExitStack()
    torch_profiler = profilers.enter_context(maybe_enable_profiling(cfg, rank, train_state.step))
    memory_profiler = profilers.enter_context(maybe_enable_memory_snapshot(cfg, rank, train_state.step))
    while train_state.step < cfg.training.steps:
        train_state.step += 1
        step = train_state.step
        if step % cfg.training.gc_freq == 0:
            gc.collect(1)

        optimizer.zero_grad()
        # Gradient accumulation: the gradients of grad_accum_steps micro-batches add up to the
        # gradient of their mean loss; replicas (HSDP/DDP) all-reduce after the last one only.
        microbatch_losses = []
        for microbatch in range(grad_accum_steps):
            data_start = time.perf_counter()
            inputs, labels = next(data_iterator)
            inputs, labels = inputs.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            data_time += time.perf_counter() - data_start
            for part in model_parts:
                set_grad_all_reduce(part, microbatch == grad_accum_steps - 1)

            with train_context():
                if parallel_dims.pp_enabled:
                    # The schedule runs forward and backward over the micro-batches; only the rank holding
                    # the last stage gets their losses (the others count 0 and the log sums over pp). The
                    # logits are not returned: the last stage would keep every micro-batch's and concatenate.
                    losses = []
                    targets = labels if has_last_stage else None
                    with autocast:
                        if has_first_stage:
                            pp_schedule.step(inputs, target=targets, losses=losses, return_outputs=False)
                        else:
                            pp_schedule.step(target=targets, losses=losses, return_outputs=False)
                    loss = torch.stack(losses).mean() if has_last_stage else torch.zeros((), device=device)
                else:
                    with autocast:
                        logits = model(inputs)
                    loss = step_loss_fn(logits, labels)
                    del logits
                    (loss / grad_accum_steps).backward()
            microbatch_losses.append(loss.detach())
        loss = torch.stack(microbatch_losses).mean()
        grad_norm = clip_grad_norm_(params, cfg.training.max_norm, pp_mesh)
        if nonfinite.step_ok(step, grad_norm):
            optimizer.step()
        lr_scheduler.step()
        window_steps += 1

        last_step = step == cfg.training.steps
        if step == 1 or step % cfg.metrics.log_freq == 0 or last_step:
            if parallel_dims.pp_enabled:
                loss = dist_sum(loss, pp_mesh)
            loss_value = dist_mean(loss, dp_mesh)
            now = time.perf_counter()
            metric_logger.log(
                StepMetrics(
                    step,
                    loss_value,
                    grad_norm.item(),
                    lr_scheduler.get_last_lr()[0],
                    tokens_per_step * window_steps,
                    now - start,
                    nonfinite.skipped,
                ),
                steps_in_window=window_steps,
                step_time=now - window_start,
                data_time=data_time,
            )
            window_start, window_steps, data_time = time.perf_counter(), 0, 0.0
            nonfinite.check(step, loss_value)
        stop = stop_request.agreed(device)  # the same answer on every rank
        if checkpoint.will_save(step, last_step, force=stop):
            nonfinite.check(step)  # never save a non-finite state
        checkpoint.maybe_save(step, last_step, force=stop)
        if step == 1:
            set_collective_timeout(cfg.comm.train_timeout_seconds)
        if torch_profiler:
            torch_profiler.step()
        if memory_profiler:
            memory_profiler.step()
        if stop:
            break

    profilers.close()
    checkpoint.close()
    metric_logger.close()
    if train_state.step < cfg.training.steps:
        return stop_request.finish(train_state.step, saved=checkpoint.enabled)
    if torch.distributed.is_initialized():
        # Ranks that tear their process group down while a peer still uses it can abort at exit.
        torch.distributed.barrier()
    logger.info("Training completed")
    return EXIT_OK


def run(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (listed in torchtitan/preflight.py). Bad input, a non-finite
    step and a failed collective are one line on stderr; TITAN_DEBUG=1 shows their traceback."""
    job_config = None
    try:
        job_config = parse_args(argv)
        check_job(job_config, int(os.environ.get("WORLD_SIZE", "1")))
        return main(job_config)
    except BaseException as e:  # DCP's CheckpointException is one; the others are re-raised
        known = one_line_error(e, int(os.environ.get("RANK", "0")), job_config and job_config.comm)
        if known is None or debug_enabled():
            raise
        print(f"error: {known[1]}", file=sys.stderr)
        if known[0] == EXIT_COMM_FAILURE:
            # A process group that lost a peer cannot be torn down: destroying it (or letting the
            # interpreter do so at exit) can abort the process and replace this exit code by SIGABRT.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(known[0])
        return known[0]
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(run())
