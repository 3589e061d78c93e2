"""Estimate a training job's peak memory per rank without its hardware, or measure it here.

    NGPU=64 python scripts/estimate_memory.py --job.config_file F [--section.key VALUE ...]

builds the job's model and parallel layout with the trainer's own code (parallelize_llama) on fake
tensors, over a fake process group of NGPU ranks (default 8), runs a training step under torch's
MemTracker and prints the peak of a steady-state step (the optimizer state already made), per
rank, split into parameters, gradients, optimizer state and activations. Nothing is allocated and
no GPU is needed. Several --job.config_file give a row each, the other options applying to all;
with pipeline parallelism each pipeline rank gets a row (their stages and in-flight micro-batches
differ). Two shortcuts, exact where they apply (estimate_ranks): with a multi-stage pipeline
schedule, one rank of each kind runs two micro-batches and every rank's step is composed from its
actions; otherwise blocks are alike, so a deep model is simulated at three small depths and
extrapolated. --full simulates the whole step, slowly. The simulations run side by side, one
process each, on the machine's CPUs. Every layout the trainer runs is covered: FSDP, HSDP, DDP,
TP, PP (every schedule), activation checkpointing and gradient accumulation.

    torchrun --nproc_per_node N scripts/estimate_memory.py --measure --job.config_file F [...]

runs the same steps for real on this machine (NCCL on CUDA, gloo on CPU), PP included, and prints
each rank's measured peak: torch.cuda.max_memory_allocated, or on CPU the peak of the bytes the CPU
allocator holds, from the profiler's memory events.

Counted: tensors, as the allocator sees them. Not counted: the CUDA context, NCCL buffers and the
caching allocator's fragmentation (reserved over allocated), which together often add a few GiB.
training.compile is not applied (so this is eager-mode memory, an upper bound for compiled blocks).
"""

import collections
import contextlib
import copy
import itertools
import logging
import multiprocessing
import os
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import replace
from unittest import mock

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed._tools.mod_tracker import ModTracker
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage, schedules
from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime, get_schedule_class
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.distributed.tensor.parallel import loss_parallel
from torch.profiler import ProfilerActivity, record_function
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._pytree import tree_map_only

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from torchtitan.config_manager import ConfigError, JobConfig, parse_args, resolve_path  # noqa: E402
from torchtitan.config_rules import check_layout, gradient_accumulation_steps  # noqa: E402
from torchtitan.datasets.tokenizer import Tokenizer  # noqa: E402
from torchtitan.distributed import clip_grad_norm_, init_distributed  # noqa: E402
from torchtitan.models import MODEL_FLAVORS  # noqa: E402
from torchtitan.models.llama.model import Transformer  # noqa: E402
from torchtitan.optimizer import build_optimizer  # noqa: E402
from torchtitan.parallelisms.parallel_dims import ParallelDims  # noqa: E402
from torchtitan.parallelisms.parallelize_llama import DTYPES, parallelize_llama, set_grad_all_reduce  # noqa: E402
from torchtitan.parallelisms.pipeline_layout import num_microbatches, stage_ids, stage_layers  # noqa: E402
from torchtitan.parallelisms.pipeline_llama import pipeline_llama, split_model  # noqa: E402
from torchtitan.train_step import loss_fn  # noqa: E402

# MemTracker's memory kinds (FSDPMemTracker's finer ones included) -> the columns printed.
# Gathered parameters and their all-gather buffers count as parameters, reduce-scatter buffers as
# gradients, and the backward pass's temporaries (gradients of activations) as activations.
COLUMNS = {
    "Parameter": "params",
    "Sharded Param": "params",
    "Unsharded Param": "params",
    "All Gather": "params",
    "Buffer": "params",
    "Gradient": "grads",
    "Sharded Grad": "grads",
    "Unsharded Grad": "grads",
    "Reduce Scatter": "grads",
    "Optstate": "optimizer",
    "OptState": "optimizer",
    "Activation": "activations",
    "Temp": "activations",
    "Inputs": "activations",
    "Other": "activations",
}
GIB = 2**30


