"""The parallel degrees of a job, checked against the world size, and the device mesh they span.

Importing this module does not import torch (the launcher's preflight checks the degrees with it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torchtitan.config.options import ConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass
class Meshes:
    """The device meshes a rank trains on: all ranks, the data-parallel ranks it shares batches with
    (None without data parallelism), its pipeline (None without PP) and its tensor-parallel group
    (None without TP)."""

    world: DeviceMesh | None
    dp: DeviceMesh | None
    pp: DeviceMesh | None
    tp: DeviceMesh | None = None
    # Context parallelism: the ranks that split each sequence (None without CP), and the ranks whose
    # tokens differ, dp x cp, over which losses are averaged (dp without CP).
    cp: DeviceMesh | None = None
    dp_cp: DeviceMesh | None = None

    @property
    def dp_degree_and_rank(self) -> tuple[int, int]:
        return (self.dp.size(), self.dp.get_local_rank()) if self.dp is not None else (1, 0)


@dataclass
class ParallelDims:
    dp_shard: int
    world_size: int
    dp_replicate: int = 1
    tp: int = 1
    pp: int = 1
    enable_loss_parallel: bool = False
    ep: int = 1  # expert-parallel ranks, borrowed from dp_shard
    cp: int = 1  # context-parallel ranks: each splits every sequence of its data-parallel rank

    def __post_init__(self) -> None:
        fixed = {
            "data_parallel_replicate_degree": self.dp_replicate,
            "tensor_parallel_degree": self.tp,
            "pipeline_parallel_degree": self.pp,
            "expert_parallel_degree": self.ep,
            "context_parallel_degree": self.cp,
        }
        for name, degree in fixed.items():
            if degree < 1:
                raise ConfigError(f"parallelism.{name}: must be >= 1, got {degree}")
        others = self.dp_replicate * self.cp * self.tp * self.pp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise ConfigError(
                    f"parallelism: the world size {self.world_size} is not divisible by the product of the "
                    f"other degrees ({others} = data_parallel_replicate_degree {self.dp_replicate} x "
                    f"context_parallel_degree {self.cp} x tensor_parallel_degree {self.tp} x "
                    f"pipeline_parallel_degree {self.pp}); change parallelism.tensor_parallel_degree, "
                    "context_parallel_degree, pipeline_parallel_degree or data_parallel_replicate_degree, or "
                    "the number of processes (NGPU)"
                )
            self.dp_shard = self.world_size // others
        if self.dp_shard < 1:
            raise ConfigError(
                f"parallelism.data_parallel_shard_degree: must be >= 1 or -1, got {self.dp_shard}"
            )
        if self.dp_shard * others != self.world_size:
            raise ConfigError(
                f"parallelism: degrees multiply to {self.dp_shard * others} (data_parallel_replicate_degree "
                f"{self.dp_replicate} x data_parallel_shard_degree {self.dp_shard} x context_parallel_degree "
                f"{self.cp} x tensor_parallel_degree {self.tp} x pipeline_parallel_degree {self.pp}) but the "
                f"world size is {self.world_size}; "
                "set parallelism.data_parallel_shard_degree = -1 or change NGPU"
            )
        if self.dp_shard % self.ep:
            raise ConfigError(
                f"parallelism.expert_parallel_degree: {self.ep} does not divide data_parallel_shard_degree "
                f"{self.dp_shard}, whose ranks it splits the experts over; choose a divisor of it"
            )

    @property
    def dp_enabled(self) -> bool:
        return self.dp_replicate * self.dp_shard > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP shards the weights over dp_shard x cp (context-parallel ranks hold the same weights and
        train on different tokens of the same sequences)."""
        return self.dp_shard_enabled or self.cp_enabled

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def loss_parallel_enabled(self) -> bool:
        return self.tp_enabled and self.enable_loss_parallel

    @property
    def dp_degree(self) -> int:
        return self.dp_replicate * self.dp_shard

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """A mesh with one named dimension per enabled degree (outermost pp, dp_replicate, dp_shard, cp,
        innermost tp), plus flattened ones: "dp" for the data loader, "dp_shard_cp" for FSDP and "dp_cp"
        for averaging losses under context parallelism (`fsdp_dim`, `dp_cp_dim`). With expert
        parallelism dp_shard is two dimensions, "dp_shard_mod_ep" (kept even at size 1: the experts'
        FSDP) and "ep", flattened into "dp_shard"."""
        shard = [("dp_shard_mod_ep", self.dp_shard // self.ep), ("ep", self.ep)]
        dims = [
            (n, d)
            for n, d in (
                ("pp", self.pp),
                ("dp_replicate", self.dp_replicate),
                *(shard if self.ep_enabled else [("dp_shard", self.dp_shard)]),
                ("cp", self.cp),
                ("tp", self.tp),
            )
            if d > 1 or n == "dp_shard_mod_ep"
        ]
        if not dims:
            dims = [("dp_shard", 1)]
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, [d for _, d in dims], mesh_dim_names=[n for n, _ in dims])
        if self.ep_enabled:
            mesh[("dp_shard_mod_ep", "ep")]._flatten("dp_shard")
        dp_names = [n for n, _ in dims if n.startswith("dp_") or n == "ep"]
        if self.dp_replicate_enabled and self.dp_shard_enabled:
            mesh[tuple(dp_names)]._flatten("dp")
        if self.cp_enabled and self.dp_shard_enabled:
            mesh[("dp_shard", "cp")]._flatten("dp_shard_cp")
        if self.cp_enabled and self.dp_enabled:
            mesh[(*dp_names, "cp")]._flatten("dp_cp")
        return mesh

    def fsdp_dim(self) -> str:
        """The mesh dimension FSDP shards over (after dp_replicate with HSDP): dp_shard x cp."""
        if self.cp_enabled:
            return "dp_shard_cp" if self.dp_shard_enabled else "cp"
        return "dp_shard"

    def dp_cp_dim(self) -> str:
        """The mesh dimension of the ranks whose tokens differ: every data-parallel and context-parallel
        rank."""
        if not self.cp_enabled:
            return self.dp_mesh_name()
        return "dp_cp" if self.dp_enabled else "cp"

    def moe_fsdp_meshes(self, world: DeviceMesh) -> tuple[DeviceMesh | None, DeviceMesh | None]:
        """The meshes FSDP shards a mixture-of-experts layer over apart from its block: (the layer's own
        unit, its router and shared expert, and its experts without EP; the experts' unit under EP),
        None where the block's mesh serves. Under TP each rank routes the tokens of its own sequence
        shard, so these weights' gradients are partial sums over the tp ranks: their units span tp as
        well, and FSDP's reduce-scatter adds the partial sums up. The cp ranks hold the same weights and
        route their own tokens of each sequence, as dp_shard's ranks route their own sequences: every
        unit spans cp too (the experts of one ep rank are held by its dp_shard_mod_ep x cp peers)."""
        shard = (
            ("dp_shard_mod_ep", "ep") if self.ep_enabled else ("dp_shard",) if self.dp_shard_enabled else ()
        )
        cp = ("cp",) if self.cp_enabled else ()
        tp = ("tp",) if self.tp_enabled else ()
        layer = self._flat_mesh(world, (*shard, *cp, *tp)) if self.tp_enabled else None
        experts = self._flat_mesh(world, ("dp_shard_mod_ep", *cp, *tp)) if self.ep_enabled else None
        return layer, experts

    def _flat_mesh(self, world: DeviceMesh, dims: tuple[str, ...]) -> DeviceMesh:
        """`dims` as one dimension (flattened once: a second call returns the first one's mesh), after
        dp_replicate with HSDP."""
        name = "_".join(dims).replace("dp_shard_mod_ep_ep", "dp_shard")
        if len(dims) > 1:
            world[dims]._flatten(name)
        return world[("dp_replicate", name)] if self.dp_replicate_enabled else world[name]

    def build_meshes(self, device_type: str) -> Meshes:
        """The world mesh (None on one process) and the dimensions a step communicates over."""
        if self.world_size == 1:
            return Meshes(None, None, None)
        return self.meshes_of(self.build_mesh(device_type))

    def meshes_of(self, world: DeviceMesh) -> Meshes:
        """The dimensions a step communicates over, of the world mesh `world`."""
        return Meshes(
            world,
            world[self.dp_mesh_name()] if self.dp_enabled else None,
            world["pp"] if self.pp_enabled else None,
            world["tp"] if self.tp_enabled else None,
            world["cp"] if self.cp_enabled else None,
            world[self.dp_cp_dim()] if self.dp_enabled or self.cp_enabled else None,
        )

    def dp_mesh_name(self) -> str:
        """The mesh dimension that spans all data-parallel ranks."""
        if self.dp_replicate_enabled and self.dp_shard_enabled:
            return "dp"
        return "dp_replicate" if self.dp_replicate_enabled else "dp_shard"
