"""Pipeline parallelism: split a meta-device Llama into stages and drive them with a schedule.

A stage is a deep copy of the whole model with the layers it does not own deleted (and the
embeddings, final norm and output set to None where another stage owns them), so parameters keep
the FQNs of the whole model: the seeded init gives every stage the weights of a 1-process run and
checkpoints do not depend on the pipeline layout.
"""

import copy
import re
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleSingle,
    _PipelineSchedule,
    get_schedule_class,
)

from torchtitan.config_manager import ConfigError, JobConfig
from torchtitan.parallelisms.parallel_dims import ParallelDims
from torchtitan.parallelisms.parallelize_llama import parallelize_llama

# Schedules whose two stages per rank form a V: rank r holds stages r and 2 * pp - 1 - r, so the
# last stage sits next to the first and the loss gradient turns around without a hop.
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
# Schedules that split backward into input and weight passes, which torch.compile'd blocks cannot do.
SPLIT_BACKWARD_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def _is_single(schedule: str) -> bool:
    return issubclass(get_schedule_class(schedule), PipelineScheduleSingle)


def stages_per_rank(job_config: JobConfig) -> int:
    """Stages each pipeline rank holds: 1 for single-stage schedules (GPipe, 1F1B), 2 for V
    schedules; for the looped multi-stage ones, as many as the split points make, else 2."""
    pp = job_config.parallelism
    if _is_single(pp.pipeline_parallel_schedule):
        return 1
    if pp.pipeline_parallel_schedule in V_SCHEDULES or not pp.pipeline_parallel_split_points:
        return 2
    return max(1, (len(pp.pipeline_parallel_split_points) + 1) // pp.pipeline_parallel_degree)


def stage_layers(job_config: JobConfig, n_layers: int) -> list[range]:
    """The layer ids of each pipeline stage, in pipeline order; a ConfigError for a bad split."""
    pp = job_config.parallelism
    schedule, degree, points = (
        pp.pipeline_parallel_schedule,
        pp.pipeline_parallel_degree,
        pp.pipeline_parallel_split_points,
    )
    num_stages = degree * stages_per_rank(job_config)
    if points:
        option = "parallelism.pipeline_parallel_split_points"
        starts = []
        for point in points:
            match = re.fullmatch(r"layers\.(\d+)", point)
            if not match or not 0 < int(match.group(1)) < n_layers:
                raise ConfigError(
                    f"{option}: {point!r} is not a layer that can start a stage; "
                    f"use layers.1 to layers.{n_layers - 1}"
                )
            starts.append(int(match.group(1)))
        if starts != sorted(set(starts)):
            raise ConfigError(f"{option}: {points} must be in increasing order without repeats")
        if len(points) + 1 != num_stages:
            fixed = _is_single(schedule) or schedule in V_SCHEDULES
            needed = num_stages if fixed else f"a multiple of {degree}"
            raise ConfigError(
                f"{option}: {len(points)} points make {len(points) + 1} stages but {schedule} on {degree} "
                f"ranks needs {needed} stages; give one point fewer than that"
            )
    else:
        if num_stages > n_layers:
            raise ConfigError(
                f"parallelism.pipeline_parallel_degree: {schedule} on {degree} ranks makes {num_stages} "
                f"stages but the model has only {n_layers} layers; lower the degree, or use GPipe or "
                "1F1B (one stage per rank)"
            )
        base, extra = divmod(n_layers, num_stages)
        starts = [s * base + min(s, extra) for s in range(1, num_stages)]
    bounds = [0, *starts, n_layers]
    return [range(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def num_microbatches(job_config: JobConfig, num_stages: int) -> int:
    """Micro-batches per step; a ConfigError unless they split the per-rank batch evenly (unequal
    micro-batches would weigh tokens unequally in the averaged gradient)."""
    n = job_config.parallelism.pipeline_parallel_microbatches or num_stages
    batch_size = job_config.training.batch_size
    if batch_size % n:
        raise ConfigError(
            f"parallelism.pipeline_parallel_microbatches: {n} micro-batches do not divide "
            f"training.batch_size {batch_size}; use a divisor of it or change the batch size"
        )
    return n


def validate_pipeline(job_config: JobConfig, n_layers: int) -> None:
    """Raise the ConfigError a bad pipeline layout would give, before any heavy work."""
    schedule = job_config.parallelism.pipeline_parallel_schedule
    if job_config.training.compile and schedule in SPLIT_BACKWARD_SCHEDULES:
        raise ConfigError(
            f"parallelism.pipeline_parallel_schedule: {schedule} cannot run compiled blocks; "
            "set training.compile = false or pick GPipe, 1F1B, Interleaved1F1B or LoopedBFS"
        )
    num_microbatches(job_config, len(stage_layers(job_config, n_layers)))


def stage_ids(pp_rank: int, pp_degree: int, per_rank: int, schedule: str) -> list[int]:
    """The stages a pipeline rank holds: a loop (r, r + pp, ...) or, for V schedules, a V."""
    if schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp_degree - 1 - pp_rank]
    return [pp_rank + i * pp_degree for i in range(per_rank)]


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


def pipeline_llama(
    model: nn.Module,
    world_mesh: DeviceMesh,
    parallel_dims: ParallelDims,
    job_config: JobConfig,
    device: torch.device,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    stage_io: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[_PipelineSchedule, list[nn.Module], bool, bool]:
    """(schedule, this rank's stage models, whether it holds the first stage, the last stage); each
    stage model is parallelized by `parallelize_llama`.

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
        stages.append(
            PipelineStage(part, stage_id, len(layers), device, inputs, outputs, group=pp_mesh.get_group())
        )
        model_parts.append(part)

    schedule_cls = get_schedule_class(schedule_name)
    try:
        schedule = schedule_cls(
            stages[0] if _is_single(schedule_name) else stages, n_microbatches=n_microbatches, loss_fn=loss_fn
        )
    except ValueError as e:
        raise ConfigError(
            f"parallelism.pipeline_parallel_schedule: {schedule_name} cannot run {n_microbatches} "
            f"micro-batches on {len(layers)} stages ({' '.join(str(e).split())}); "
            "change parallelism.pipeline_parallel_microbatches"
        ) from None
    return schedule, model_parts, 0 in ids, len(layers) - 1 in ids
