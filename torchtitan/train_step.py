"""The forward and backward of one training step, for the whole model or for this rank's pipeline stages,
and forward-only evaluation: what train.py, the validator, the memory estimator, the profiler and the
benchmark share. What a step minimises and how it is normalised is the objective's
(torchtitan/objective/); this is the mechanics: micro-batches, their tokens on the device (a context-
parallel rank's share), gradient accumulation, loss parallel, autocast."""

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import loss_parallel

from torchtitan.config.options import JobConfig, TrainingConfig
from torchtitan.config_rules import gradient_accumulation_steps
from torchtitan.datasets.layout import IGNORE_INDEX, Batch
from torchtitan.models.documents import documents_from_positions, find_documents
from torchtitan.objective import Objective
from torchtitan.parallelisms.context_parallel import sequence_layouts, shard_sequence
from torchtitan.parallelisms.float8 import convert_to_float8
from torchtitan.parallelisms.parallel_dims import ParallelDims
from torchtitan.parallelisms.parallelize import autocast_context, parallelize, set_grad_all_reduce
from torchtitan.parallelisms.pipeline import Pipeline, StageIO, build_pipeline

# A micro-batch ready for the model: its input tokens, its targets (bs, seqlen, 1 + MTP depths: the
# objective's `targets`) and the model's keyword arguments (documents, the MTP depths' tokens).
Prepared = tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]


def parallelize_model(
    model: nn.Module,
    world_mesh: DeviceMesh | None,
    parallel_dims: ParallelDims,
    job_config: JobConfig,
    device: torch.device,
    objective: Objective,
    stage_io: StageIO | None = None,
) -> tuple[list[nn.Module], Pipeline | None]:
    """The modules this rank runs (its pipeline stages, scoring with `objective`, or the whole model),
    parallelized, and its pipeline (None without PP); still on the meta device. `stage_io`: see
    build_pipeline. With `float8.enable_float8_linear`, the whole model's linear layers are converted to
    float8 first."""
    convert_to_float8(model, job_config, parallel_dims)
    if parallel_dims.pp_enabled:
        pipeline, model_parts = build_pipeline(
            model, world_mesh, parallel_dims, job_config, device, objective, stage_io
        )
        return model_parts, pipeline
    return [parallelize(model, world_mesh, parallel_dims, job_config)], None