class ForwardOnlyModTracker(ModTracker):
    """ModTracker that follows modules through their forward only, hooking no gradients (it shows
    them detached tensors). Its gradient hooks keep the gradients they see until every input of a
    module has one, which never happens when a pipeline schedule splits backward into an input pass
    and a weight pass (ZBVZeroBubble, DualPipeV, InterleavedZeroBubble): in the estimate those
    gradients would stay alive. Backward memory is still told apart by the autograd engine state."""

    def _fw_pre_hook(self, mod, input):
        super()._fw_pre_hook(mod, tree_map_only(torch.Tensor, torch.Tensor.detach, input))

    def _fw_post_hook(self, mod, input, output):
        super()._fw_post_hook(mod, input, tree_map_only(torch.Tensor, torch.Tensor.detach, output))


class PeakOnly:
    """For MemTracker and FSDPMemTracker: follow the device-wide peak only. They also keep
    per-module statistics, unused here: they update every module's own peak at every op (a cost
    that grows with the square of the depth) and refuse a module's second forward in a step
    (gradient accumulation, pipeline micro-batches). Here a module's statistics are dropped when it
    runs forward again."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._mod_tracker = ForwardOnlyModTracker()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.prim.device.default and not any(t is DTensor for t in types):
            return func(*args)  # asked by most ops, allocates nothing: spare it the bookkeeping
        return super().__torch_dispatch__(func, types, args, kwargs)

    def reset_peak(self) -> None:
        self._peak_mem_snap = self.get_tracker_snapshot()
        self._peak_mem = {dev: snap["Total"] for dev, snap in self._peak_mem_snap.items()}

    def _update_peak_stats(self, peak_state) -> None:
        for dev, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < snap["Total"]:
                self._peak_mem[dev] = snap["Total"]
                self._peak_mem_snap[dev] = dict(snap)


class PeakTracker(PeakOnly, FSDPMemTracker):
    """For FSDP models, also several (a rank's pipeline stages)."""

    def __init__(self, model_parts: list[FSDPModule], optimizer: torch.optim.Optimizer) -> None:
        super().__init__(model_parts[0], optimizer)
        self._root_mod = torch.nn.ModuleList(model_parts)  # the modules it instruments

    def _fsdp_state_pre_forward(self, fsdp_mod, orig_fsdp_state_pre_fw):
        pre_forward = super()._fsdp_state_pre_forward(fsdp_mod, orig_fsdp_state_pre_fw)

        def forget_last_forward(*args, **kwargs):
            if not self._mod_tracker.is_bw:  # a forward recomputed by AC is part of the same one
                self.memory_tracking.pop(fsdp_mod, None)
            return pre_forward(*args, **kwargs)

        return forget_last_forward


class PeakMemTracker(PeakOnly, MemTracker):
    """For models that are not one FSDP module."""

    def _pre_fw_hook(self, module, inputs) -> None:
        if not self._mod_tracker.is_bw:
            self.memory_tracking.pop(module, None)
        super()._pre_fw_hook(module, inputs)


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


@contextlib.contextmanager
def static_pipeline_vote():
    """At their first step, pipeline stages vote along the pipeline on whether every stage was
    given its shapes. Messages on the fake process group carry nothing, so the vote is answered
    here: yes, every simulated stage is given them (pipeline_stage_io)."""
    yes = lambda *args, **kwargs: torch.tensor([1], dtype=torch.int32)  # noqa: E731
    with (
        mock.patch.object(PipelineStage, "_warmup_forward_vote", yes),
        mock.patch.object(PipelineStage, "_warmup_backward_result", yes),
    ):
        yield


@contextlib.contextmanager
def untracked_sharding_propagation():
    """DTensor learns an op's output shapes by running it on fake tensors of the global shapes, in
    the active fake mode: counted as memory. Its own fake mode keeps them out of the tracker."""
    propagate = ShardingPropagator._propagate_tensor_meta_non_cached

    def in_own_fake_mode(*args, **kwargs):
        with unset_fake_temporarily():
            return propagate(*args, **kwargs)

    with mock.patch.object(ShardingPropagator, "_propagate_tensor_meta_non_cached", in_own_fake_mode):
        yield


def build_step(
    cfg: JobConfig,
    parallel_dims: ParallelDims,
    world_mesh,
    device: torch.device,
    vocab_size: int,
    fake_mode: FakeTensorMode | None = None,
    n_layers: int | None = None,
) -> tuple[list[torch.nn.Module], torch.optim.Optimizer, Callable[[], None], Callable[[], None], object]:
    """The rank's model parts and optimizer, built as train.py builds them, the two halves of
    one training step of the job on random tokens: forward and backward (with clipping), then the
    optimizer step, and the pipeline schedule (None without PP). With `fake_mode` the parameters
    are fake tensors (run the step under it too); `n_layers` overrides the flavour's depth."""
    model_args = replace(
        MODEL_FLAVORS[cfg.model.name][cfg.model.flavor],
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
        pipeline, model_parts = pipeline_llama(
            model, world_mesh, parallel_dims, cfg, device, loss_fn, stage_io
        )
        pp_schedule, has_first_stage, has_last_stage = (
            pipeline.schedule,
            pipeline.has_first_stage,
            pipeline.has_last_stage,
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

    return model_parts, optimizer, forward_backward, optimizer.step, pp_schedule


def to_columns(snapshot: dict) -> dict[str, int]:
    columns = dict.fromkeys(["params", "grads", "optimizer", "activations"], 0)
    for kind, nbytes in snapshot.items():
        name = getattr(kind, "value", kind)  # MemTracker's kinds are str enums
        if name != "Total":
            columns[COLUMNS.get(name, "activations")] += nbytes
    columns["peak"] = snapshot["Total"]
    return columns


Snapshot = dict[str, int]  # MemTracker's memory kinds (and "Total") -> bytes
PROFILED_MICROBATCHES = 2  # a stage's first and its later micro-batches


def plus(a: Snapshot, b: Snapshot) -> Snapshot:
    return {k: a.get(k, 0) + b.get(k, 0) for k in a.keys() | b.keys()}


def minus(a: Snapshot, b: Snapshot) -> Snapshot:
    return {k: a.get(k, 0) - b.get(k, 0) for k in a.keys() | b.keys()}


def highest(*snapshots: Snapshot) -> Snapshot:
    return max(snapshots, key=lambda snap: snap["Total"])


@contextlib.contextmanager
def traced_actions(tracker: MemTracker, device: torch.device, trace: list[tuple]):
    """Record each action a runtime pipeline schedule runs (it names each in a profiler range):
    (action, the peak since the last action, the memory before it, its peak, the memory after it).
    The tracker's peak starts again after each action, so that what follows the last one is
    measured on its own."""

    def snapshot(kind: str = "current") -> Snapshot:
        return tracker.get_tracker_snapshot(kind)[device]

    @contextlib.contextmanager
    def measured(action):
        since_last, before = snapshot("peak"), snapshot()
        tracker.reset_peak()
        yield
        trace.append((action, since_last, before, snapshot("peak"), snapshot()))
        tracker.reset_peak()

    with (
        mock.patch.object(schedules, "_get_profiler_function_name", lambda action: action),
        mock.patch.object(schedules, "record_function", measured),
    ):
        yield


def action_keys(order: list) -> list[tuple]:
    """What an action's memory depends on: its stage's place on the rank, its kind, and for
    per-micro-batch actions whether it is the stage's first of that kind (later ones are alike);
    for the others (gather, free, reduce the stage's weights) which occurrence it is."""
    position = {stage: i for i, stage in enumerate(sorted({a.stage_index for a in order}))}
    seen: collections.Counter = collections.Counter()
    keys = []
    for action in order:
        kind = (position[action.stage_index], action.computation_type)
        seen[kind] += 1
        keys.append((*kind, seen[kind] if action.microbatch_index is None else min(seen[kind], 2)))
    return keys


def compose(
    trace: list[tuple], end: Snapshot, epilogue_peak: Snapshot, order: list
) -> tuple[Snapshot, Snapshot]:
    """A rank's forward-backward peak and its memory at the end, from a `trace` of the same stages
    on fewer micro-batches: each of the rank's actions (`order`) adds the change its counterpart in
    the trace made, and peaks where that counterpart peaked, above the memory it started from. What
    follows the actions (clipping) weighs as it did in the trace. A KeyError if an action has no
    counterpart."""
    profile = {
        key: (minus(peak, before), minus(after, before))
        for key, (_, _, before, peak, after) in zip(action_keys([t[0] for t in trace]), trace)
    }
    _, top, now, _, _ = trace[0]  # before the actions: the step's set-up, as in the trace
    for key in action_keys(order):
        above, change = profile[key]
        top = highest(top, plus(now, above))
        now = plus(now, change)
    last = trace[-1][-1]
    top = highest(top, plus(now, minus(epilogue_peak, last)))
    return top, plus(now, minus(end, last))


@contextlib.contextmanager
def first_microbatches_only(schedule: _PipelineScheduleRuntime):
    """Run only this rank's actions on the first PROFILED_MICROBATCHES micro-batches, and those
    on none (gathering, freeing and reducing the stages' weights). The step's end counts the last
    stage's losses: fewer here."""
    orders = schedule.pipeline_order_with_comms
    full_order = orders[schedule.rank]
    orders[schedule.rank] = [a for a in full_order if (a.microbatch_index or 0) < PROFILED_MICROBATCHES]
    try:
        with mock.patch.object(schedule, "_update_losses", lambda *args: schedule._internal_losses.clear()):
            yield
    finally:
        orders[schedule.rank] = full_order


def estimate_phases(
    cfg: JobConfig,
    parallel_dims: ParallelDims,
    world_size: int,
    device: torch.device,
    vocab: int,
    n_layers: int | None = None,
    rank: int = 0,
    compose_for: tuple[int, ...] = (),
) -> list[list[dict[str, int]] | None]:
    """The rank's peak bytes, by column, in each half of a steady-state step (forward and
    backward, then the optimizer step), on fake tensors and a fake process group.

    With `compose_for` (pipeline ranks whose stages are alike in kind and size to this rank's),
    the schedule runs only its first two micro-batches, and each of those ranks' peaks is composed
    along its own full schedule (`compose`): one entry per rank, None where that cannot be done."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        # The mesh holds real (rank-list) tensors, so it is built outside fake mode.
        world_mesh = parallel_dims.build_mesh(device.type) if world_size > 1 else None
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)  # the meta model is not fake
        model_parts, optimizer, forward_backward, optimizer_step, schedule = build_step(
            cfg, parallel_dims, world_mesh, device, vocab, fake_mode, n_layers
        )

        def new_tracker() -> MemTracker:
            if all(isinstance(part, FSDPModule) for part in model_parts):
                return PeakTracker(model_parts, optimizer)
            tracker = PeakMemTracker()
            tracker.track_external(*model_parts, optimizer)
            return tracker

        # A steady-state step finds the optimizer state made (here from gradients of zeros); what
        # the first step also makes, the pipeline's receive buffers, stays for the later ones.
        with fake_mode:
            for param in (p for group in optimizer.param_groups for p in group["params"]):
                param.grad = torch.zeros_like(param)
            optimizer_step()
            optimizer.zero_grad()
        trace = []
        orders = schedule.pipeline_order_with_comms if compose_for else {}
        if any(action.sub_actions for r in compose_for for action in orders[r]):
            return [None] * len(compose_for)  # overlapped forward and backward pairs: not composed
        with (
            fake_mode,
            static_pipeline_vote(),
            untracked_sharding_propagation(),
            first_microbatches_only(schedule) if compose_for else contextlib.nullcontext(),
            new_tracker() as tracker,
            traced_actions(tracker, device, trace) if compose_for else contextlib.nullcontext(),
        ):
            forward_backward()
            end, peak = tracker.get_tracker_snapshot()[device], tracker.get_tracker_snapshot("peak")[device]
            tracker.reset_peak()
            optimizer_step()
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


def depth_samples(cfg: JobConfig, n_layers: int) -> tuple[list[tuple[JobConfig, int]], int, int]:
    """Three small versions of the model that keep its structure, and how far to extrapolate:
    ([(job, depth)] whose memory steps by equal amounts, and the model being `num / den` of those
    steps past the first). Empty when the model is small enough to simulate whole.

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
        return ([(cfg, d) for d in depths], n_layers - first, period) if depths[-1] < n_layers else ([], 0, 1)
    counts = [len(layers) for layers in stage_layers(cfg, n_layers)]
    removed = period * ((min(counts) - first) // period)
    if removed <= 2 * period:
        return [], 0, 1
    samples = []
    for step in range(3):
        sample = copy.deepcopy(cfg)
        starts = itertools.accumulate(c - removed + step * period for c in counts[:-1])
        sample.parallelism.pipeline_parallel_split_points = [f"layers.{start}" for start in starts]
        samples.append((sample, n_layers - len(counts) * (removed - step * period)))
    if sum(depth for _, depth in samples) >= n_layers:
        return [], 0, 1
    return samples, removed, period


def simulate(tasks: list[tuple]) -> list[list[list[dict[str, int]] | None]]:
    """estimate_phases(*task) for each task, each in a process of its own (forked, so it starts at
    once; one task per process and per hand-out), as many at a time as there are CPUs: DTensor
    caches its sharding decisions by mesh, and the meshes of two ranks compare equal while naming
    different (fake) process groups. Children run one thread each, as OpenMP's thread pool does not
    survive a fork."""
    if len(tasks) == 1:
        return [estimate_phases(*tasks[0])]
    workers = min(len(tasks), os.cpu_count() or 1)
    with multiprocessing.get_context("fork").Pool(
        workers, torch.set_num_threads, (1,), maxtasksperchild=1
    ) as pool:
        return pool.starmap(estimate_phases, tasks, chunksize=1)


def pipeline_groups(cfg: JobConfig, pp: int, n_layers: int) -> list[list[int]]:
    """The pipeline ranks grouped by the stages they hold: alike in layers, in holding the model's
    ends and in being next to each other (a V schedule's turn), in the rank's order."""
    layers = stage_layers(cfg, n_layers)
    groups: dict[tuple, list[int]] = {}
    for pp_rank in range(pp):
        ids = stage_ids(pp_rank, pp, len(layers) // pp, cfg.parallelism.pipeline_parallel_schedule)
        kinds = tuple((len(layers[i]), i == 0, i == len(layers) - 1) for i in ids)
        turns = tuple(b - a == 1 for a, b in zip(ids, ids[1:]))
        groups.setdefault((kinds, turns), []).append(pp_rank)
    return list(groups.values())


def compose_ranks(
    cfg: JobConfig,
    parallel_dims: ParallelDims,
    world_size: int,
    device: torch.device,
    vocab: int,
    n_layers: int,
    ranks: list[int],
) -> tuple[dict[int, list[dict[str, int]]], int]:
    """The phases of the pipeline ranks that composition covers, and how many ranks were simulated
    for them (`ranks`: the global rank standing for each pipeline rank). A rank of each kind is
    simulated on two micro-batches and composes its kind; a rank whose schedule has actions its
    kind's simulation lacks (FSDP frees and gathers stages in its own pattern when a rank holds
    more than 3) is simulated for itself in a second round."""
    groups, composed, simulated = pipeline_groups(cfg, parallel_dims.pp, n_layers), {}, 0
    while groups:
        tasks = [(cfg, parallel_dims, world_size, device, vocab, None, ranks[g[0]], tuple(g)) for g in groups]
        simulated += len(tasks)
        alone = []
        for group, phases in zip(groups, simulate(tasks)):
            for pp_rank, rank_phases in zip(group, phases):
                if rank_phases is not None:
                    composed[pp_rank] = rank_phases
                elif pp_rank != group[0]:
                    alone.append([pp_rank])
        groups = alone
    return composed, simulated


def estimate_ranks(
    cfg: JobConfig, parallel_dims: ParallelDims, world_size: int, device: torch.device, vocab: int, full: bool
) -> tuple[list[dict[str, int]], str]:
    """Peak bytes per column of a steady-state step for the first rank of each pipeline rank (pp is
    the mesh's outermost dimension; without PP, rank 0 stands for all), and how they were obtained.

    Unless `full`, two shortcuts, each exact where it applies. With a pipeline schedule that
    runs an action list (the multi-stage ones), micro-batches after the second repeat what the
    second did: one rank per kind of rank runs two micro-batches and every rank's step is composed
    from them (estimate_phases). Otherwise, every block of the model is alike, so each half of the
    step takes memory affine in the number of blocks: the halves are simulated on three smaller
    models and, when the three points are in line (checked to the byte), extrapolated to the
    model's depth. Where neither applies, the whole step is simulated."""
    n_layers = MODEL_FLAVORS[cfg.model.name][cfg.model.flavor].n_layers
    ranks = [pp_rank * world_size // parallel_dims.pp for pp_rank in range(parallel_dims.pp)]
    peak_of = lambda phases: max(phases, key=lambda p: p["peak"])  # noqa: E731
    if parallel_dims.pp_enabled and not full:
        schedule = get_schedule_class(cfg.parallelism.pipeline_parallel_schedule)
        microbatches = num_microbatches(cfg, len(stage_layers(cfg, n_layers)))
        if issubclass(schedule, _PipelineScheduleRuntime) and microbatches > PROFILED_MICROBATCHES:
            composed, simulated = compose_ranks(
                cfg, parallel_dims, world_size, device, vocab, n_layers, ranks
            )
            whole = [r for r in range(parallel_dims.pp) if r not in composed]
            if len(whole) < parallel_dims.pp:
                how = (
                    f"{simulated} of {parallel_dims.pp} pipeline ranks simulated on {PROFILED_MICROBATCHES} "
                    f"of {microbatches} micro-batches (all {n_layers} layers), each rank composed from them"
                )
                if whole:
                    tasks = [(cfg, parallel_dims, world_size, device, vocab, None, ranks[r]) for r in whole]
                    composed.update((r, phases) for r, (phases,) in zip(whole, simulate(tasks)))
                    how += f"; pipeline ranks {', '.join(map(str, whole))} simulated whole"
                return [peak_of(composed[r]) for r in range(parallel_dims.pp)], how
    samples, num, den = ([], 0, 1) if full else depth_samples(cfg, n_layers)
    if samples:
        tasks = [
            (job, parallel_dims, world_size, device, vocab, depth, r) for r in ranks for job, depth in samples
        ]
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
            return peaks, f"extrapolated from {', '.join(str(d) for _, d in samples)} layers"
    results = simulate([(cfg, parallel_dims, world_size, device, vocab, None, r) for r in ranks])
    why = " (the smaller models were not in line)" if samples else ""
    return [peak_of(phases) for (phases,) in results], f"all {n_layers} layers simulated{why}"


def layout_of(cfg: JobConfig, parallel_dims: ParallelDims) -> str:
    degrees = [
        ("dp_replicate", parallel_dims.dp_replicate),
        ("dp_shard", parallel_dims.dp_shard),
        ("tp", parallel_dims.tp),
        ("pp", parallel_dims.pp),
    ]
    text = " ".join(f"{name}={d}" for name, d in degrees if d > 1) or "1 rank"
    if cfg.activation_checkpoint.mode != "none":
        text += f" ac={cfg.activation_checkpoint.mode}"
    return f"{text} bs={cfg.training.batch_size}x{cfg.training.seq_len} {cfg.training.mixed_precision_param}"


def row(cfg: JobConfig, layout: str, rank: object, values: list[object]) -> str:
    name = f"{cfg.model.name} {cfg.model.flavor}" if isinstance(cfg, JobConfig) else cfg
    cells = [f"{v / GIB:>8.3f}" if isinstance(v, int) else f"{v:>8}" for v in values]
    return f"{name:<16} {layout:<48} {rank!s:>5} " + " ".join(cells)


def estimate(configs: list[JobConfig], world_size: int, full: bool = False) -> None:
    """Print a row per job, or with pipeline parallelism a row per pipeline rank (their stages and
    in-flight micro-batches differ); the ranks of the other dimensions hold the same share (FSDP
    pads uneven shards), so the first stands for all."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    jobs, notes = [], []
    for cfg in configs:  # every job is checked before any is estimated
        if cfg.training.compile:
            cfg.training.compile = False
            cfg.parallelism.enable_async_tensor_parallel = False
            notes.append("training.compile was ignored: the figures are for eager mode")
        jobs.append((cfg, check_layout(cfg, world_size, device.type), vocab_size_of(cfg)))
    print(f"Estimated peak memory per rank (GiB) of a steady-state step, {world_size} ranks ({device.type}):")
    print(row("model", "layout", "rank", ["params", "grads", "optim", "activ", "peak"]))
    for cfg, parallel_dims, vocab in jobs:
        start = time.perf_counter()
        peaks, how = estimate_ranks(cfg, parallel_dims, world_size, device, vocab, full)
        labels = (
            [f"pp{pp_rank}" for pp_rank in range(parallel_dims.pp)] if parallel_dims.pp_enabled else ["all"]
        )
        for label, cols in zip(labels, peaks):
            print(row(cfg, layout_of(cfg, parallel_dims), label, list(cols.values())), flush=True)
        notes.append(f"{cfg.model.flavor}: {how}, {time.perf_counter() - start:.1f}s")
    print("; ".join(dict.fromkeys(notes)))


def cpu_peak(prof: torch.profiler.profile, window: str) -> int:
    """Peak of the bytes the CPU allocator held during the `window` record_function, from the
    profiler's memory events (allocations made before the profiler started are not seen)."""
    events = prof.profiler.kineto_results.events()
    (marker,) = [e for e in events if e.name() == window]
    memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    live = sum(nbytes for t, nbytes in memory if t < marker.start_ns())
    peak = live
    for t, nbytes in memory:
        if marker.start_ns() <= t <= marker.end_ns():
            live += nbytes
            peak = max(peak, live)
    return peak


def measure(cfg: JobConfig) -> None:
    """Run the step for real on this machine's devices (under torchrun) and print each rank's peak."""
    world_size, rank, device = init_distributed(cfg.comm.init_timeout_seconds)
    cfg.training.compile = False
    parallel_dims = check_layout(cfg, world_size, device.type)
    world_mesh = parallel_dims.build_mesh(device.type) if world_size > 1 else None
    vocab = vocab_size_of(cfg)

    def step() -> None:
        forward_backward()
        optimizer_step()

    if device.type == "cuda":
        _, _, forward_backward, optimizer_step, _ = build_step(cfg, parallel_dims, world_mesh, device, vocab)
        step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        with torch.profiler.profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            _, _, forward_backward, optimizer_step, _ = build_step(
                cfg, parallel_dims, world_mesh, device, vocab
            )
            step()
            with record_function("measured step"):
                step()
        peak = cpu_peak(prof, "measured step")
    peaks = [peak]
    if world_size > 1:
        peaks = [None] * world_size
        dist.all_gather_object(peaks, peak)
        dist.barrier()  # ranks that tear their group down while a peer still uses it can abort at exit
        dist.destroy_process_group()
    if rank == 0:
        print(
            f"Measured peak memory per rank (GiB) of a steady-state step, {world_size} ranks ({device.type}):"
        )
        print(row("model", "layout", "rank", ["peak"]))
        for r, p in enumerate(peaks):
            print(row(cfg, layout_of(cfg, parallel_dims), r, [p]))


def split_config_files(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the --job.config_file values, the other arguments)."""
    files, rest, i = [], [], 0
    while i < len(argv):
        if argv[i] == "--job.config_file" and i + 1 < len(argv):
            files.append(argv[i + 1])
            i += 2
            continue
        if argv[i].startswith("--job.config_file="):
            files.append(argv[i].split("=", 1)[1])
        else:
            rest.append(argv[i])
        i += 1
    return files, rest


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    warnings.filterwarnings("ignore", message=".*Profiler won't be using warmup.*")
    # DTensor's advice to flatten the mesh for the gradient norm's all-reduces: once per process.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    try:
        files, rest = split_config_files([a for a in argv if a not in ("--measure", "--full")])
        configs = [parse_args(["--job.config_file", f, *rest]) for f in files] or [parse_args(rest)]
        if "--measure" in argv:
            if len(configs) > 1:
                raise ConfigError("--measure: give one --job.config_file")
            measure(configs[0])
            return 0
        ngpu = os.environ.get("NGPU", "8")
        if not ngpu.isdigit() or int(ngpu) < 1:
            raise ConfigError(f"NGPU: expected a positive number of ranks, got {ngpu!r}")
        estimate(configs, int(ngpu), full="--full" in argv)
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
