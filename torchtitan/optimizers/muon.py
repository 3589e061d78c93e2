"""Muon for the blocks' matrices and AdamW for every other parameter, in one optimizer (one state dict,
one learning-rate schedule), on every layout.

Muon's update of a matrix is its momentum orthogonalised by Newton-Schulz, which needs the whole
matrix while a rank holds a shard (FSDP) or a slice (TP) of it: the matrices laid out alike are
stacked and dealt out whole over the ranks that split them, each rank orthogonalises its share, and
the shards go back, so that the update equals one process's and the work is spread. Each expert of a
3-D expert weight [experts, out, in] is orthogonalised on its own, by the rank that holds it (EP).
Sources: Keller Jordan's Muon, Moonlight ("Muon is Scalable for LLM Training", the RMS-matching scale)
and `torch.optim.Muon`, whose update this one equals on one process."""

import math
from collections.abc import Iterable

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's (Keller Jordan's quintic)
NS_EPS = 1e-7


def is_muon_parameter(name: str, param: nn.Parameter) -> bool:
    """The matrices inside the blocks: attention and feed-forward projections, expert weights. The
    router, norms, embeddings and output layer stay with AdamW."""
    return name.startswith("layers.") and param.ndim >= 2 and ".router." not in name


def newton_schulz(matrices: Tensor, steps: int, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """The orthogonalised matrix (or each of a batch of them), in `dtype`; in bfloat16 as
    torch.optim.Muon's."""
    a, b, c = NS_COEFFICIENTS
    x = matrices.to(dtype).reshape(-1, *matrices.shape[-2:])  # a batch, even of one
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=NS_EPS)
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x.mT if tall else x).reshape(matrices.shape)


def scaled_lr(lr: float, scale: str, shape: torch.Size) -> float:
    """torch.optim.Muon's adjust_lr_fn on one matrix (rows, columns): "original" (Keller Jordan's) or
    "match_rms_adamw" (Moonlight's: the update's RMS matches AdamW's, so AdamW's rates carry over)."""
    rows, columns = shape[-2:]
    if scale == "original":
        return lr * math.sqrt(max(1.0, rows / columns))
    return lr * 0.2 * math.sqrt(max(rows, columns))


def orthogonalised(update: Tensor, steps: int, dtype: torch.dtype) -> Tensor:
    """Newton-Schulz of each whole matrix of the parameter, returned with `update`'s layout (a DTensor's
    shards). An expert's matrix is whole wherever only the experts are split (dimension 0 of a 3-D
    weight: EP, FSDP): those splits stay and each rank orthogonalises the experts it holds; the other
    splits are gathered, and each rank orthogonalises the whole matrix and keeps its shard."""
    if not isinstance(update, DTensor):
        return newton_schulz(update, steps, dtype)
    mesh, placements = update.device_mesh, update.placements
    kept = [p if update.ndim == 3 and p.is_shard(0) else Replicate() for p in placements]
    local = newton_schulz(update.redistribute(mesh, kept).to_local(), steps, dtype)
    whole = DTensor.from_local(local, mesh, kept, run_check=False, shape=update.shape, stride=update.stride())
    return whole.redistribute(mesh, placements)


def dealt_placements(update: Tensor) -> list[Placement] | None:
    """Where a stack of matrices laid out as `update` (a dense matrix's DTensor, split by plain Shard
    placements) is dealt out whole: over the first mesh dimension that splits it (FSDP's, else TP's),
    replicated over the others. None: orthogonalised on its own."""
    if not isinstance(update, DTensor) or update.ndim != 2:
        return None
    mesh, placements = update.device_mesh, update.placements
    if any(type(p) not in (Shard, Replicate) for p in placements):  # _StridedShard: FSDP over TP's columns
        return None
    split = [i for i, p in enumerate(placements) if isinstance(p, Shard) and mesh.size(i) > 1]
    if not split:
        return None
    dealt: list[Placement] = [Replicate()] * mesh.ndim
    dealt[split[0]] = Shard(0)
    return dealt


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = [1]
    for size in reversed(shape[1:]):
        strides.insert(0, strides[0] * size)
    return tuple(strides)


