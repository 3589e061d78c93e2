"""Pipeline parallelism: split a meta-device Llama into stages and drive them with a schedule.

A stage is a deep copy of the whole model with the layers it does not own deleted (and the
embeddings, final norm and output set to None where another stage owns them), so parameters keep
the FQNs of the whole model: the seeded init gives every stage the weights of a 1-process run and
checkpoints do not depend on the pipeline layout.
"""

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import _PipelineSchedule, get_schedule_class

from torchtitan.config_manager import ConfigError, JobConfig
from torchtitan.parallelisms.parallel_dims import ParallelDims
from torchtitan.parallelisms.parallelize_llama import parallelize_llama
from torchtitan.parallelisms.pipeline_layout import (
    SINGLE_STAGE_SCHEDULES,
    num_microbatches,
    stage_ids,
    stage_layers,
)

# A stage id's example micro-batch input and output (for stages that cannot learn the shapes by messages).
StageIO = Callable[[int], tuple[torch.Tensor, torch.Tensor]]
# The loss of the last stage's micro-batch output against its labels, given the last stage's model
# (None on ranks without it, where it is never called): the chunked loss projects with its weight.
StageLoss = Callable[[nn.Module | None, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Pipeline:
    """This rank's part of a pipeline: the schedule that runs its stages, and whether it holds the
    model's ends (the first stage takes the tokens; only the last stage computes the loss)."""

    schedule: _PipelineSchedule
    has_first_stage: bool
    has_last_stage: bool


def split_model(model: nn.Module, layers: range, is_first: bool, is_last: bool) -> nn.Module:
    """A copy of the (meta) model keeping only `layers`, plus the ends it owns."""
    stage = copy.deepcopy(model)
    for layer_id in list(stage.layers):
        if int(layer_id) not in layers:
            del stage.layers[layer_id]
    if not is_first:
        stage.tok_embeddings = None
    if not is_last:
        stage.norm = None
        stage.output = None
    return stage


class _Stage(PipelineStage):
    """torch's PipelineStage whose first-step shape inference, a real forward (and backward) on the
    first micro-batch or on uninitialised tensors, leaves the model's buffers as they were: a
    mixture-of-experts layer counts the tokens its experts take in one (torchtitan/models/moe.py)."""

    def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        saved = [(buffer, buffer._version, buffer.clone()) for buffer in self.submod.buffers()]
        try:
            return super()._forward_metadata_inference(*args, **kwargs)
        finally:
            with torch.no_grad():  # only those it wrote to: autograd saved the others (RoPE's) as they are
                for buffer, version, value in saved:
                    if buffer._version != version:
                        buffer.copy_(value)


def pipeline_llama(
    model: nn.Module,
    world_mesh: DeviceMesh,
    parallel_dims: ParallelDims,
    job_config: JobConfig,
    device: torch.device,
    loss_fn: StageLoss,
    stage_io: StageIO | None = None,
) -> tuple[Pipeline, list[nn.Module]]:
    """This rank's pipeline and its stage models, each parallelized by `parallelize_llama`.

    `loss_fn` must average over its micro-batch: the schedule divides the summed gradients by the
    number of micro-batches, which then equal those of the whole batch's mean loss. Stages learn
    each other's activation shapes from the first step's messages, unless `stage_io` gives a stage
    id's example micro-batch input and output (the memory estimator's fake process group carries
    no messages)."""
    pp_mesh = world_mesh["pp"]
    schedule_name = job_config.parallelism.pipeline_parallel_schedule
    layers = stage_layers(job_config, len(model.layers))
    n_microbatches = num_microbatches(job_config, len(layers))
    ids = stage_ids(pp_mesh.get_local_rank(), pp_mesh.size(), len(layers) // pp_mesh.size(), schedule_name)

    stages, model_parts = [], []
    for stage_id in ids:
        is_first, is_last = stage_id == 0, stage_id == len(layers) - 1
        part = split_model(model, layers[stage_id], is_first, is_last)
        part = parallelize_llama(part, world_mesh, parallel_dims, job_config)
        inputs, outputs = stage_io(stage_id) if stage_io else (None, None)
        stages.append(_Stage(part, stage_id, len(layers), device, inputs, outputs, group=pp_mesh.get_group()))
        model_parts.append(part)

    last_stage = model_parts[ids.index(len(layers) - 1)] if len(layers) - 1 in ids else None
    schedule_cls = get_schedule_class(schedule_name)
    try:
        schedule = schedule_cls(
            stages[0] if schedule_name in SINGLE_STAGE_SCHEDULES else stages,
            n_microbatches=n_microbatches,
            loss_fn=functools.partial(loss_fn, last_stage),
        )
    except ValueError as e:
        raise ConfigError(
            f"parallelism.pipeline_parallel_schedule: {schedule_name} cannot run {n_microbatches} "
            f"micro-batches on {len(layers)} stages ({' '.join(str(e).split())}); "
            "change parallelism.pipeline_parallel_microbatches"
        ) from None
    return Pipeline(schedule, 0 in ids, len(layers) - 1 in ids), model_parts
