"""Simulating ranks: one rank's step on fake tensors over a fake process group, run in processes
of their own, and the two shortcuts (pipeline ranks composed from two micro-batches, deep models
extrapolated from three small depths) that estimate_ranks takes where each is exact."""

import copy
import itertools
import multiprocessing
import os
from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch.distributed.pipelining.schedules import get_schedule_class

from torchtitan.config.options import JobConfig
from torchtitan.memory_estimation.pipeline import (
    PROFILED_MICROBATCHES,
    TracedAction,
    compose,
    pipeline_groups,
    traced_actions,
)
from torchtitan.memory_estimation.routing import routed_fake_mode
from torchtitan.memory_estimation.snapshots import Columns, minus, plus, to_columns
from torchtitan.memory_estimation.step import build_step
from torchtitan.memory_estimation.torch_internals import (
    FakeStore,
    FakeTensorMode,
    _PipelineScheduleRuntime,
    first_actions_only,
    gpu_all_to_all,
    new_tracker,
    static_pipeline_vote,
    untracked_sharding_propagation,
)
from torchtitan.models import flavor_args, model_spec
from torchtitan.parallelisms.parallel_dims import ParallelDims
from torchtitan.parallelisms.pipeline_layout import num_microbatches, stage_layers

Phases = list[Columns]  # peak bytes of forward and backward, then of the optimizer step


@dataclass
class SimulationTask:
    """One rank's simulation, handed to a process of its own (so picklable)."""

    cfg: JobConfig
    parallel_dims: ParallelDims
    world_size: int
    device: torch.device
    vocab: int
    n_layers: int | None = None  # the flavour's depth where None
    rank: int = 0
    compose_for: tuple[int, ...] = ()  # pipeline ranks composed from this one's two micro-batches
    expert_load: float = 1.0  # a mixture of experts' routing (routing.py)


@dataclass
class DepthSample:
    cfg: JobConfig
    n_layers: int


@dataclass
class Extrapolation:
    """Small versions of the model whose memory steps by equal amounts; the model is `num / den`
    of those steps past the first."""

    samples: list[DepthSample]
    num: int
    den: int


@dataclass
class Composition:
    phases: dict[int, Phases]  # pipeline rank -> its composed phases
    simulated: int  # how many ranks were simulated for them


@dataclass
class RankEstimates:
    peaks: list[Columns]  # one per pipeline rank (one without PP)
    how: str  # how they were obtained


def estimate_phases(task: SimulationTask) -> list[Phases | None]:
    """The rank's peak bytes, by column, in each half of a steady-state step (forward and
    backward, then the optimizer step), on fake tensors and a fake process group.

    With `compose_for` (pipeline ranks whose stages are alike in kind and size to this rank's),
    the schedule runs only its first two micro-batches, and each of those ranks' peaks is composed
    along its own full schedule (`compose`): one entry per rank, None where that cannot be done."""
    device, compose_for = task.device, task.compose_for
    dist.init_process_group("fake", store=FakeStore(), rank=task.rank, world_size=task.world_size)
    try:
        # The mesh holds real (rank-list) tensors, so it is built outside fake mode.
        world_mesh = task.parallel_dims.build_mesh(device.type) if task.world_size > 1 else None
        fake_mode = (  # the meta model is not fake
            routed_fake_mode(task.expert_load)
            if model_spec(task.cfg.model).moe
            else FakeTensorMode(allow_non_fake_inputs=True)
        )
        step = build_step(
            task.cfg, task.parallel_dims, world_mesh, device, task.vocab, fake_mode, task.n_layers
        )
        optimizer = step.optimizer
        # A steady-state step finds the optimizer state made (here from gradients of zeros); what
        # the first step also makes, the pipeline's receive buffers, stays for the later ones.
        with fake_mode:
            for param in (p for group in optimizer.param_groups for p in group["params"]):
                param.grad = torch.zeros_like(param)
            step.optimizer_step()
            optimizer.zero_grad()
        trace: list[TracedAction] = []
        orders = step.schedule.pipeline_order_with_comms if compose_for else {}
        if any(action.sub_actions for r in compose_for for action in orders[r]):
            return [None] * len(compose_for)  # overlapped forward and backward pairs: not composed
        with (
            fake_mode,
            static_pipeline_vote(),
            untracked_sharding_propagation(),
            gpu_all_to_all(),
            first_actions_only(step.schedule, PROFILED_MICROBATCHES) if compose_for else nullcontext(),
            new_tracker(step.model_parts, optimizer) as tracker,
            traced_actions(tracker, device, trace) if compose_for else nullcontext(),
        ):
            step.forward_backward()
            end, peak = tracker.get_tracker_snapshot()[device], tracker.get_tracker_snapshot("peak")[device]
            tracker.reset_peak()
            step.optimizer_step()
            optimizer_peak = minus(tracker.get_tracker_snapshot("peak")[device], end)
        if not compose_for:
            return [[to_columns(peak), to_columns(plus(end, optimizer_peak))]]
        composed = []
        for pp_rank in compose_for:
            try:
                top, after = compose(trace, end, peak, orders[pp_rank])
                composed.append([to_columns(top), to_columns(plus(after, optimizer_peak))])
            except KeyError:
                composed.append(None)
        return composed
    finally:
        dist.destroy_process_group()


