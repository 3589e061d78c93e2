"""The train step of a model on one process, as train.py builds it (its objective, no mesh): for the tests
that drive TrainStep directly."""

import torch
from torch import nn

from torchtitan.config.options import JobConfig, MoEConfig
from torchtitan.objective import Objective
from torchtitan.objective.load_balance import LoadBalance
from torchtitan.parallelisms.parallel_dims import Meshes, ParallelDims
from torchtitan.train_step import TrainStep


def one_process_step(model: nn.Module, job_config: JobConfig, device: str = "cpu") -> TrainStep:
    dims = ParallelDims(dp_shard=1, world_size=1)
    objective = Objective(job_config, model.model_args, dims, Meshes(None, None, None), torch.device(device))
    return TrainStep([model], None, objective, dims, job_config.training, torch.device(device))


def load_balance(model: nn.Module, config: MoEConfig, meshes: Meshes | None = None) -> LoadBalance:
    """The balancing of a mixture-of-experts model's layers (the objective's term), on one process or
    over `meshes`."""
    args = model.model_args
    meshes = meshes or Meshes(None, None, None)
    return LoadBalance(config, args.num_experts, args.top_k, meshes).track([model])
