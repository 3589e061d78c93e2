"""Process-group setup and the few collectives the training loop needs."""

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed(init_timeout_seconds: int) -> tuple[int, int, torch.device]:
    """(world size, rank, device) from torchrun's environment; a process group only if world size > 1.

    NCCL on CUDA, gloo on CPU."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if device_type() == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            timeout=timedelta(seconds=init_timeout_seconds),
            device_id=(device if device.type == "cuda" else None),
        )
    return world_size, rank, device


def set_collective_timeout(seconds: int) -> None:
    """Shorten the timeout once the first step has shown that every rank is up and compiled."""
    if dist.is_initialized():
        for group in [dist.group.WORLD]:
            dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), group)


def dist_mean(x: torch.Tensor, mesh: DeviceMesh | None) -> float:
    """Mean of a scalar over the ranks of `mesh` (host sync: call at logging steps only)."""
    x = x.detach().float()
    if mesh is not None:
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.AVG if x.is_cuda else dist.ReduceOp.SUM, group=mesh.get_group())
        if not x.is_cuda:
            x /= mesh.size()
    return x.item()


@torch.no_grad()
def clip_grad_norm_(parameters: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip by the norm of the whole model's gradient, whatever its sharding.

    DTensor gradients give the norm over every mesh dimension they are sharded on; the result is a
    plain tensor, identical on all ranks. CPU kernels sum squares sequentially, which loses ~1e-4 in
    fp32 over a large tensor (and differently per shard size), so on CPU the sum runs in float64."""
    grads = [p.grad for p in parameters if p.grad is not None]
    accumulate_dtype = torch.float64 if grads[0].device.type == "cpu" else None
    norms = torch._foreach_norm(grads, 2.0, dtype=accumulate_dtype)
    total_norm = torch.linalg.vector_norm(torch.stack(norms))
    if isinstance(total_norm, DTensor):
        total_norm = total_norm.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total_norm, foreach=True)
    return total_norm