def orthogonalised_all(updates: list[Tensor], steps: int, dtype: torch.dtype) -> list[Tensor]:
    """`orthogonalised` of each update, the work spread over the ranks: dense matrices laid out alike
    (every layer's wq, ...) are stacked, and an all-to-all gives each rank some of them whole (the stack
    dealt over the mesh dimension that splits them); each rank orthogonalises its share and an
    all-to-all sends the shards back. Each matrix is orthogonalised once per replica, not on every
    rank, and the values are those of one process."""
    results: list[Tensor | None] = [None] * len(updates)
    stacks: dict[tuple, list[int]] = {}
    for i, update in enumerate(updates):
        dealt = dealt_placements(update)
        if dealt is None:
            results[i] = orthogonalised(update, steps, dtype)
        else:
            key = (update.device_mesh, tuple(update.placements), tuple(update.shape), tuple(dealt))
            stacks.setdefault(key, []).append(i)
    for (mesh, placements, shape, dealt), members in stacks.items():
        stacked_placements = [Shard(p.dim + 1) if isinstance(p, Shard) else p for p in placements]
        size = (len(members), *shape)
        local = torch.stack([updates[i].to_local() for i in members])
        stack = DTensor.from_local(
            local, mesh, stacked_placements, run_check=False, shape=size, stride=_contiguous(size)
        )
        share = newton_schulz(stack.redistribute(mesh, dealt).to_local(), steps, dtype)
        done = DTensor.from_local(share, mesh, dealt, run_check=False, shape=size, stride=_contiguous(size))
        shards = done.redistribute(mesh, stacked_placements).to_local()
        for shard, i in zip(shards, members):
            results[i] = DTensor.from_local(
                shard, mesh, placements, run_check=False, shape=updates[i].shape, stride=updates[i].stride()
            )
    return results


class Muon(torch.optim.AdamW):
    """Param groups with `muon` True take Muon's step, the others torch's AdamW's (its options, kernels
    and state: step, exp_avg, exp_avg_sq)."""

    def __init__(
        self,
        muon_params: Iterable[Tensor],
        adamw_params: Iterable[Tensor],
        *,
        muon_lr: float,
        momentum: float,
        nesterov: bool,
        muon_weight_decay: float,
        scale: str,
        ns_steps: int,
        ns_dtype: torch.dtype,
        **adamw: object,
    ) -> None:
        muon_group = {"params": list(muon_params), "muon": True, "lr": muon_lr}
        muon_group["weight_decay"] = muon_weight_decay
        muon_group |= {"momentum": momentum, "nesterov": nesterov, "scale": scale, "ns_steps": ns_steps}
        muon_group["ns_dtype"] = ns_dtype
        super().__init__([muon_group, {"params": list(adamw_params), "muon": False}], **adamw)

    def __setstate__(self, state: dict) -> None:
        """Optimizer's own (load_state_dict): Adam's reads a "step" of every parameter's state, which
        the Muon group's parameters do not have; the groups already hold every AdamW option."""
        torch.optim.Optimizer.__setstate__(self, state)

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        groups = self.param_groups
        try:
            self.param_groups = [group for group in groups if not group["muon"]]
            super().step()
        finally:
            self.param_groups = groups
        for group in groups:
            if group["muon"]:
                self._muon_step(group)

    def _muon_step(self, group: dict) -> None:
        lr, momentum = group["lr"], group["momentum"]
        params = [param for param in group["params"] if param.grad is not None]
        updates = []
        for param in params:
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(param.grad)
            buffer = state["momentum_buffer"]
            buffer.lerp_(param.grad, 1 - momentum)
            updates.append(param.grad.lerp(buffer, momentum) if group["nesterov"] else buffer)
        for param, update in zip(params, orthogonalised_all(updates, group["ns_steps"], group["ns_dtype"])):
            param.mul_(1 - lr * group["weight_decay"])
            param.add_(update, alpha=-scaled_lr(lr, group["scale"], param.shape))
