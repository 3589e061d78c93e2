"""Pipeline parallelism: split a meta-device model (any family) into stages and drive them with a
schedule.

A stage is a deep copy of the whole model with the layers it does not own deleted (and the
embeddings, final norm and output set to None where another stage owns them), so parameters keep
the FQNs of the whole model: the seeded init gives every stage the weights of a 1-process run and
checkpoints do not depend on the pipeline layout.
"""

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import _PipelineSchedule, get_schedule_class

from torchtitan.config.options import ConfigError, JobConfig
from torchtitan.models.moe import MoE
from torchtitan.parallelisms.parallel_dims import ParallelDims
from torchtitan.parallelisms.parallelize import fsdp_mesh, parallelize
from torchtitan.parallelisms.pipeline_layout import (
    SINGLE_STAGE_SCHEDULES,
    num_microbatches,
    stage_ids,
    stage_layers,
)

# A stage id -> its example micro-batch input and output, for stages that cannot learn the shapes by
# messages: a tensor, or a tuple of them (multi-token prediction's stages pass the shifted tokens'
# embeddings on beside the hidden states, its last stage outputs each depth's logits beside the model's).
StageIO = Callable[[int], tuple[Any, Any]]


class StageObjective(Protocol):
    """What the stages need of the training objective (torchtitan/objective/objective.py)."""

    def loss(
        self, part: nn.Module, output: Any, labels: torch.Tensor, router_stats: tuple, training: bool
    ) -> torch.Tensor:
        """The last stage's micro-batch loss (the objective's `loss`)."""

    def router_stats_travel(self) -> tuple[bool, bool]:
        """Whether the pooled balance loss's statistics, and the sequence-wise losses, travel."""

    def sequence_loss(self, layers: list[MoE]) -> torch.Tensor:
        """A stage's layers' sequence-wise balance loss of the training forward just run."""


@dataclass
class Pipeline:
    """This rank's part of a pipeline: the schedule that runs its stages, and whether it holds the
    model's ends (the first stage takes the tokens; only the last stage computes the loss)."""

    schedule: _PipelineSchedule
    has_first_stage: bool
    has_last_stage: bool


def split_model(model: nn.Module, layers: range, is_first: bool, is_last: bool) -> nn.Module:
    """A copy of the (meta) model keeping only `layers`, plus the ends it owns (the model says which:
    `drop_outside`)."""
    stage = copy.deepcopy(model)
    stage.drop_outside(layers, is_first, is_last)
    return stage


class _Stage(PipelineStage):
    """torch's PipelineStage whose first-step shape inference, a real forward (and backward) on the
    first micro-batch or on uninitialised tensors, leaves the model's buffers as they were: a
    mixture-of-experts layer counts the tokens its experts take in one (torchtitan/models/moe.py).
    `inferring` tells the loss that it runs for the inference, not for a step, as the stage model's
    own `inferring` tells a RouterStatsStage."""

    inferring = False

    def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        saved = [(buffer, buffer._version, buffer.clone()) for buffer in self.submod.buffers()]
        stats_stage = isinstance(self.submod, RouterStatsStage)
        if stats_stage:
            self.submod.inferring = True
        try:
            return super()._forward_metadata_inference(*args, **kwargs)
        finally:
            if stats_stage:
                self.submod.inferring = False
            with torch.no_grad():  # only those it wrote to: autograd saved the others (RoPE's) as they are
                for buffer, version, value in saved:
                    if buffer._version != version:
                        buffer.copy_(value)

    def _backward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        self.inferring = True
        try:
            return super()._backward_metadata_inference(*args, **kwargs)
        finally:
            self.inferring = False


class RouterStatsStage(nn.Module):
    """A stage's model that passes its micro-batch's router statistics on to the next stage: the
    auxiliary loss pools every sparse layer's (torchtitan/objective/load_balance.py), which the stages hold
    apart. Beside the activations travel (`pooled`) the (token, choice) counts per expert (integers: no
    gradient) and the sums of router probabilities per expert (float32, with their gradient: the last
    stage's auxiliary loss sends each stage's router its share back through the pipeline), and
    (`sequence`) the sequence-wise balance loss of the stages so far, a sum over their layers (float32,
    shape (1,), with its gradient), to which each stage adds its own layers'."""

    def __init__(
        self, part: nn.Module, num_experts: int, objective: StageObjective, pooled: bool, sequence: bool
    ) -> None:
        super().__init__()
        self.part = part
        self.objective = objective
        self.num_experts = num_experts
        self.pooled, self.sequence = pooled, sequence
        self.n_stats = 2 * pooled + sequence  # what travels after the activations
        self.moe_layers = [m for m in part.modules() if isinstance(m, MoE)]
        self.inferring = False  # the first step's shape inference (_Stage): no loss to count

    def forward(self, *args: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, ...]:
        # The first stage takes the tokens; the others the previous stage's activations (the hidden
        # states, and multi-token prediction's embeddings), then the statistics. The first stage starts
        # from leaves that need a gradient, as the stage's outputs must.
        n = self.n_stats
        activations, router_stats = (args[:-n], list(args[-n:])) if len(args) > n else (args, [])
        device, grad = activations[0].device, torch.is_grad_enabled()
        stats = []
        out = self.part(*activations, **kwargs)
        if self.pooled:
            if router_stats:
                counts, prob_sums, *router_stats = router_stats
                prob_sums = prob_sums.clone()
            else:
                counts = torch.zeros(self.num_experts, dtype=torch.int64, device=device)
                prob_sums = torch.zeros(self.num_experts, device=device, requires_grad=grad)
            for layer in self.moe_layers:
                if layer.router_stats is not None:  # training forwards only
                    layer_counts, layer_prob_sums = layer.router_stats
                    layer.router_stats = None
                    counts = counts + layer_counts.long()
                    prob_sums = prob_sums + layer_prob_sums
            stats += [counts, prob_sums]
        if self.sequence:
            loss = (
                router_stats[0].clone() if router_stats else torch.zeros(1, device=device, requires_grad=grad)
            )
            if self.inferring or not grad:
                for layer in self.moe_layers:
                    layer.sequence_stats = None
            else:
                loss = loss + self.objective.sequence_loss(self.moe_layers)
            stats.append(loss)
        return (*(out if isinstance(out, tuple) else (out,)), *stats)


