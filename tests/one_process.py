"""The train step of a model on one process, as train.py builds it (its objective, no mesh): for the tests
that drive TrainStep directly."""

import torch
from torch import nn

from torchtitan.config.options import JobConfig, MoEConfig
from torchtitan.objective import Objective
from torchtitan.objective.load_balance import LoadBalance
from torchtitan.parallelisms.parallel_dims import Meshes, ParallelDims
from torchtitan.train_step import TrainStep


def objective_of(job_config: JobConfig, model_args, dims: ParallelDims | None = None, mesh=None) -> Objective:  # noqa: ANN001
    """The job's objective, on one process or on `dims`' world mesh `mesh` (as train.py builds it)."""
    dims = dims or ParallelDims(dp_shard=1, world_size=1)
    meshes = dims.meshes_of(mesh) if mesh is not None else Meshes(None, None, None)
    return Objective(job_config, model_args, dims, meshes, torch.device("cpu"))


def step_of(
    model_parts: list[nn.Module], job_config: JobConfig, dims=None, mesh=None, pipeline=None, objective=None
) -> TrainStep:  # noqa: ANN001
    """TrainStep over `model_parts` (a parallelized model, or pipeline stages with their `objective`)."""
    objective = objective or objective_of(job_config, model_parts[0].model_args, dims, mesh)
    dims = dims or ParallelDims(dp_shard=1, world_size=1)
    cp = dims.meshes_of(mesh).cp if mesh is not None else None
    return TrainStep(model_parts, pipeline, objective, dims, job_config.training, torch.device("cpu"), cp)


def one_process_step(model: nn.Module, job_config: JobConfig) -> TrainStep:
    return step_of([model], job_config)


def load_balance(model: nn.Module, config: MoEConfig, meshes: Meshes | None = None) -> LoadBalance:
    """The balancing of a mixture-of-experts model's layers (the objective's term), on one process or
    over `meshes`."""
    args = model.model_args
    meshes = meshes or Meshes(None, None, None)
    return LoadBalance(config, args.num_experts, args.top_k, meshes).track([model])
