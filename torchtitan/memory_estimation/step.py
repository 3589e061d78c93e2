"""The job's model parts, optimizer and one training step, built with the trainer's own code, on
fake tensors for the estimate or on real ones for --measure."""

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch.distributed.tensor.parallel import loss_parallel

from torchtitan.config_manager import ConfigError, JobConfig, resolve_path
from torchtitan.datasets.tokenizer import Tokenizer
from torchtitan.distributed import clip_grad_norm_
from torchtitan.memory_estimation.torch_internals import FakeTensorMode
from torchtitan.models.llama import Transformer
from torchtitan.optimizer import build_optimizer
from torchtitan.parallelisms.parallel_dims import ParallelDims
from torchtitan.parallelisms.parallelize_llama import DTYPES, parallelize_llama, set_grad_all_reduce
from torchtitan.parallelisms.pipeline_llama import num_microbatches, pipeline_llama, split_model, stage_layers
from train import MODEL_CONFIGS, check_layout, gradient_accumulation_steps, loss_fn

# The trainer's own rules are imported in this module only; the rest of the package takes them from here.
__all__ = ["MODEL_CONFIGS", "SimulatedStep", "build_step", "check_layout", "vocab_size_of"]


def vocab_size_of(cfg: JobConfig) -> int:
    """The embedding rows train.py would use: max(model.vocab_size, the tokenizer's vocabulary).
    The tokenizer file may be missing here when model.vocab_size is set."""
    path = resolve_path(cfg.model.tokenizer_path)
    if not os.path.isfile(path):
        if cfg.model.vocab_size > 0:
            return cfg.model.vocab_size
        raise ConfigError(
            f"model.tokenizer_path: no file {path}; give the vocabulary size instead, e.g. "
            "--model.vocab_size 128256 for Llama 3's tokenizer"
        )
    return max(cfg.model.vocab_size, Tokenizer(path).n_words)


def pipeline_stage_io(
    model: torch.nn.Module,
    world_mesh,
    parallel_dims: ParallelDims,
    cfg: JobConfig,
    device: torch.device,
    fake_mode: FakeTensorMode,
    autocast: torch.autocast,
    vocab_size: int,
) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    """A stage id's example micro-batch input and output, for stages on a fake process group (which
    cannot carry the shapes between them). They come from a probe: the model's two ends alone
    (embeddings, final norm, output), parallelized like a stage, run on one fake micro-batch.
    Blocks keep the shape and dtype of the residual stream, so the embeddings' output is what every
    stage boundary carries."""
    layers = stage_layers(cfg, len(model.layers))
    microbatch = (cfg.training.batch_size // num_microbatches(cfg, len(layers)), cfg.training.seq_len)
    probe = parallelize_llama(split_model(model, range(0), True, True), world_mesh, parallel_dims, cfg)
    boundary = []
    probe.tok_embeddings.register_forward_hook(lambda module, args, output: boundary.append(output))
    with fake_mode:
        probe.to_empty(device=device)
        tokens = torch.randint(0, vocab_size, microbatch, device=device)
        with autocast:
            logits = probe(tokens)
    # Stage outputs and hidden inputs take gradients (those the stages send back).
    hidden, logits = boundary[0].detach().requires_grad_(), logits.detach().requires_grad_()
    return lambda stage_id: (
        tokens if stage_id == 0 else hidden,
        logits if stage_id == len(layers) - 1 else hidden,
    )


@dataclass
class SimulatedStep:
    """A rank's share of the job and the two halves of one training step on random tokens."""

    model_parts: list[torch.nn.Module]
    optimizer: torch.optim.Optimizer
    forward_backward: Callable[[], None]  # with the gradient clipping
    optimizer_step: Callable[[], None]
    schedule: object  # the pipeline schedule, None without PP


def build_step(
    cfg: JobConfig,
    parallel_dims: ParallelDims,
    world_mesh,
    device: torch.device,
    vocab_size: int,
    fake_mode: FakeTensorMode | None = None,
    n_layers: int | None = None,
) -> SimulatedStep:
    """The rank's model parts and optimizer, built as train.py builds them, and its step. With
    `fake_mode` the parameters are fake tensors (run the step under it too); `n_layers` overrides
    the flavour's depth."""
    model_args = replace(
        MODEL_CONFIGS[cfg.model.name][cfg.model.flavor],
        vocab_size=vocab_size,
        max_seq_len=cfg.training.seq_len,
    )
    if n_layers is not None:
        model_args = replace(model_args, n_layers=n_layers)
    with torch.device("meta"):
        model = Transformer.from_model_args(model_args)
    param_dtype = DTYPES[cfg.training.mixed_precision_param]
    use_autocast = not parallel_dims.dp_enabled and param_dtype != torch.float32  # as in train.py
    autocast = torch.autocast(device.type, param_dtype, enabled=use_autocast)
    if parallel_dims.pp_enabled:
        stage_io = None
        if fake_mode is not None:
            stage_io = pipeline_stage_io(
                model, world_mesh, parallel_dims, cfg, device, fake_mode, autocast, vocab_size
            )
        pp_schedule, model_parts, has_first_stage, has_last_stage = pipeline_llama(
            model, world_mesh, parallel_dims, cfg, device, loss_fn, stage_io
        )
    else:
        pp_schedule = None
        model_parts = [parallelize_llama(model, world_mesh, parallel_dims, cfg)]
    with fake_mode or contextlib.nullcontext():
        for part in model_parts:
            part.to_empty(device=device)  # the weights' values do not matter here
            part.train()
    optimizer = build_optimizer(model_parts, cfg.optimizer)
    params = [p for part in model_parts for p in part.parameters() if p.requires_grad]
    pp_mesh = world_mesh["pp"] if parallel_dims.pp_enabled else None
    train_context = loss_parallel if parallel_dims.loss_parallel_enabled else contextlib.nullcontext
    # Later micro-batches of an accumulation are alike: the first and the last stand for them all.
    microbatches = min(gradient_accumulation_steps(cfg.training, parallel_dims), 2)
    shape = (cfg.training.batch_size, cfg.training.seq_len)

    def forward_backward() -> None:
        optimizer.zero_grad()
        for microbatch in range(microbatches):
            inputs = torch.randint(0, vocab_size, shape, device=device)
            labels = torch.randint(0, vocab_size, shape, device=device)
            for part in model_parts:
                set_grad_all_reduce(part, microbatch == microbatches - 1)
            with train_context():
                if parallel_dims.pp_enabled:
                    targets = labels if has_last_stage else None
                    with autocast:
                        if has_first_stage:
                            pp_schedule.step(inputs, target=targets, losses=[], return_outputs=False)
                        else:
                            pp_schedule.step(target=targets, losses=[], return_outputs=False)
                else:
                    with autocast:
                        logits = model_parts[0](inputs)
                    loss = loss_fn(logits, labels)
                    del logits
                    loss.backward()
        clip_grad_norm_(params, cfg.training.max_norm, pp_mesh)

    return SimulatedStep(model_parts, optimizer, forward_backward, optimizer.step, pp_schedule)