def _tensors(example: Any) -> tuple[torch.Tensor, ...]:
    """A stage's example input or output as a tuple of tensors."""
    return example if isinstance(example, tuple) else (example,)


def build_pipeline(
    model: nn.Module,
    world_mesh: DeviceMesh,
    parallel_dims: ParallelDims,
    job_config: JobConfig,
    device: torch.device,
    objective: StageObjective,
    stage_io: StageIO | None = None,
) -> tuple[Pipeline, list[nn.Module]]:
    """This rank's pipeline and its stage models, each parallelized by `parallelize`; the last stage
    scores its micro-batches with `objective` (the schedule divides the summed gradients by the number
    of micro-batches, which the objective's normalisation counts: objective.py). Stages learn
    each other's activation shapes from the first step's messages, unless `stage_io` gives a stage
    id's example micro-batch input and output (the memory estimator's fake process group carries
    no messages)."""
    pp_mesh = world_mesh["pp"]
    schedule_name = job_config.parallelism.pipeline_parallel_schedule
    layers = stage_layers(job_config, len(model.layers))
    n_microbatches = num_microbatches(job_config, len(layers))
    ids = stage_ids(pp_mesh.get_local_rank(), pp_mesh.size(), len(layers) // pp_mesh.size(), schedule_name)

    # A mixture of experts' auxiliary loss pools the router statistics of every stage's layers; its
    # sequence-wise balance loss sums the stages' own.
    pooled, sequence = objective.router_stats_travel()
    carry_router_stats = pooled or sequence
    stages, model_parts = [], []
    for stage_id in ids:
        is_first, is_last = stage_id == 0, stage_id == len(layers) - 1
        part = parallelize(
            split_model(model, layers[stage_id], is_first, is_last), world_mesh, parallel_dims, job_config
        )
        module = part
        inputs, outputs = stage_io(stage_id) if stage_io else (None, None)
        if carry_router_stats:
            module = RouterStatsStage(part, model.model_args.num_experts, objective, pooled, sequence)
            if isinstance(part, FSDPModule):
                # Pipelining drives FSDP through the stage's module (gradient sync, the last reduce):
                # the wrapper becomes the root unit, with no parameters and casting no inputs (the
                # statistics stay in float32).
                fully_shard(
                    module,
                    mesh=fsdp_mesh(world_mesh, parallel_dims),
                    mp_policy=MixedPrecisionPolicy(cast_forward_inputs=False),
                )
            if stage_io:
                num_experts = model.model_args.num_experts
                # The float statistics carry gradients back, as the activations do.
                like = _tensors(outputs)[0]
                counts = like.new_zeros(num_experts, dtype=torch.int64)
                prob_sums = like.new_zeros(num_experts).requires_grad_()
                loss = like.new_zeros(1).requires_grad_()
                stats = ((counts, prob_sums) if pooled else ()) + ((loss,) if sequence else ())
                inputs = inputs if is_first else (*_tensors(inputs), *stats)
                outputs = (*_tensors(outputs), *stats)
        stages.append(
            _Stage(module, stage_id, len(layers), device, inputs, outputs, group=pp_mesh.get_group())
        )
        model_parts.append(part)

    last_stage_id = len(layers) - 1
    last_part = model_parts[ids.index(last_stage_id)] if last_stage_id in ids else None
    last_stage = stages[ids.index(last_stage_id)] if last_stage_id in ids else None

    def last_stage_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
        stats = ()
        if carry_router_stats:
            n_stats = 2 * pooled + sequence
            output, stats = output[:-n_stats], tuple(output[-n_stats:])
            output = output[0] if len(output) == 1 else tuple(output)
        training = torch.is_grad_enabled() and not last_stage.inferring
        return objective.loss(last_part, output, labels, stats, training)

    schedule_cls = get_schedule_class(schedule_name)
    try:
        schedule = schedule_cls(
            stages[0] if schedule_name in SINGLE_STAGE_SCHEDULES else stages,
            n_microbatches=n_microbatches,
            loss_fn=last_stage_loss,
        )
    except ValueError as e:
        raise ConfigError(
            f"parallelism.pipeline_parallel_schedule: {schedule_name} cannot run {n_microbatches} "
            f"micro-batches on {len(layers)} stages ({' '.join(str(e).split())}); "
            "change parallelism.pipeline_parallel_microbatches"
        ) from None
    return Pipeline(schedule, 0 in ids, last_stage_id in ids), model_parts
