"""The job's model parts, optimizer and one training step, built with the trainer's own code, on
fake tensors for the estimate or on real ones for --measure."""

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch

from torchtitan.config.options import ConfigError, JobConfig
from torchtitan.config.paths import resolve_path
from torchtitan.datasets.layout import Batch
from torchtitan.datasets.tokenizer import build_tokenizer
from torchtitan.errors import bad_input
from torchtitan.memory_estimation.torch_internals import FakeTensorMode
from torchtitan.models import build_model_args, model_spec
from torchtitan.models import vocab_size as padded_vocab_size
from torchtitan.objective import Objective
from torchtitan.optimizers import build_optimizer
from torchtitan.parallelisms.distributed import clip_grad_norm_
from torchtitan.parallelisms.parallel_dims import Meshes, ParallelDims
from torchtitan.parallelisms.parallelize import autocast_context, loss_skips_output, parallelize
from torchtitan.parallelisms.pipeline import StageIO, split_model
from torchtitan.parallelisms.pipeline_layout import num_microbatches, stage_layers
from torchtitan.train_step import TrainStep, parallelize_model


def vocab_size_of(cfg: JobConfig) -> int:
    """The embedding rows train.py would use (torchtitan.models.vocab_size: model.vocab_size, the Hugging
    Face folder's or the tokenizer's).
    The tokenizer (a file, or a Hugging Face tokenizer folder) may be missing here when model.vocab_size
    is set."""
    path = resolve_path(cfg.model.tokenizer_path)
    if not os.path.exists(path):
        if cfg.model.vocab_size > 0:
            return cfg.model.vocab_size
        raise ConfigError(
            f"model.tokenizer_path: no file {path}; give the vocabulary size instead, e.g. "
            "--model.vocab_size 128256 for Llama 3's tokenizer"
        )
    with bad_input("model.tokenizer_path"):  # e.g. not a tokenizer file
        return padded_vocab_size(cfg, build_tokenizer(path).n_words)


def pipeline_stage_io(
    model: torch.nn.Module,
    world_mesh,
    parallel_dims: ParallelDims,
    cfg: JobConfig,
    device: torch.device,
    fake_mode: FakeTensorMode,
    autocast: contextlib.AbstractContextManager,
    vocab_size: int,
) -> StageIO:
    """A stage id's example micro-batch input and output, for stages on a fake process group (which
    cannot carry the shapes between them). They come from a probe: the model's two ends alone
    (embeddings, final norm, output), parallelized like a stage, run on one fake micro-batch.
    Blocks keep the shape and dtype of the residual stream, so the embeddings' output is what every
    stage boundary carries; the last stage outputs the logits, or the final norm's output for the
    chunked loss (training.loss_chunk_tokens)."""
    layers = stage_layers(cfg, len(model.layers))
    # Under context parallelism the stages carry the rank's share of each sequence.
    tokens_per_rank = cfg.training.seq_len // parallel_dims.cp
    microbatch = (cfg.training.batch_size // num_microbatches(cfg, len(layers)), tokens_per_rank)
    probe = parallelize(split_model(model, range(0), True, True), world_mesh, parallel_dims, cfg)
    boundary = []
    probe.tok_embeddings.register_forward_hook(lambda module, args, output: boundary.append(output))
    with fake_mode:
        probe.to_empty(device=device)
        tokens = torch.randint(0, vocab_size, microbatch, device=device)
        with autocast:
            output = probe(tokens, skip_output=loss_skips_output(cfg.training))
    # Stage outputs and hidden inputs take gradients (those the stages send back).
    hidden, output = boundary[0].detach().requires_grad_(), output.detach().requires_grad_()
    carried, last = hidden, output
    if depths := cfg.model.mtp_layers:  # the shifted tokens' embeddings travel on; each depth its output
        with fake_mode:
            embeddings = hidden.detach().unsqueeze(2).expand(-1, -1, depths, -1).clone().requires_grad_()
            carried = (hidden, embeddings)
            last = (output, *(output.detach().clone().requires_grad_() for _ in range(depths)))
    return lambda stage_id: (
        tokens if stage_id == 0 else carried,
        last if stage_id == len(layers) - 1 else carried,
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
    """The rank's model parts and optimizer, built as train.py builds them, and its step (the
    trainer's own TrainStep). With `fake_mode` the parameters are fake tensors (run the step under
    it too); `n_layers` overrides the flavour's depth."""
    # Fake tensors hold no token ids, so no documents: block_causal is estimated as causal (the same
    # activations but one copy of each layer's attention output, docs/attention.md).
    causal = replace(cfg, model=replace(cfg.model, attn_mask_type="causal"))
    model_args = build_model_args(causal, vocab_size)
    if n_layers is not None:
        model_args = replace(model_args, n_layers=n_layers)
    with torch.device("meta"):
        model = model_spec(cfg.model).build(model_args)
    stage_io = None
    if parallel_dims.pp_enabled and fake_mode is not None:
        autocast = autocast_context(cfg.training, device)
        stage_io = pipeline_stage_io(
            model, world_mesh, parallel_dims, cfg, device, fake_mode, autocast, vocab_size
        )
    # The trainer's objective; its count of the step's targets runs on the fake process group.
    meshes = parallel_dims.meshes_of(world_mesh) if world_mesh is not None else Meshes(None, None, None)
    objective = Objective(cfg, model_args, parallel_dims, meshes, device)
    model_parts, pipeline = parallelize_model(
        model, world_mesh, parallel_dims, cfg, device, objective, stage_io
    )
    moe = model_spec(cfg.model).moe
    with fake_mode or contextlib.nullcontext():
        for part in model_parts:
            part.to_empty(device=device)  # the weights' values do not matter here
            if moe and fake_mode is None:  # but a real run's routing does: a trained model's first
                part.init_weights(seed=cfg.training.seed)
            part.train()
    optimizer = build_optimizer(model_parts, cfg.optimizer)
    params = [p for part in model_parts for p in part.parameters() if p.requires_grad]
    # A mixture of experts' auxiliary loss holds its router statistics' graph until backward. The bias
    # update after the optimizer step (the objective's step_done) takes a few bytes per expert: left out.
    # Under context parallelism the step takes each rank's tokens of the whole (batch, seq_len) batch.
    train_step = TrainStep(model_parts, pipeline, objective, parallel_dims, cfg.training, device, meshes.cp)
    # Later micro-batches of an accumulation are alike: the first and the last stand for them all.
    microbatches = min(train_step.grad_accum_steps, 2)
    shape = (cfg.training.batch_size, cfg.training.seq_len)

    def random_batches() -> Iterator[Batch]:
        while True:
            yield Batch(
                torch.randint(0, vocab_size, shape, device=device),
                torch.randint(0, vocab_size, shape, device=device),
            )

    def forward_backward() -> None:
        optimizer.zero_grad()
        train_step.forward_backward(random_batches(), microbatches)
        clip_grad_norm_(params, cfg.training.max_norm, meshes.pp)

    schedule = pipeline.schedule if pipeline is not None else None
    return SimulatedStep(model_parts, optimizer, forward_backward, optimizer.step, schedule)
