"""Every private torch API the memory estimator relies on, and why. Nothing else in the package
touches one; check_torch_internals() (run by tests/test_estimate_memory.py) fails naming the one a
torch upgrade moved or reshaped.

Imported:
- torch._subclasses.fake_tensor: FakeTensorMode (the step's tensors allocate nothing) and
  unset_fake_temporarily (DTensor's shape propagation in a fake mode of its own).
- torch.utils._mode_utils.no_dispatch: real tensors made inside the fake mode's dispatch.
- torch.distributed.distributed_c10d._resolve_process_group: the group a functional collective names.
- torch.ops._c10d_functional.all_to_all_single: the op expert parallelism exchanges its token counts
  with, which routing.py answers.
- torch.distributed._tools: MemTracker, FSDPMemTracker, ModTracker, the memory trackers.
- torch.testing._internal.distributed.fake_pg.FakeStore: the store of the "fake" process group.
- torch.distributed.pipelining.schedules._PipelineScheduleRuntime (and its _Action): the schedules
  that run an action list, which compose_ranks replays.
- torch.distributed.tensor._sharding_prop.ShardingPropagator.

Overridden in the trackers below (PeakOnly, PeakTracker, PeakMemTracker, ForwardOnlyModTracker):
- ModTracker._fw_pre_hook / _fw_post_hook: follow modules through their forward only, with
  detached tensors, so that no gradient hook keeps gradients alive (split backward schedules).
- MemTracker._update_peak_stats, its _peak_mem / _peak_mem_snap / _curr_mem_snap and _mod_tracker:
  follow the device-wide peak only (per-module peaks cost the square of the depth) and reset it.
- MemTracker._pre_fw_hook, FSDPMemTracker._fsdp_state_pre_forward and memory_tracking: forget a
  module's statistics when it runs forward again (micro-batches), which the trackers refuse.
- FSDPMemTracker._root_mod: the modules it instruments, several for a rank's pipeline stages.
- FakeTensorMode.dispatch and may_turn_const, FakeTensor.constant and the mode's
  fake_tensor_converter.from_real_tensor(make_constant=True) (ValuedFakeTensorMode): fake tensors'
  constant propagation, which keeps the values of integer tensors computed from known ones (a
  mixture of experts' token counts, for the shapes that depend on them).

Patched for the duration of a simulation (mock.patch):
- PipelineStage._warmup_forward_vote / _warmup_backward_result: the stages' shape vote, which
  messages on the fake process group cannot carry.
- ShardingPropagator._propagate_tensor_meta_non_cached: DTensor's global-shape fake tensors, which
  would be counted as memory.
- schedules.record_function / _get_profiler_function_name: a hook at each action of a runtime
  schedule, to measure the memory it adds.
- _PipelineScheduleRuntime.pipeline_order_with_comms, _update_losses and _internal_losses: run only
  a rank's first micro-batches.
- torch.distributed.tensor.placement_types.shard_dim_alltoall: DTensor's Shard(i) -> Shard(j), an
  all-to-all on the GPUs, but on a CPU mesh (the simulation's) an all-gather of the whole tensor then
  a chunk: Muon's dealing of stacked matrices would count each stack whole on every rank.

Read: torch.autograd.profiler.profile.kineto_results (its events' name, nbytes, start_ns, end_ns):
the CPU allocator's memory events, for --measure on CPU.
"""

import contextlib
import inspect
import re
from collections.abc import Callable, Iterator
from unittest import mock

