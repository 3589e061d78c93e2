"""Pre-train a Llama model: `torchrun ... train.py --job.config_file F [--section.key VALUE ...]`."""

import contextlib
import gc
import os
import sys
import time
import warnings

import torch
import torch.nn.functional as F

from torchtitan.checkpoint import CheckpointManager, TrainState
from torchtitan.config_manager import ConfigError, JobConfig, parse_args, resolve_path
from torchtitan.datasets.hf_datasets import build_hf_data_loader
from torchtitan.datasets.tokenizer import Tokenizer
from torchtitan.distributed import clip_grad_norm_, dist_mean, init_distributed, set_collective_timeout
from torchtitan.logging import init_logger, logger
from torchtitan.metrics import MetricLogger, StepMetrics, flops_per_token, peak_flops
from torchtitan.models.llama import Transformer, llama2_configs, llama3_configs
from torchtitan.optimizer import build_lr_scheduler, build_optimizer
from torchtitan.parallelisms.parallel_dims import ParallelDims
from torchtitan.parallelisms.parallelize_llama import DTYPES, parallelize_llama

MODEL_CONFIGS = {"llama2": llama2_configs, "llama3": llama3_configs}


def set_determinism(seed: int, deterministic: bool) -> None:
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def main(job_config: JobConfig) -> None:
    cfg = job_config
    warnings.filterwarnings("ignore", message=".*set_vital.*")  # torchdata's own deprecated call
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # DCP on one process
    world_size, rank, device = init_distributed(cfg.comm.init_timeout_seconds)
    init_logger(rank)
    logger.info(f"Starting job: {cfg.job.description}")
    if cfg.job.print_args:
        logger.info(f"Configuration: {cfg.to_dict()}")

    parallel_dims = ParallelDims(dp_shard=cfg.parallelism.data_parallel_shard_degree, world_size=world_size)
    world_mesh = parallel_dims.build_mesh(device.type) if world_size > 1 else None
    dp_mesh = world_mesh[parallel_dims.dp_mesh_name()] if parallel_dims.dp_enabled else None
    dp_degree, dp_rank = (dp_mesh.size(), dp_mesh.get_local_rank()) if dp_mesh is not None else (1, 0)
    set_determinism(cfg.training.seed, cfg.training.deterministic)

    flavors = MODEL_CONFIGS[cfg.model.name]
    if cfg.model.flavor not in flavors:
        raise ConfigError(
            f"model.flavor: {cfg.model.name} has no flavor {cfg.model.flavor!r}; "
            f"choose one of {', '.join(flavors)}"
        )
    tokenizer = Tokenizer(resolve_path(cfg.model.tokenizer_path))
    data_loader = build_hf_data_loader(
        cfg.training.dataset,
        cfg.training.dataset_path,
        tokenizer,
        batch_size=cfg.training.batch_size,
        seq_len=cfg.training.seq_len,
        dp_world_size=dp_degree,
        dp_rank=dp_rank,
    )

    model_args = flavors[cfg.model.flavor]
    model_args.vocab_size = tokenizer.n_words
    model_args.max_seq_len = cfg.training.seq_len
    with torch.device("meta"):
        model = Transformer.from_model_args(model_args)
    num_params = model.num_params(exclude_embedding=False)
    logger.info(f"Model {cfg.model.name} {cfg.model.flavor}: {num_params:,} parameters")

    model = parallelize_llama(model, world_mesh, parallel_dims, cfg)
    model.to_empty(device=device)
    model.init_weights(seed=cfg.training.seed)
    model.train()

    optimizer = build_optimizer(model, cfg.optimizer)
    lr_scheduler = build_lr_scheduler(optimizer, cfg.lr_scheduler, cfg.training.steps)
    train_state = TrainState()
    checkpoint = CheckpointManager(model, optimizer, lr_scheduler, data_loader, train_state, cfg)
    resumed_step = checkpoint.load()
    if resumed_step is not None:
        logger.info(f"Resumed from step {resumed_step}")

    param_dtype = DTYPES[cfg.training.mixed_precision_param]
    # Without FSDP there is no MixedPrecisionPolicy to cast parameters, so autocast does it.
    autocast = (
        torch.autocast(device.type, dtype=param_dtype)
        if not parallel_dims.dp_shard_enabled and param_dtype != torch.float32
        else contextlib.nullcontext()
    )
    head_dim = model_args.dim // model_args.n_heads
    metric_logger = MetricLogger(
        dump_folder=cfg.job.dump_folder,
        total_steps=cfg.training.steps,
        flops_per_token=flops_per_token(
            model.num_params(exclude_embedding=True),
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
    params = [p for p in model.parameters() if p.requires_grad]
    tokens_per_step = cfg.training.batch_size * cfg.training.seq_len
    window_start, window_steps, data_time = time.perf_counter(), 0, 0.0
    start = time.perf_counter()
    logger.info(
        f"Training steps {train_state.step + 1} to {cfg.training.steps} "
        f"(global batch {cfg.training.batch_size * dp_degree} x {cfg.training.seq_len} tokens)"
    )
    while train_state.step < cfg.training.steps:
        train_state.step += 1
        step = train_state.step
        if step % cfg.training.gc_freq == 0:
            gc.collect(1)

        data_start = time.perf_counter()
        inputs, labels = next(data_iterator)
        inputs, labels = inputs.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        data_time += time.perf_counter() - data_start

        optimizer.zero_grad()
        with autocast:
            logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        del logits
        loss.backward()
        grad_norm = clip_grad_norm_(params, cfg.training.max_norm)
        optimizer.step()
        lr_scheduler.step()
        window_steps += 1

        last_step = step == cfg.training.steps
        if step == 1 or step % cfg.metrics.log_freq == 0 or last_step:
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
                ),
                steps_in_window=window_steps,
                step_time=now - window_start,
                data_time=data_time,
            )
            window_start, window_steps, data_time = time.perf_counter(), 0, 0.0
        checkpoint.maybe_save(step, last_step)
        if step == 1:
            set_collective_timeout(cfg.comm.train_timeout_seconds)

    metric_logger.close()
    logger.info("Training completed")


def run(argv: list[str] | None = None) -> int:
    """Entry point: config errors become one line on stderr and exit code 2."""
    try:
        job_config = parse_args(argv)
        main(job_config)
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(run())