class TrainStep:
    """Forward and backward over the micro-batches of one optimizer step (gradient accumulation).

    The gradients of the micro-batches add up to the gradient of their mean loss; replicas (HSDP/DDP)
    all-reduce after the last one only. With pipeline parallelism, the schedule runs forward and
    backward over its own micro-batches of each batch. A step takes all its micro-batches first, for the
    objective to count their targets."""

    def __init__(
        self,
        model_parts: list[nn.Module],
        pipeline: Pipeline | None,
        objective: Objective,
        parallel_dims: ParallelDims,
        training_config: TrainingConfig,
        device: torch.device,
        cp_mesh: DeviceMesh | None = None,
    ) -> None:
        self.model_parts = model_parts
        self.pipeline = pipeline
        self.objective = objective
        objective.track(model_parts)
        # block_causal: the documents of the whole sequences, found before context parallelism shares
        # their tokens out, and given to every pipeline stage (a later one is given hidden states).
        model_args = model_parts[0].model_args
        self.find_documents = None
        if model_args.attn_mask_type == "block_causal":
            self.find_documents = functools.partial(
                find_documents, eos_id=model_args.eos_id, bos_id=model_args.bos_id
            )
        # Context parallelism: each rank runs its share of every sequence's tokens (context_parallel.py).
        self.cp_mesh = cp_mesh
        self.device = device
        self.grad_accum_steps = gradient_accumulation_steps(training_config, parallel_dims)
        self.batch_rows = training_config.batch_size  # a pipeline schedule's batch (its stages' shapes)
        self.autocast = autocast_context(training_config, device)
        # Loss parallel: the cross entropy (forward and backward) on vocabulary-sharded logits.
        self.loss_context = loss_parallel if parallel_dims.loss_parallel_enabled else contextlib.nullcontext
        # With the chunked loss the model stops at its final norm; the objective projects.
        self.skip_output = bool(objective.chunk_tokens)

    def forward_backward(self, batches: Iterator[Batch], microbatches: int | None = None) -> torch.Tensor:
        """Run the step's micro-batches (`microbatches`, default the accumulation steps) from `batches`;
        their mean loss (the language model's, without the terms added to it), 0 on pipeline ranks
        without the last stage (sum it over the pipeline)."""
        microbatches = microbatches or self.grad_accum_steps
        step = [self._prepare(next(batches)) for _ in range(microbatches)]
        self.objective.begin_step([labels for _, labels, _ in step])
        losses = []
        for microbatch, prepared in enumerate(step):
            inputs, labels, model_kwargs = self._on_device(*prepared)
            for part in self.model_parts:
                set_grad_all_reduce(part, microbatch == microbatches - 1)
            with self.loss_context():
                if self.pipeline is None:
                    loss = self._model_loss(inputs, labels, model_kwargs, training=True)
                    (loss / microbatches).backward()
                else:
                    loss = self._pipeline_loss(self.pipeline.schedule.step, inputs, labels, model_kwargs)
            losses.append(loss.detach())
        return torch.stack(losses).mean()

    def _prepare(self, batch: Batch, mtp: bool = True) -> Prepared:
        """A host batch with its targets (with `mtp`, the MTP depths' too) and the model's keyword
        arguments: block_causal's documents, found on the host (from chat data's positions, else from
        the tokens)."""
        if batch.positions is not None:
            document_ids = documents_from_positions(batch.positions)
        else:
            document_ids = self.find_documents(batch.inputs) if self.find_documents else None
        labels, model_kwargs = self.objective.targets(batch.inputs, batch.labels, document_ids, mtp)
        if document_ids is not None:
            model_kwargs["document_ids"] = document_ids
        return batch.inputs, labels, model_kwargs

    def _on_device(
        self, inputs: torch.Tensor, labels: torch.Tensor, model_kwargs: dict[str, torch.Tensor]
    ) -> Prepared:
        """A prepared batch on the device; under context parallelism, this rank's tokens of it (each
        target column, and each MTP depth's tokens, as a sequence of its own; the documents whole)."""
        model_kwargs = dict(model_kwargs)
        if self.cp_mesh is not None:
            layouts = sequence_layouts(inputs.shape[1], self.cp_mesh.size(), model_kwargs.get("document_ids"))

            def shard(t: torch.Tensor) -> torch.Tensor:
                return shard_sequence(t, self.cp_mesh, layouts)

            def shard_columns(t: torch.Tensor) -> torch.Tensor:
                return torch.stack([shard(column) for column in t.unbind(-1)], dim=-1)

            inputs, labels = shard(inputs), shard_columns(labels)
            if "mtp_tokens" in model_kwargs:
                model_kwargs["mtp_tokens"] = shard_columns(model_kwargs["mtp_tokens"])
        model_kwargs = {name: self._copy_to_device(t) for name, t in model_kwargs.items()}
        return self._copy_to_device(inputs), self._copy_to_device(labels), model_kwargs

    def _copy_to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host tensor on the device without waiting for it: from pinned memory (the loader's, or
        pinned here), as a copy from pageable memory would wait for the GPU's queue."""
        if self.device.type == "cuda" and tensor.device.type == "cpu" and not tensor.is_pinned():
            tensor = tensor.pin_memory()
        return tensor.to(self.device, non_blocking=True)

    def _model_loss(
        self, inputs: torch.Tensor, labels: torch.Tensor, model_kwargs: dict, training: bool
    ) -> torch.Tensor:
        """The whole model's loss of a micro-batch (the objective's). The model runs under autocast; the
        logits' loss is taken outside it (the chunked loss projects under it: the objective's)."""
        model = self.model_parts[0]
        with self.autocast:
            output = model(inputs, skip_output=self.skip_output, **model_kwargs)
        return self.objective.loss(model, output, labels, training=training)

    def _pipeline_loss(
        self, run: Callable[..., Any], inputs: torch.Tensor, labels: torch.Tensor, model_kwargs: dict
    ) -> torch.Tensor:
        """The schedule's `run` (`step`, or `eval` for forward only) on one batch; its mean loss."""
        pipeline, losses = self.pipeline, []
        targets = labels if pipeline.has_last_stage else None
        first_stage_inputs = (inputs,) if pipeline.has_first_stage else ()
        stage_kwargs = {"skip_output": True} if self.skip_output else {}
        # The logits are not returned: the last stage would keep every micro-batch's and concatenate.
        with self.autocast:
            run(
                *first_stage_inputs,
                target=targets,
                losses=losses,
                return_outputs=False,
                **stage_kwargs,
                **model_kwargs,
            )
        # No losses on ranks without the last stage, nor where the memory estimator cuts the schedule short.
        return torch.stack(losses).mean() if losses else torch.zeros((), device=self.device)

    def _forward_loss(self, inputs: torch.Tensor, labels: torch.Tensor, model_kwargs: dict) -> torch.Tensor:
        if self.pipeline is None:
            return self._model_loss(inputs, labels, model_kwargs, training=False)
        return self._pipeline_loss(self.pipeline.schedule.eval, inputs, labels, model_kwargs)

    @torch.no_grad()
    def evaluate(self, batches: Iterator[Batch]) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Forward only (no activation recompute: nothing is kept for a backward), in eval mode, the
        training mode restored after: the loss summed over the batches' targets (a context-parallel
        rank's share; 0 on pipeline ranks without the last stage), the count of those targets (whole
        rows) and how many batches there were (the objective's `mean_over_ranks` makes the mean)."""
        modes = [part.training for part in self.model_parts]
        for part in self.model_parts:
            part.eval()
        sums, targets = [], torch.zeros((), dtype=torch.long)
        with self.objective.summing():
            for batch in batches:
                # A pipeline's stages pass the MTP depths' embeddings on in every schedule, eval's too.
                inputs, labels, model_kwargs = self._prepare(batch, mtp=self.pipeline is not None)
                targets += self.objective.count(labels)[0]
                with self.loss_context():
                    if self.pipeline is not None and inputs.shape[0] != self.batch_rows:
                        sums.append(self._pipeline_evaluate_rows(inputs, labels, model_kwargs))
                    else:
                        sums.append(self._forward_loss(*self._on_device(inputs, labels, model_kwargs)))
        for part, mode in zip(self.model_parts, modes):
            part.train(mode)
        return torch.stack(sums).sum(), targets.to(self.device), len(sums)

    def _pipeline_evaluate_rows(
        self, inputs: torch.Tensor, labels: torch.Tensor, model_kwargs: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """A validation batch of another size than training's through the pipeline, whose stages run
        the training batch's shape: as schedule evaluations of training.batch_size rows each, the last
        filled up with rows without targets; their summed loss."""
        total = torch.zeros((), device=self.device)
        for start in range(0, inputs.shape[0], self.batch_rows):
            rows = slice(start, start + self.batch_rows)
            part = [inputs[rows], labels[rows], {name: t[rows] for name, t in model_kwargs.items()}]
            if missing := self.batch_rows - part[0].shape[0]:

                def pad(t: torch.Tensor, missing: int = missing) -> torch.Tensor:
                    return torch.cat([t, t[:1].expand(missing, *t.shape[1:])])

                part = [pad(part[0]), pad(part[1]), {name: pad(t) for name, t in part[2].items()}]
                part[1][-missing:] = IGNORE_INDEX
            total += self._forward_loss(*self._on_device(*part))
        return total