import torch
import torch.distributed as dist
from torch._C._autograd import _KinetoEvent
from torch._subclasses.fake_tensor import (
    FakeTensor,
    FakeTensorConverter,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed._tools.mod_tracker import ModTracker
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage, schedules
from torch.distributed.pipelining.schedules import _Action, _PipelineScheduleRuntime
from torch.distributed.tensor import DTensor, placement_types
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils import _pytree as pytree
from torch.utils._mode_utils import no_dispatch
from torch.utils._pytree import tree_map_only

__all__ = [
    "FakeStore",
    "FakeTensorMode",
    "MemTracker",
    "ValuedFakeTensorMode",
    "_PipelineScheduleRuntime",
    "check_torch_internals",
    "first_actions_only",
    "gpu_all_to_all",
    "kineto_events",
    "new_tracker",
    "process_group",
    "static_pipeline_vote",
    "traced_schedule_actions",
    "untracked_sharding_propagation",
]


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


COLLECTIVES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")


class ValuedFakeTensorMode(FakeTensorMode):
    """A fake mode in which integer tensors keep their values when computed from known ones, so that
    shapes that depend on them (a mixture of experts' rows per expert) can be known: fake tensors'
    constant propagation, which FakeTensorMode limits to one element, for integer tensors of any size.
    `overrides` maps ops whose result no fake tensor can tell (the counts of a routing, a collective
    on the fake process group) to functions of the op's arguments, given with the values of those
    known, that return a real result or None (then the op runs as usual)."""

    def __init__(self, overrides: dict[torch._ops.OpOverload, Callable], **kwargs) -> None:
        super().__init__(**kwargs)
        self.overrides = overrides

    def may_turn_const(self, t: torch.Tensor) -> bool:
        if not t.is_floating_point() and not t.is_complex() and t.device.type != "meta":
            return not self.is_our_fake(t)
        return super().may_turn_const(t)

    def dispatch(self, func, types, args=(), kwargs=None):
        if func in self.overrides:
            known = [getattr(a, "constant", None) if self.is_our_fake(a) else a for a in args]
            with no_dispatch():
                result = self.overrides[func](args, known, kwargs or {})
            if result is not None:
                return self.fake_tensor_converter.from_real_tensor(self, result, make_constant=True)
        if getattr(func, "namespace", None) in COLLECTIVES and any(
            self.is_our_fake(t) and t.constant is not None and not t.is_floating_point()
            for t in pytree.tree_leaves((args, kwargs))
        ):  # constant propagation would run it on the fake process group, which leaves its output unset
            raise NotImplementedError(f"{func} on known integers: no override tells its result")
        return super().dispatch(func, types, args, kwargs)


def process_group(group_name: str) -> dist.ProcessGroup:
    """The process group a functional collective names."""
    return _resolve_process_group(group_name)


def new_tracker(model_parts: list[torch.nn.Module], optimizer: torch.optim.Optimizer) -> MemTracker:
    """A peak tracker (with reset_peak) for the rank's model parts and optimizer."""
    if all(isinstance(part, FSDPModule) for part in model_parts):
        return PeakTracker(model_parts, optimizer)
    tracker = PeakMemTracker()
    tracker.track_external(*model_parts, optimizer)
    return tracker


@contextlib.contextmanager
def static_pipeline_vote() -> Iterator[None]:
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
def untracked_sharding_propagation() -> Iterator[None]:
    """DTensor learns an op's output shapes by running it on fake tensors of the global shapes, in
    the active fake mode: counted as memory. Its own fake mode keeps them out of the tracker."""
    propagate = ShardingPropagator._propagate_tensor_meta_non_cached

    def in_own_fake_mode(*args, **kwargs):
        with unset_fake_temporarily():
            return propagate(*args, **kwargs)

    with mock.patch.object(ShardingPropagator, "_propagate_tensor_meta_non_cached", in_own_fake_mode):
        yield


@contextlib.contextmanager
def gpu_all_to_all() -> Iterator[None]:
    """DTensor's shard-to-shard redistribution allocates what the GPUs' all-to-all does (this rank's
    chunk of the tensor gathered along `gather_dim`, as torch.chunk splits `shard_dim`), not the
    whole gathered tensor of gloo's fallback; the values are fake."""

    def all_to_all(input, gather_dim, shard_dim, mesh, mesh_dim):
        ranks, rank = mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim)
        shape = list(input.shape)
        shape[gather_dim] *= ranks
        chunk = -(-shape[shard_dim] // ranks)
        shape[shard_dim] = max(0, min(chunk, shape[shard_dim] - rank * chunk))
        return input.new_empty(shape)

    with mock.patch.object(placement_types, "shard_dim_alltoall", all_to_all):
        yield


@contextlib.contextmanager
def traced_schedule_actions(
    measured: Callable[[_Action], contextlib.AbstractContextManager],
) -> Iterator[None]:
    """Run each action of a runtime pipeline schedule inside `measured(action)`: the schedule names
    each action in a profiler range, which is hooked here."""
    with (
        mock.patch.object(schedules, "_get_profiler_function_name", lambda action: action),
        mock.patch.object(schedules, "record_function", measured),
    ):
        yield


@contextlib.contextmanager
def first_actions_only(schedule: _PipelineScheduleRuntime, microbatches: int) -> Iterator[None]:
    """Run only this rank's actions on the first `microbatches` micro-batches, and those on none
    (gathering, freeing and reducing the stages' weights). The step's end counts the last stage's
    losses: fewer here."""
    orders = schedule.pipeline_order_with_comms
    full_order = orders[schedule.rank]
    orders[schedule.rank] = [a for a in full_order if (a.microbatch_index or 0) < microbatches]
    try:
        with mock.patch.object(schedule, "_update_losses", lambda *args: schedule._internal_losses.clear()):
            yield
    finally:
        orders[schedule.rank] = full_order


def kineto_events(prof: torch.profiler.profile) -> list[_KinetoEvent]:
    """The events a finished profiler recorded, memory events included."""
    return prof.profiler.kineto_results.events()


# (owner, attribute, its parameters; None for a class or where any will do)
EXPECTED_CALLABLES = [
    (ModTracker, "_fw_pre_hook", ("self", "mod", "input")),
    (ModTracker, "_fw_post_hook", ("self", "mod", "input", "output")),
    (ModTracker, "is_bw", None),
    (MemTracker, "_pre_fw_hook", ("self", "module", "inputs")),
    (MemTracker, "_update_peak_stats", ("self", "peak_state")),
    (MemTracker, "__torch_dispatch__", ("self", "func", "types", "args", "kwargs")),
    (MemTracker, "get_tracker_snapshot", ("self", "type")),
    (MemTracker, "track_external", ("self", "external")),
    (FSDPMemTracker, "__init__", ("self", "mod", "optm")),
    (FSDPMemTracker, "_fsdp_state_pre_forward", ("self", "fsdp_mod", "orig_fsdp_state_pre_fw")),
    (PipelineStage, "_warmup_forward_vote", None),
    (PipelineStage, "_warmup_backward_result", None),
    (ShardingPropagator, "_propagate_tensor_meta_non_cached", ("self", "op_schema")),
    (schedules, "_get_profiler_function_name", ("action",)),
    (schedules, "record_function", None),
    (_PipelineScheduleRuntime, "_update_losses", ("self", "stages", "losses")),
    (_KinetoEvent, "name", None),
    (_KinetoEvent, "nbytes", None),
    (_KinetoEvent, "start_ns", None),
    (_KinetoEvent, "end_ns", None),
    (FakeTensorMode, "dispatch", ("self", "func", "types", "args", "kwargs")),
    (FakeTensorMode, "may_turn_const", ("self", "t")),
    (FakeTensorMode, "is_our_fake", ("self", "t")),
    (
        FakeTensorConverter,
        "from_real_tensor",
        ("self", "fake_mode", "t", "make_constant", "shape_env", "source", "symbolic_context", "trace"),
    ),
    (dist.distributed_c10d, "_resolve_process_group", None),
    (torch.ops._c10d_functional, "all_to_all_single", None),
    (placement_types, "shard_dim_alltoall", ("input", "gather_dim", "shard_dim", "mesh", "mesh_dim")),
]
# (owner, attributes its instances are given in its module's code)
EXPECTED_ATTRIBUTES = [
    (MemTracker, ("_peak_mem", "_peak_mem_snap", "_curr_mem_snap", "_mod_tracker", "memory_tracking")),
    (FSDPMemTracker, ("_root_mod",)),
    (_PipelineScheduleRuntime, ("pipeline_order_with_comms", "_internal_losses", "rank")),
    (torch.autograd.profiler.profile, ("kineto_results",)),
    (FakeTensorMode, ("fake_tensor_converter",)),
    (FakeTensor, ("constant",)),
]


def check_torch_internals() -> None:
    """Raise, naming each, if an internal listed above moved or changed its parameters: the
    estimator would fail, or worse count wrongly, on this torch."""
    problems = []
    for owner, name, parameters in EXPECTED_CALLABLES:
        where = f"{getattr(owner, '__qualname__', owner.__name__)}.{name}"
        found = getattr(owner, name, None)
        if found is None:
            problems.append(f"{where}: gone")
        elif parameters is not None and tuple(inspect.signature(found).parameters) != parameters:
            problems.append(f"{where}: parameters {tuple(inspect.signature(found).parameters)}")
    if _Action._fields != ("stage_index", "computation_type", "microbatch_index", "sub_actions"):
        problems.append(f"_Action: fields {_Action._fields}")
    for owner, names in EXPECTED_ATTRIBUTES:
        source = inspect.getsource(inspect.getmodule(owner))
        assigned = set(re.findall(r"self\.(\w+)\s*(?::[^=\n]+)?=[^=]", source))
        problems += [f"{owner.__qualname__}.{name}: gone" for name in names if name not in assigned]
    if problems:
        raise AssertionError(
            f"torch {torch.__version__} moved internals the memory estimator relies on "
            "(torchtitan/memory_estimation/torch_internals.py):\n" + "\n".join(problems)
        )
