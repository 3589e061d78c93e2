"""The routing a mixture-of-experts step is simulated with. Which experts a token takes depends on
the weights and the data, which fake tensors do not hold, and so do the step's shapes: the rows each
expert runs and, under expert parallelism, the rows each rank sends and receives by all-to-all.

The assumption, stated in every estimate of such a model: balanced routing. Each expert of a layer
takes an equal share of a rank's tokens x top_k (token, choice) rows, and every rank routes alike, so
under expert parallelism each rank sends and receives tokens x top_k rows. `expert_load` F (the
script's --expert-load, default 1) makes the simulated rank's experts receive F times that from
every rank, as if each of them took F times the mean load (the logged `expert_load` metric is that
max / mean over a layer's experts, so it bounds F); its own tokens still leave balanced. Without
expert parallelism a rank runs all its tokens x top_k rows whatever the routing, and F changes
nothing. The rest of the step is the trainer's own code, all-to-all buffers included.
"""

from collections.abc import Callable

import torch

from torchtitan.memory_estimation.torch_internals import ValuedFakeTensorMode, process_group

aten, c10d = torch.ops.aten, torch.ops._c10d_functional


def balanced_boundaries(args: tuple, known: list, kwargs: dict) -> torch.Tensor | None:
    """torch.searchsorted of the expert boundaries 0..E in the sorted chosen experts (how MoE counts
    its rows, its only use of the op): each expert an equal share of the rows (the first ones a row
    more where the experts do not divide them). None where the sorted experts' values are known."""
    sorted_experts, bounds = args
    if known[0] is not None or bounds.numel() < 2:
        return None
    rows, experts = sorted_experts.numel(), bounds.numel() - 1
    counts = torch.full((experts,), rows // experts, dtype=torch.int64, device=bounds.device)
    counts[: rows % experts] += 1
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)])


def alike_ranks(expert_load: float) -> Callable:
    """The all-to-all of a rank's rows per expert (expert parallelism's first exchange, even splits
    of known integers): every rank sends this rank's experts what this one sends them, `expert_load`
    times. None for other all-to-alls."""

    def exchange(args: tuple, known: list, kwargs: dict) -> torch.Tensor | None:
        counts, output_splits, input_splits, group_name = known[0], *args[1:4]
        if counts is None or counts.is_floating_point() or len({*output_splits, *input_splits}) != 1:
            return None
        group = process_group(group_name)
        mine = counts.view(group.size(), -1)[group.rank()]
        return (mine * expert_load).round().to(counts.dtype).repeat(group.size())

    return exchange


def routed_fake_mode(expert_load: float = 1.0) -> ValuedFakeTensorMode:
    """A fake mode in which a mixture of experts routes as the module docstring states."""
    overrides = {
        aten.searchsorted.Tensor: balanced_boundaries,
        c10d.all_to_all_single.default: alike_ranks(expert_load),
    }
    return ValuedFakeTensorMode(overrides, allow_non_fake_inputs=True)
