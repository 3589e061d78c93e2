"""How a pipeline-parallel job splits its layers: stages, the stages each rank holds, micro-batches.

Plain arithmetic on the configuration, without torch, so the preflight checks a pipeline layout
before any worker starts; torchtitan/parallelisms/pipeline.py builds the stages from it."""

import re

from torchtitan.config.options import ConfigError, JobConfig

# Schedules whose two stages per rank form a V: rank r holds stages r and 2 * pp - 1 - r, so the
# last stage sits next to the first and the loss gradient turns around without a hop.
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
# Schedules that split backward into input and weight passes, which torch.compile'd blocks cannot do.
SPLIT_BACKWARD_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
# Schedules of one stage per rank (torch's PipelineScheduleSingle; a test checks the two agree).
SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")


def stages_per_rank(job_config: JobConfig) -> int:
    """Stages each pipeline rank holds: 1 for single-stage schedules (GPipe, 1F1B), 2 for V
    schedules; for the looped multi-stage ones, as many as the split points make, else 2."""
    pp = job_config.parallelism
    if pp.pipeline_parallel_schedule in SINGLE_STAGE_SCHEDULES:
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
            match = re.fullmatch(r"layers\.([0-9]{1,9})", point)
            if not match or not 0 < int(match.group(1)) < n_layers:
                raise ConfigError(
                    f"{option}: {point!r} is not a layer that can start a stage; "
                    f"use layers.1 to layers.{n_layers - 1}"
                )
            starts.append(int(match.group(1)))
        if starts != sorted(set(starts)):
            raise ConfigError(f"{option}: {points} must be in increasing order without repeats")
        if len(points) + 1 != num_stages:
            fixed = schedule in SINGLE_STAGE_SCHEDULES or schedule in V_SCHEDULES
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


def stage_ids(pp_rank: int, pp_degree: int, per_rank: int, schedule: str) -> list[int]:
    """The stages a pipeline rank holds: a loop (r, r + pp, ...) or, for V schedules, a V."""
    if schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp_degree - 1 - pp_rank]
    return [pp_rank + i * pp_degree for i in range(per_rank)]
