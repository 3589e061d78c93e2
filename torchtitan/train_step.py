"""The loss and the forward and backward of one training step, for the whole model or for this rank's
pipeline stages: what train.py, the memory estimator, the profiler and the benchmark share."""

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from torchtitan.chunked_loss import chunked_cross_entropy
from torchtitan.config.options import JobConfig, TrainingConfig
from torchtitan.config_rules import gradient_accumulation_steps
from torchtitan.datasets.layout import IGNORE_INDEX, Batch
from torchtitan.load_balance import LoadBalance
from torchtitan.models.documents import documents_from_positions, find_documents
from torchtitan.models.llama.model import upcast
from torchtitan.models.mtp import mtp_targets
from torchtitan.parallelisms.context_parallel import sequence_layouts, shard_sequence
from torchtitan.parallelisms.distributed import dist_sum
from torchtitan.parallelisms.float8 import convert_to_float8
from torchtitan.parallelisms.parallel_dims import ParallelDims
from torchtitan.parallelisms.parallelize import DTYPES, loss_skips_output, parallelize, set_grad_all_reduce
from torchtitan.parallelisms.pipeline import Pipeline, StageIO, build_pipeline


def loss_fn(
    pred: torch.Tensor, labels: torch.Tensor, denominator: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean cross entropy over the tokens of a batch (or of a pipeline micro-batch); with `denominator`
    (chat data), the sum over the tokens that have a target (label not IGNORE_INDEX) divided by it."""
    if denominator is None:
        return F.cross_entropy(upcast(pred.flatten(0, 1)), labels.flatten())
    return F.cross_entropy(upcast(pred.flatten(0, 1)), labels.flatten(), reduction="sum") / denominator


def stage_loss_fn(
    last_stage: nn.Module | None,
    output: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int = 0,
    denominator: torch.Tensor | None = None,
) -> torch.Tensor:
    """The loss of the last pipeline stage's output: its logits, or with `chunk_tokens` its final
    hidden states (the stages run with `skip_output`), projected by its output weight chunk by chunk;
    `denominator` as loss_fn's."""
    if chunk_tokens:
        return chunked_cross_entropy(output, last_stage.output.weight, labels, chunk_tokens, denominator)
    return loss_fn(output, labels, denominator)


class StageLoss:
    """stage_loss_fn for a pipeline's schedule, which calls it per micro-batch: chat data's
    `denominator` is the train step's, set before each schedule step (`Pipeline.stage_loss`)."""

    def __init__(self, chunk_tokens: int) -> None:
        self.chunk_tokens = chunk_tokens
        self.denominator: torch.Tensor | None = None

    def __call__(
        self, last_stage: nn.Module | None, output: torch.Tensor, labels: torch.Tensor
    ) -> torch.Tensor:
        return stage_loss_fn(last_stage, output, labels, self.chunk_tokens, self.denominator)


def autocast_context(
    training_config: TrainingConfig, device: torch.device
) -> contextlib.AbstractContextManager:
    """The matmuls in `mixed_precision_param`, everything else in fp32, on every layout: under FSDP/DDP
    the blocks' weights arrive in that dtype already (parallelize.mixed_precision_policies)."""
    param_dtype = DTYPES[training_config.mixed_precision_param]
    if param_dtype != torch.float32:
        return torch.autocast(device.type, dtype=param_dtype)
    return contextlib.nullcontext()


def parallelize_model(
    model: nn.Module,
    world_mesh: DeviceMesh | None,
    parallel_dims: ParallelDims,
    job_config: JobConfig,
    device: torch.device,
    stage_io: StageIO | None = None,
) -> tuple[list[nn.Module], Pipeline | None]:
    """The modules this rank runs (its pipeline stages, or the whole model), parallelized, and its
    pipeline (None without PP); still on the meta device. `stage_io`: see build_pipeline. With
    `float8.enable_float8_linear`, the whole model's linear layers are converted to float8 first."""
    convert_to_float8(model, job_config, parallel_dims)
    if parallel_dims.pp_enabled:
        stage_loss = StageLoss(job_config.training.loss_chunk_tokens)
        pipeline, model_parts = build_pipeline(
            model, world_mesh, parallel_dims, job_config, device, stage_loss, stage_io
        )
        pipeline.stage_loss = stage_loss
        return model_parts, pipeline
    return [parallelize(model, world_mesh, parallel_dims, job_config)], None


class TrainStep:
    """Forward and backward over the micro-batches of one optimizer step (gradient accumulation).

    The gradients of the micro-batches add up to the gradient of their mean loss; replicas (HSDP/DDP)
    all-reduce after the last one only. With pipeline parallelism, the schedule runs forward and
    backward over its own micro-batches of each batch.

    Chat batches (with positions) have tokens without a target, as many as each conversation's prompts:
    their loss is the mean over the trained tokens of the whole global batch, whatever the layout. A
    step takes all its micro-batches first to count them over the data-parallel ranks (`dp_mesh`), N
    (whole rows: the context-parallel ranks of a row count the same, tensor-parallel ones too); each
    micro-batch's loss is the sum over its tokens (a context-parallel rank's share) divided by
    N / (micro-batches x dp ranks x cp ranks), and a pipeline micro-batch's by that over the schedule's
    micro-batches, so that the mean over micro-batches and ranks, which the gradients' accumulation and
    averaging over dp x cp (and the schedule's scaling) take, is the sum over N."""

    def __init__(
        self,
        model_parts: list[nn.Module],
        pipeline: Pipeline | None,
        parallel_dims: ParallelDims,
        training_config: TrainingConfig,
        device: torch.device,
        load_balance: LoadBalance | None = None,
        cp_mesh: DeviceMesh | None = None,
        dp_mesh: DeviceMesh | None = None,
        mtp_loss_weight: float = 0.0,
    ) -> None:
        self.model_parts = model_parts
        self.dp_mesh = dp_mesh
        # Chat data: the last step's trained tokens over the global batch, and what a loss is divided by.
        self.trained_tokens: torch.Tensor | None = None
        self.loss_denominator: torch.Tensor | None = None
        self.evaluated_trained_tokens: torch.Tensor | None = None  # evaluate's, on this rank
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
        # A mixture-of-experts model's auxiliary losses join each micro-batch's training loss.
        self.aux_loss_weight = load_balance.aux_loss_weight if load_balance is not None else 0.0
        self.sequence_aux_loss_weight = (
            load_balance.sequence_aux_loss_weight if load_balance is not None else 0.0
        )
        self.load_balance = load_balance
        self.pipeline = pipeline
        if pipeline is not None and (self.aux_loss_weight or self.sequence_aux_loss_weight):
            pipeline.aux_loss = self._pipeline_aux_loss  # the last stage adds it to each micro-batch's loss
            if self.sequence_aux_loss_weight:  # each stage its own layers'
                pipeline.sequence_loss = load_balance.sequence_aux_loss
        self.device = device
        self.grad_accum_steps = gradient_accumulation_steps(training_config, parallel_dims)
        self.batch_rows = training_config.batch_size  # a pipeline schedule's batch (its stages' shapes)
        # Multi-token prediction (torchtitan/models/mtp.py): its depths' targets, counted over the step.
        self.mtp_depths = getattr(model_args, "mtp_layers", 0)
        self.mtp_loss_weight = mtp_loss_weight
        self.mtp_denominators: torch.Tensor | None = None
        self.mtp_sums = torch.zeros(self.mtp_depths, device=device)  # the step's loss per depth so far
        if pipeline is not None:
            pipeline.mtp_loss = self.mtp_loss
        self.autocast = autocast_context(training_config, device)
        # Loss parallel: the cross entropy (forward and backward) on vocabulary-sharded logits.
        self.loss_context = loss_parallel if parallel_dims.loss_parallel_enabled else contextlib.nullcontext
        # Compiled, the loss fuses the upcast, log-softmax and their backward over the (large) logits:
        # +3% tokens/s and -4 GiB on a 1B model (docs/performance.md).
        compile_loss = training_config.compile and not parallel_dims.loss_parallel_enabled
        backend = training_config.compile_backend
        self.loss_fn = torch.compile(loss_fn, backend=backend) if compile_loss else loss_fn
        # The output projection and the loss a chunk of tokens at a time: no whole logits (chunked_loss.py).
        # Under TP it scores vocabulary shards (DTensors, collectives): left uncompiled, as loss parallel is.
        self.loss_chunk_tokens = training_config.loss_chunk_tokens
        compile_chunked = training_config.compile and not parallel_dims.tp_enabled
        chunked = chunked_cross_entropy
        self.chunked_loss = torch.compile(chunked, backend=backend) if compile_chunked else chunked
        # Pipeline stages stop at the final norm for the chunked loss (stage_loss_fn projects).
        self.stage_kwargs = {"skip_output": True} if loss_skips_output(training_config) else {}

    def forward_backward(self, batches: Iterator[Batch], microbatches: int | None = None) -> torch.Tensor:
        """Run the step's micro-batches (`microbatches`, default the accumulation steps) from `batches`;
        their mean loss (the language-model loss, without an auxiliary loss), 0 on pipeline ranks without
        the last stage (sum it over the pipeline)."""
        microbatches = microbatches or self.grad_accum_steps
        taken = [next(batches)]
        # Chat data, multi-token prediction: the step's trained tokens (targets) are counted first.
        if len(taken[0]) > 2 or self.mtp_depths:
            taken += [next(batches) for _ in range(microbatches - 1)]
        if len(taken[0]) > 2:
            self._count_trained_tokens(taken)
        if self.mtp_depths:
            self._count_mtp_targets(taken)
        losses = []
        for microbatch in range(microbatches):
            batch = taken[microbatch] if microbatch < len(taken) else next(batches)
            inputs, labels, model_kwargs = self._on_device(batch)
            for part in self.model_parts:
                set_grad_all_reduce(part, microbatch == microbatches - 1)
            with self.loss_context():
                if self.pipeline is None:
                    loss = self._model_forward_backward(inputs, labels, model_kwargs, microbatches)
                else:
                    loss = self._pipeline_loss(self.pipeline.schedule.step, inputs, labels, model_kwargs)
            losses.append(loss.detach())
        return torch.stack(losses).mean()

    def _count_trained_tokens(self, step: list[Batch]) -> None:
        """The trained tokens of the global batch (`step`: this rank's micro-batches), and the
        denominator of each micro-batch's loss."""
        local = sum(int((labels != IGNORE_INDEX).sum()) for _, labels, *_ in step)
        count = torch.tensor(local, dtype=torch.float32, device=self.device)
        if self.dp_mesh is not None:
            count = dist_sum(count, self.dp_mesh)
        self.trained_tokens = count
        ranks = math.prod(mesh.size() for mesh in (self.dp_mesh, self.cp_mesh) if mesh is not None)
        self._set_loss_denominator(count.clamp(min=1) / (len(step) * ranks))

    def _set_loss_denominator(self, denominator: torch.Tensor | None) -> None:
        """What a (chat) batch's summed loss is divided by; a pipeline schedule's micro-batch's, by that
        over the schedule's micro-batches (their mean is the batch's loss)."""
        self.loss_denominator = denominator
        if self.pipeline is not None:
            micro = self.pipeline.schedule._n_microbatches
            self.pipeline.stage_loss.denominator = None if denominator is None else denominator / micro

    def _count_mtp_targets(self, step: list[Batch]) -> None:
        """The MTP targets of each depth in the global batch (`step`: this rank's micro-batches), N_k,
        and what each depth's summed loss is divided by: N_k over the micro-batches (and a pipeline's)
        and the ranks whose gradients are averaged (dp x cp), so that the averaged gradients are those
        of the mean over the global batch's targets, whatever the layout."""
        local = torch.zeros(self.mtp_depths)
        for batch in step:
            inputs, labels = batch[0], batch[1]
            _, targets = mtp_targets(inputs, labels, self._document_ids(batch), self.mtp_depths)
            local += (targets != IGNORE_INDEX).sum((0, 1))
        counts = local.to(self.device)
        if self.dp_mesh is not None:
            counts = dist_sum(counts, self.dp_mesh)
        ranks = math.prod(mesh.size() for mesh in (self.dp_mesh, self.cp_mesh) if mesh is not None)
        pipeline_microbatches = self.pipeline.schedule._n_microbatches if self.pipeline is not None else 1
        self.mtp_scale = len(step) * ranks * pipeline_microbatches
        self.mtp_denominators = counts.clamp(min=1) / self.mtp_scale

    def mtp_loss(
        self, model: nn.Module, outputs: tuple[torch.Tensor, ...], labels: torch.Tensor
    ) -> torch.Tensor:
        """The weighted MTP loss of a (pipeline) micro-batch, lambda / D x the sum over the depths of
        each one's summed cross entropy divided by its denominator (`_count_mtp_targets`): `outputs`,
        each depth's logits (or normed hidden states, for the chunked loss); `labels` (bs, seqlen, D).
        Adds the depths' losses to the step's metrics."""
        terms = []
        for depth, output in enumerate(outputs):
            target, denominator = labels[..., depth], self.mtp_denominators[depth]
            if self.loss_chunk_tokens:
                with self.autocast:
                    weight = model.output.weight
                    term = self.chunked_loss(output, weight, target, self.loss_chunk_tokens, denominator)
            else:
                term = self.loss_fn(output, target, denominator)
            terms.append(term.to_local() if isinstance(term, DTensor) else term)
        terms = torch.stack(terms)
        self.mtp_sums += terms.detach() / self.mtp_scale
        return self.mtp_loss_weight / self.mtp_depths * terms.sum()

    def mtp_metrics(self, meshes: Any) -> dict[str, torch.Tensor]:
        """The step's loss per MTP depth, the mean over the global batch's targets (`mtp_loss_k`; summed
        over the ranks whose tokens differ, and the pipeline, whose last stage holds it); restarts the
        count. Empty without MTP."""
        sums, self.mtp_sums = self.mtp_sums, torch.zeros_like(self.mtp_sums)
        if not self.mtp_depths:
            return {}
        for mesh in (meshes.dp_cp, meshes.pp):
            if mesh is not None:
                sums = dist_sum(sums, mesh)
        return {f"mtp_loss_{depth + 1}": value for depth, value in enumerate(sums)}

    def _document_ids(self, batch: Batch) -> torch.Tensor | None:
        """block_causal's documents of a host batch: from chat data's positions, else from the tokens."""
        inputs, _, *positions = batch
        if positions:
            return documents_from_positions(positions[0])
        return self.find_documents(inputs) if self.find_documents else None

    def _on_device(
        self, batch: Batch, mtp: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """The batch on the device and the model's keyword arguments for it (block_causal's documents,
        found on the host: from chat data's positions, else from the tokens); under context parallelism,
        this rank's tokens of it. With MTP (and `mtp`), the depths' input tokens (`mtp_tokens`, bs x
        seqlen x D) and the labels as (bs, seqlen, 1 + D): the next tokens', then each depth's targets,
        shifted here on whole sequences (a rank's last tokens need the next rank's first ones)."""
        inputs, labels = batch[0], batch[1]
        model_kwargs, ids, mtp_tokens = {}, self._document_ids(batch), None
        if ids is not None:
            model_kwargs["document_ids"] = self._copy_to_device(ids)
        if self.mtp_depths and mtp:
            mtp_tokens, mtp_labels = mtp_targets(inputs, labels, ids, self.mtp_depths)
            labels = torch.cat([labels.unsqueeze(-1), mtp_labels], dim=-1)
        if self.cp_mesh is not None:
            layouts = sequence_layouts(inputs.shape[1], self.cp_mesh.size(), ids)

            def shard(t: torch.Tensor) -> torch.Tensor:
                if t.ndim == 3:  # each depth's column as a sequence of its own
                    return torch.stack([shard(column) for column in t.unbind(-1)], dim=-1)
                return shard_sequence(t, self.cp_mesh, layouts)

            inputs, labels = shard(inputs), shard(labels)
            mtp_tokens = shard(mtp_tokens) if mtp_tokens is not None else None
        if mtp_tokens is not None:
            model_kwargs["mtp_tokens"] = self._copy_to_device(mtp_tokens)
        return self._copy_to_device(inputs), self._copy_to_device(labels), model_kwargs

    def _copy_to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host tensor on the device without waiting for it: from pinned memory (the loader's, or
        pinned here), as a copy from pageable memory would wait for the GPU's queue."""
        if self.device.type == "cuda" and tensor.device.type == "cpu" and not tensor.is_pinned():
            tensor = tensor.pin_memory()
        return tensor.to(self.device, non_blocking=True)

    def _model_forward_backward(
        self, inputs: torch.Tensor, labels: torch.Tensor, model_kwargs: dict, microbatches: int
    ) -> torch.Tensor:
        loss, mtp_loss = self._model_losses(inputs, labels, model_kwargs)
        objective = loss
        if self.aux_loss_weight or self.sequence_aux_loss_weight or mtp_loss is not None:
            # Under loss parallel the loss is a replicated DTensor; the auxiliary losses are this rank's.
            objective = loss.to_local() if isinstance(loss, DTensor) else loss
        if self.aux_loss_weight:
            objective = objective + self.aux_loss_weight * self.load_balance.aux_loss()
        if self.sequence_aux_loss_weight:
            objective = objective + self.sequence_aux_loss_weight * self.load_balance.sequence_aux_loss()
        if mtp_loss is not None:
            objective = objective + mtp_loss
        (objective / microbatches).backward()
        return loss

    def _pipeline_aux_loss(self, *router_stats: torch.Tensor) -> torch.Tensor:
        """A pipeline micro-batch's weighted auxiliary losses from what its stages passed on
        (parallelisms/pipeline.py's RouterStatsStage): the pooled loss's statistics, then the sum of the
        stages' sequence-wise losses."""
        losses = []
        if self.aux_loss_weight:
            counts, prob_sums, *router_stats = router_stats
            losses.append(self.aux_loss_weight * self.load_balance.pooled_aux_loss(counts, prob_sums))
        if self.sequence_aux_loss_weight:
            losses.append(self.sequence_aux_loss_weight * router_stats[0].sum())
        return sum(losses[1:], losses[0])

    def _model_losses(
        self, inputs: torch.Tensor, labels: torch.Tensor, model_kwargs: dict
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The language model's loss and, with `mtp_tokens` in `model_kwargs`, the weighted MTP loss. The
        chunked loss projects under autocast (chunked_loss.py); the logits' loss is taken outside it."""
        model = self.model_parts[0]
        with self.autocast:
            output = model(inputs, skip_output=bool(self.loss_chunk_tokens), **model_kwargs)
        mtp_loss = None
        if isinstance(output, tuple):  # multi-token prediction: the main output, then each depth's
            mtp_loss = self.mtp_loss(model, output[1:], labels[..., 1:])
            output, labels = output[0], labels[..., 0]
        if self.loss_chunk_tokens:
            with self.autocast:
                loss = self.chunked_loss(
                    output, model.output.weight, labels, self.loss_chunk_tokens, self.loss_denominator
                )
            return loss, mtp_loss
        return self.loss_fn(output, labels, self.loss_denominator), mtp_loss

    def _model_loss(self, inputs: torch.Tensor, labels: torch.Tensor, model_kwargs: dict) -> torch.Tensor:
        return self._model_losses(inputs, labels, model_kwargs)[0]

    def _pipeline_loss(
        self, run: Callable[..., Any], inputs: torch.Tensor, labels: torch.Tensor, model_kwargs: dict
    ) -> torch.Tensor:
        """The schedule's `run` (`step`, or `eval` for forward only) on one batch; its mean loss."""
        pipeline, losses = self.pipeline, []
        targets = labels if pipeline.has_last_stage else None
        first_stage_inputs = (inputs,) if pipeline.has_first_stage else ()
        # The logits are not returned: the last stage would keep every micro-batch's and concatenate.
        with self.autocast:
            run(
                *first_stage_inputs,
                target=targets,
                losses=losses,
                return_outputs=False,
                **self.stage_kwargs,
                **model_kwargs,
            )
        # No losses on ranks without the last stage, nor where the memory estimator cuts the schedule short.
        return torch.stack(losses).mean() if losses else torch.zeros((), device=self.device)

    @torch.no_grad()
    def evaluate(self, batches: Iterator[Batch]) -> tuple[torch.Tensor, int]:
        """Forward only (no activation recompute: nothing is kept for a backward), in eval mode, the
        training mode restored after: the sum of the batches' mean losses (0 on pipeline ranks without
        the last stage) and how many batches there were. Chat batches: the sum of their summed losses
        (a context-parallel rank's share), and `evaluated_trained_tokens` this rank's count of them."""
        modes = [part.training for part in self.model_parts]
        for part in self.model_parts:
            part.eval()
        losses, denominator = [], self.loss_denominator
        self.evaluated_trained_tokens = torch.zeros((), device=self.device)
        for batch in batches:
            if len(batch) > 2:  # chat data: summed, to be divided by the trained tokens of every rank
                self._set_loss_denominator(torch.ones((), device=self.device))
                self.evaluated_trained_tokens += int((batch[1] != IGNORE_INDEX).sum())
            with self.loss_context():
                if self.pipeline is not None and batch[0].shape[0] != self.batch_rows:
                    losses.append(self._pipeline_evaluate_rows(batch, chat=len(batch) > 2))
                    continue
                # A pipeline's stages pass the depths' embeddings on in every schedule, eval's too.
                losses.append(self._forward_loss(*self._on_device(batch, mtp=self.pipeline is not None)))
        self._set_loss_denominator(denominator)
        for part, mode in zip(self.model_parts, modes):
            part.train(mode)
        return torch.stack(losses).sum(), len(losses)

    def _pipeline_evaluate_rows(self, batch: Batch, chat: bool) -> torch.Tensor:
        """A validation batch of another size than training's through the pipeline, whose stages run
        the training batch's shape: as schedule evaluations of training.batch_size rows each, the last
        filled up with rows without targets. Chat data: the summed loss, as evaluate's; else the mean
        over the batch's tokens (a context-parallel rank's share), as a batch of the training shape's."""
        denominator, total = self.loss_denominator, torch.zeros((), device=self.device)
        self._set_loss_denominator(torch.ones((), device=self.device))  # each run's summed loss
        for start in range(0, batch[0].shape[0], self.batch_rows):
            part = [t[start : start + self.batch_rows] for t in batch]
            if missing := self.batch_rows - part[0].shape[0]:
                part = [torch.cat([t, t[:1].expand(missing, *t.shape[1:])]) for t in part]
                part[1][-missing:] = IGNORE_INDEX
            total += self._forward_loss(*self._on_device(tuple(part), mtp=True))
        self._set_loss_denominator(denominator)
        if chat:
            return total
        shares = self.cp_mesh.size() if self.cp_mesh is not None else 1
        return total * shares / int((batch[1] != IGNORE_INDEX).sum())

    def _forward_loss(self, inputs: torch.Tensor, labels: torch.Tensor, model_kwargs: dict) -> torch.Tensor:
        if self.pipeline is None:
            return self._model_loss(inputs, labels, model_kwargs)
        return self._pipeline_loss(self.pipeline.schedule.eval, inputs, labels, model_kwargs)
