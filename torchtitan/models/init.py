"""Seeded parameter initialisation that gives the same weights on any device mesh.

A parameter's values depend only on the seed, its fully-qualified name (FQN) in the full
model and its global shape: never on the mesh, the rank or the order in which parameters
are initialised. The full tensor is defined as a sequence of row blocks along dim 0, each
drawn from its own generator seeded by a stable hash of (seed, FQN, block index). A rank
draws only the blocks that overlap its local shard and copies the rows and columns it owns,
so no rank ever materialises more than one block of a parameter.

Usage::

    with seeded_init(model, seed=0):
        trunc_normal_(model.output.weight, std=0.02)
"""

import hashlib
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

__all__ = [
    "BLOCK_NUMEL",
    "clean_fqn",
    "normal_",
    "ones_",
    "seeded_init",
    "trunc_normal_",
    "uniform_",
    "zeros_",
]

# Elements per generated block (rounded to whole rows). Part of the definition of the
# weights: changing it changes the values, so it must not depend on the mesh.
BLOCK_NUMEL = 1 << 20

# Inserted into FQNs by torch.compile, activation checkpointing and FSDP1 wrappers.
_WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


@dataclass
class _InitContext:
    seed: int
    fqns: dict[int, str]  # id(param) -> FQN; the model keeps the params alive
    done: set[int] = field(default_factory=set)


_contexts: list[_InitContext] = []  # innermost last


def clean_fqn(name: str) -> str:
    """Drop wrapper prefixes so a parameter keeps the FQN it has in the plain model."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


@contextmanager
def seeded_init(model: nn.Module, seed: int) -> Iterator[None]:
    """Make the init functions key each of `model`'s parameters by (seed, FQN).

    On a clean exit, checks that every parameter was initialised exactly once.
    """
    ctx = _InitContext(seed, {id(p): clean_fqn(name) for name, p in model.named_parameters()})
    _contexts.append(ctx)
    try:
        yield
    finally:
        _contexts.pop()
    missing = sorted(ctx.fqns[i] for i in ctx.fqns.keys() - ctx.done)
    if missing:
        raise RuntimeError(f"Parameters left uninitialised: {missing}")


def _mark_initialised(tensor: torch.Tensor) -> _InitContext | None:
    """Record that `tensor` is being initialised; returns the active context, if any."""
    if not _contexts:
        return None
    ctx, key = _contexts[-1], id(tensor)
    if key not in ctx.fqns:
        raise KeyError("Tensor is not a parameter of the model passed to seeded_init")
    if key in ctx.done:
        raise RuntimeError(f"Parameter {ctx.fqns[key]} initialised twice")
    ctx.done.add(key)
    return ctx


def _generator(seed: int, fqn: str, block: int) -> torch.Generator:
    """A CPU generator seeded by a stable (not per-process salted) hash."""
    digest = hashlib.sha256(f"{seed}/{fqn}/{block}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def _global_indices(tensor: DTensor, dim: int) -> torch.Tensor:
    """Global positions along `dim` of this rank's shard, in local order.

    Sharding an index vector with the same placements handles uneven and strided shards
    without communication (`src_data_rank=None`).
    """
    placements = [
        p if isinstance(p, (Shard, _StridedShard)) and p.dim == dim else Replicate()
        for p in tensor.placements
    ]
    shape = [1] * tensor.ndim
    shape[dim] = tensor.shape[dim]
    index = torch.arange(tensor.shape[dim]).view(shape)
    local = distribute_tensor(index, tensor.device_mesh, placements, src_data_rank=None).to_local()
    return local.reshape(-1).cpu()


def _fill_(tensor: torch.Tensor, sample_: Callable[[torch.Tensor, torch.Generator], None]) -> torch.Tensor:
    """Fill `tensor` (plain or DTensor) block by block with values from `sample_`."""
    ctx = _mark_initialised(tensor)
    if ctx is None:
        raise RuntimeError("Random initialisation must run inside `seeded_init(model, seed)`")
    fqn, shape = ctx.fqns[id(tensor)], tensor.shape
    if isinstance(tensor, DTensor):
        local = tensor.to_local()
        indices = [_global_indices(tensor, d) for d in range(tensor.ndim)]
    else:
        local = tensor
        indices = [torch.arange(n) for n in shape]

    rows_per_block = max(1, BLOCK_NUMEL // math.prod(shape[1:]))
    row_blocks = indices[0] // rows_per_block
    for block in row_blocks.unique().tolist():
        start = block * rows_per_block
        values = torch.empty(min(rows_per_block, shape[0] - start), *shape[1:], dtype=torch.float32)
        sample_(values, _generator(ctx.seed, fqn, block))
        local_rows = (row_blocks == block).nonzero().squeeze(1)
        values = values[indices[0][local_rows] - start]
        for d in range(1, tensor.ndim):
            values = values.index_select(d, indices[d])
        local.index_copy_(0, local_rows.to(local.device), values.to(local.device, local.dtype))
    return tensor


@torch.no_grad()
def normal_(tensor: torch.Tensor, mean: float = 0.0, std: float = 1.0) -> torch.Tensor:
    """Mesh-invariant `nn.init.normal_` for a parameter registered with `seeded_init`."""
    return _fill_(tensor, lambda t, g: nn.init.normal_(t, mean, std, generator=g))


@torch.no_grad()
def trunc_normal_(
    tensor: torch.Tensor, mean: float = 0.0, std: float = 1.0, a: float = -2.0, b: float = 2.0
) -> torch.Tensor:
    """Mesh-invariant `nn.init.trunc_normal_`; `a` and `b` are absolute bounds, as in torch."""
    return _fill_(tensor, lambda t, g: nn.init.trunc_normal_(t, mean, std, a, b, generator=g))


@torch.no_grad()
def uniform_(tensor: torch.Tensor, a: float = 0.0, b: float = 1.0) -> torch.Tensor:
    """Mesh-invariant `nn.init.uniform_` on [a, b)."""
    return _fill_(tensor, lambda t, g: nn.init.uniform_(t, a, b, generator=g))


@torch.no_grad()
def ones_(tensor: torch.Tensor) -> torch.Tensor:
    """Fill with ones; also usable outside `seeded_init`, as nothing random is drawn."""
    _mark_initialised(tensor)
    (tensor.to_local() if isinstance(tensor, DTensor) else tensor).fill_(1.0)
    return tensor


@torch.no_grad()
def zeros_(tensor: torch.Tensor) -> torch.Tensor:
    """Fill with zeros; also usable outside `seeded_init`, as nothing random is drawn."""
    _mark_initialised(tensor)
    (tensor.to_local() if isinstance(tensor, DTensor) else tensor).fill_(0.0)
    return tensor
