"""Process-group setup and the few collectives the training loop needs."""

import math
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate

from torchtitan.parallelisms.parallel_dims import Meshes


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed(init_timeout_seconds: int) -> tuple[int, int, torch.device]:
    """(world size, rank, device) from torchrun's environment; a process group only if world size > 1.

    NCCL on CUDA, gloo on CPU; a group the caller made first is kept (scripts/benchmarks/benchmark_gpu.py's
    two ranks sharing one GPU over gloo)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if device_type() == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            timeout=timedelta(seconds=init_timeout_seconds),
            device_id=(device if device.type == "cuda" else None),
        )
    return world_size, rank, device


def set_collective_timeout(seconds: int) -> None:
    """Set the timeout of every process group this rank belongs to: the device mesh's groups and
    the checkpointer's are created with torch's default (10 min for NCCL, 30 for gloo), not the
    world's. Called once the mesh exists (comm.init_timeout_seconds), then after the first step has
    shown that every rank is up and compiled (comm.train_timeout_seconds)."""
    if dist.is_initialized():
        for group in list(dist.distributed_c10d._world.pg_map):
            dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), group)


def dist_mean(x: torch.Tensor, mesh: DeviceMesh | None) -> float:
    """Mean of a scalar over the ranks of `mesh` (host sync: call at logging steps only)."""
    if isinstance(x, DTensor):  # the loss under loss parallel: replicated over the tp mesh
        x = x.full_tensor()
    x = x.detach().to(torch.get_default_dtype())  # float32 (float64 under training.float64)
    if mesh is not None:
        x = x.clone()
        dist.all_reduce(x, group=mesh.get_group())  # a sum: gloo, on CPU or CUDA tensors, has no AVG
        x /= mesh.size()
    return x.item()


def dist_sum(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Sum of a tensor over the ranks of `mesh`, e.g. to share a value one rank holds (others 0)."""
    if isinstance(x, DTensor):  # the loss under loss parallel: replicated over the tp mesh
        x = x.full_tensor()
    x = x.detach().clone()
    dist.all_reduce(x, group=mesh.get_group())
    return x


def dist_min(x: int, mesh: DeviceMesh | None) -> int:
    """The least of an integer over the ranks of `mesh` (`x` itself without one)."""
    if mesh is None:
        return x
    least = torch.tensor(x, device=device_type())
    dist.all_reduce(least, op=dist.ReduceOp.MIN, group=mesh.get_group())
    return int(least.item())


def global_mean_loss(loss: torch.Tensor, meshes: Meshes) -> float:
    """A rank's loss as the whole global batch's: summed over the pipeline (its last stage holds it, the
    others 0), averaged over the ranks whose tokens differ (dp x cp: each holds as many tokens)."""
    return dist_mean(dist_sum(loss, meshes.pp) if meshes.pp is not None else loss, meshes.dp_cp)


def _reduced(placement: Placement) -> Placement:
    return Replicate() if placement.is_partial() else placement


def _squared_norm(grads: list[torch.Tensor], accumulate_dtype: torch.dtype | None) -> torch.Tensor:
    """The squared norm of gradients on one mesh (or plain tensors), the same on all its ranks: each
    shard's squares, counted once over the mesh dimensions a gradient is replicated on, summed over
    every dimension's ranks. (DTensor's own reduction fails in torch 2.13 on a mesh FSDP concatenated
    from dimensions out of the root mesh's order: the experts' under expert x tensor parallelism.)"""
    if not isinstance(grads[0], DTensor):
        return (torch.stack(torch._foreach_norm(grads, 2.0, dtype=accumulate_dtype)) ** 2).sum()
    # Partial sums (TP without FSDP leaves replicated weights' gradients so) are summed first.
    grads = [g.redistribute(g.device_mesh, [_reduced(p) for p in g.placements]) for g in grads]
    local = [g.to_local() for g in grads]
    squares = torch._foreach_pow(torch._foreach_norm(local, 2.0, dtype=accumulate_dtype), 2)
    mesh = grads[0].device_mesh
    replicas = [
        math.prod(mesh.size(dim) for dim, p in enumerate(g.placements) if p.is_replicate()) for g in grads
    ]
    # Divided by Python numbers, not a tensor built from them: that would copy to the GPU and wait.
    total = torch.stack(torch._foreach_div(squares, replicas)).sum()
    for dim in range(mesh.ndim):
        dist.all_reduce(total, group=mesh.get_group(dim))
    return total


@torch.no_grad()
def clip_grad_norm_(
    parameters: list[torch.nn.Parameter], max_norm: float, pp_mesh: DeviceMesh | None = None
) -> torch.Tensor:
    """Clip by the norm of the whole model's gradient, whatever its sharding.

    DTensor gradients give the norm over every mesh dimension they are sharded on; the result is a
    plain tensor, identical on all ranks. CPU kernels sum squares sequentially, which loses ~1e-4 in
    fp32 over a large tensor (and differently per shard size), so on CPU the sum runs in float64.
    With `pp_mesh`, each pipeline rank holds the gradients of its stages only: the squared norms
    are summed over it."""
    device = next(p.grad.device for p in parameters if p.grad is not None)
    accumulate_dtype = torch.float64 if device.type == "cpu" else None
    # DTensors on different meshes (experts under expert parallelism) cannot be stacked together:
    # a squared norm per mesh, then their sum.
    by_mesh: dict[DeviceMesh | None, list[torch.nn.Parameter]] = {}
    for p in parameters:
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    total_norm = sum(_squared_norm([p.grad for p in group], accumulate_dtype) for group in by_mesh.values())
    if pp_mesh is not None:
        dist.all_reduce(total_norm, group=pp_mesh.get_group())
    total_norm = total_norm.sqrt()
    if max_norm > 0:
        for mesh_params in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(mesh_params, max_norm, total_norm, foreach=True)
    return total_norm
