"""Pipeline ranks composed from two micro-batches: a runtime schedule's micro-batches after a
stage's second repeat what the second did, so a rank that runs two of them tells the memory of
every action of its kind's full schedule."""

import collections
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from torchtitan.config.options import JobConfig
from torchtitan.memory_estimation.snapshots import Snapshot, highest, minus, plus
from torchtitan.memory_estimation.torch_internals import MemTracker, traced_schedule_actions
from torchtitan.parallelisms.pipeline_layout import stage_ids, stage_layers

PROFILED_MICROBATCHES = 2  # a stage's first and its later micro-batches


@dataclass
class TracedAction:
    """An action a runtime pipeline schedule ran, and the memory around it."""

    action: object  # the schedule's _Action
    peak_since_last: Snapshot  # between the previous action and this one
    before: Snapshot
    peak: Snapshot
    after: Snapshot


@contextlib.contextmanager
def traced_actions(tracker: MemTracker, device: torch.device, trace: list[TracedAction]) -> Iterator[None]:
    """Record each action a runtime pipeline schedule runs. The tracker's peak starts again after
    each action, so that what follows the last one is measured on its own."""

    def snapshot(kind: str = "current") -> Snapshot:
        return tracker.get_tracker_snapshot(kind)[device]

    @contextlib.contextmanager
    def measured(action):
        since_last, before = snapshot("peak"), snapshot()
        tracker.reset_peak()
        yield
        trace.append(TracedAction(action, since_last, before, snapshot("peak"), snapshot()))
        tracker.reset_peak()

    with traced_schedule_actions(measured):
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
    trace: list[TracedAction], end: Snapshot, epilogue_peak: Snapshot, order: list
) -> tuple[Snapshot, Snapshot]:
    """A rank's forward-backward peak and its memory at the end, from a `trace` of the same stages
    on fewer micro-batches: each of the rank's actions (`order`) adds the change its counterpart in
    the trace made, and peaks where that counterpart peaked, above the memory it started from. What
    follows the actions (clipping) weighs as it did in the trace. A KeyError if an action has no
    counterpart."""
    profile = {
        key: (minus(t.peak, t.before), minus(t.after, t.before))
        for key, t in zip(action_keys([t.action for t in trace]), trace)
    }
    top, now = trace[0].peak_since_last, trace[0].before  # the step's set-up, as in the trace
    for key in action_keys(order):
        above, change = profile[key]
        top = highest(top, plus(now, above))
        now = plus(now, change)
    last = trace[-1].after
    top = highest(top, plus(now, minus(epilogue_peak, last)))
    return top, plus(now, minus(end, last))


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