def depth_samples(cfg: JobConfig, n_layers: int) -> Extrapolation | None:
    """Three small versions of the model that keep its structure, and how far to extrapolate; None
    when the model is small enough to simulate whole.

    A version keeps a whole number of selective-AC periods and more blocks (per pipeline stage)
    than FSDP prefetches ahead. With pipeline parallelism every stage loses the same number of
    layers, so a rank's stages keep their differences and its memory stays affine in the steps;
    as each rank runs its own stages only, the three versions are worth it only when together
    they hold fewer layers than the model (stages of 10 layers or more)."""
    ac = cfg.activation_checkpoint
    period = int(ac.selective_ac_option) if ac.mode == "selective" and ac.selective_ac_option.isdigit() else 1
    prefetch = max(cfg.parallelism.fsdp_forward_prefetch, cfg.parallelism.fsdp_backward_prefetch)
    first = period * -(-max(2, prefetch + 2) // period)
    if cfg.parallelism.pipeline_parallel_degree == 1:
        depths = [first, first + period, first + 2 * period]
        if depths[-1] >= n_layers:
            return None
        return Extrapolation([DepthSample(cfg, d) for d in depths], n_layers - first, period)
    counts = [len(layers) for layers in stage_layers(cfg, n_layers)]
    removed = period * ((min(counts) - first) // period)
    if removed <= 2 * period:
        return None
    samples = []
    for step in range(3):
        sample = copy.deepcopy(cfg)
        starts = itertools.accumulate(c - removed + step * period for c in counts[:-1])
        sample.parallelism.pipeline_parallel_split_points = [f"layers.{start}" for start in starts]
        samples.append(DepthSample(sample, n_layers - len(counts) * (removed - step * period)))
    if sum(s.n_layers for s in samples) >= n_layers:
        return None
    return Extrapolation(samples, removed, period)


def simulate(tasks: list[SimulationTask]) -> list[list[Phases | None]]:
    """estimate_phases(task) for each task, each in a process of its own (forked, so it starts at
    once; one task per process and per hand-out), as many at a time as there are CPUs: DTensor
    caches its sharding decisions by mesh, and the meshes of two ranks compare equal while naming
    different (fake) process groups. Children run one thread each, as OpenMP's thread pool does not
    survive a fork."""
    if len(tasks) == 1:
        return [estimate_phases(tasks[0])]
    workers = min(len(tasks), os.cpu_count() or 1)
    with multiprocessing.get_context("fork").Pool(
        workers, torch.set_num_threads, (1,), maxtasksperchild=1
    ) as pool:
        return pool.map(estimate_phases, tasks, chunksize=1)


def compose_ranks(job: SimulationTask, n_layers: int, ranks: list[int]) -> Composition:
    """The phases of the pipeline ranks that composition covers (`ranks`: the global rank standing
    for each pipeline rank; `job`: the simulation without its rank). A rank of each kind is
    simulated on two micro-batches and composes its kind; a rank whose schedule has actions its
    kind's simulation lacks (FSDP frees and gathers stages in its own pattern when a rank holds
    more than 3) is simulated for itself in a second round."""
    groups, composed, simulated = pipeline_groups(job.cfg, job.parallel_dims.pp, n_layers), {}, 0
    while groups:
        tasks = [replace(job, rank=ranks[g[0]], compose_for=tuple(g)) for g in groups]
        simulated += len(tasks)
        alone = []
        for group, phases in zip(groups, simulate(tasks)):
            for pp_rank, rank_phases in zip(group, phases):
                if rank_phases is not None:
                    composed[pp_rank] = rank_phases
                elif pp_rank != group[0]:
                    alone.append([pp_rank])
        groups = alone
    return Composition(composed, simulated)


def peak_of(phases: Phases) -> Columns:
    return max(phases, key=lambda p: p["peak"])


def estimate_ranks(
    cfg: JobConfig,
    parallel_dims: ParallelDims,
    world_size: int,
    device: torch.device,
    vocab: int,
    full: bool,
    expert_load: float = 1.0,
) -> RankEstimates:
    """Peak bytes per column of a steady-state step for the first rank of each pipeline rank (pp is
    the mesh's outermost dimension; without PP, rank 0 stands for all), and how they were obtained.

    Unless `full`, two shortcuts, each exact where it applies. With a pipeline schedule that
    runs an action list (the multi-stage ones), micro-batches after the second repeat what the
    second did: one rank per kind of rank runs two micro-batches and every rank's step is composed
    from them (estimate_phases). Otherwise, every block of the model is alike, so each half of the
    step takes memory affine in the number of blocks: the halves are simulated on three smaller
    models and, when the three points are in line (checked to the byte), extrapolated to the
    model's depth. Where neither applies, the whole step is simulated, as it is for a mixture of
    experts, which routes as routing.py assumes, with `expert_load`."""
    job = SimulationTask(cfg, parallel_dims, world_size, device, vocab, expert_load=expert_load)
    n_layers = flavor_args(cfg.model).n_layers
    ranks = [pp_rank * world_size // parallel_dims.pp for pp_rank in range(parallel_dims.pp)]
    if parallel_dims.pp_enabled and not full:
        schedule = get_schedule_class(cfg.parallelism.pipeline_parallel_schedule)
        microbatches = num_microbatches(cfg, len(stage_layers(cfg, n_layers)))
        if issubclass(schedule, _PipelineScheduleRuntime) and microbatches > PROFILED_MICROBATCHES:
            composition = compose_ranks(job, n_layers, ranks)
            composed = composition.phases
            whole = [r for r in range(parallel_dims.pp) if r not in composed]
            if len(whole) < parallel_dims.pp:
                how = (
                    f"{composition.simulated} of {parallel_dims.pp} pipeline ranks simulated on "
                    f"{PROFILED_MICROBATCHES} of {microbatches} micro-batches (all {n_layers} layers), "
                    "each rank composed from them"
                )
                if whole:
                    tasks = [replace(job, rank=ranks[r]) for r in whole]
                    composed.update((r, phases) for r, (phases,) in zip(whole, simulate(tasks)))
                    how += f"; pipeline ranks {', '.join(map(str, whole))} simulated whole"
                return RankEstimates([peak_of(composed[r]) for r in range(parallel_dims.pp)], how)
    # A mixture of experts peaks at the end of backward (every layer's gradients, and the experts'
    # gradients taking shape: GiBs above the optimizer step), a moment that outgrows the forward's
    # peak only past the small models' depths, where the three points are still in line: not
    # extrapolated.
    moe = model_spec(cfg.model).moe
    extrapolation = None if full or moe else depth_samples(cfg, n_layers)
    if extrapolation is not None:
        samples, num, den = extrapolation.samples, extrapolation.num, extrapolation.den
        tasks = [replace(job, cfg=s.cfg, n_layers=s.n_layers, rank=r) for r in ranks for s in samples]
        results = [phases for (phases,) in simulate(tasks)]
        peaks = []
        for i in range(len(ranks)):
            points = results[i * len(samples) : (i + 1) * len(samples)]
            phases = []
            for a, b, c in zip(*points):
                if any(c[k] - b[k] != b[k] - a[k] for k in a):
                    break
                phases.append({k: a[k] + (b[k] - a[k]) * num // den for k in a})
            else:
                peaks.append(peak_of(phases))
        if len(peaks) == len(ranks):
            depths = ", ".join(str(s.n_layers) for s in samples)
            return RankEstimates(peaks, f"extrapolated from {depths} layers")
    results = simulate([replace(job, rank=r) for r in ranks])
    why = " (the smaller models were not in line)" if extrapolation is not None else ""
    return RankEstimates([peak_of(phases) for (phases,) in results], f"all {n_layers} layers simulated{why}")
