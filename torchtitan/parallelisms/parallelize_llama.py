"""Apply the job's parallelism to a Llama model built on the meta device.

Each technique is a plain function; `parallelize_llama` composes them in the order PyTorch needs.
"""

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from torchtitan.config_manager import JobConfig
from torchtitan.parallelisms.parallel_dims import ParallelDims

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parallelize_llama(
    model: nn.Module, world_mesh: DeviceMesh | None, parallel_dims: ParallelDims, job_config: JobConfig
) -> nn.Module:
    if parallel_dims.dp_shard_enabled:
        apply_fsdp(
            model,
            world_mesh[parallel_dims.dp_mesh_name()],
            param_dtype=DTYPES[job_config.training.mixed_precision_param],
            reduce_dtype=DTYPES[job_config.training.mixed_precision_reduce],
        )
    return model


def apply_fsdp(
    model: nn.Module, dp_mesh: DeviceMesh, param_dtype: torch.dtype, reduce_dtype: torch.dtype
) -> None:
    """FSDP2: shard each transformer block, then the root (embeddings, final norm, output).

    The last block is not resharded after forward: backward starts with it, so gathering it again
    right away would be wasted communication (FSDP never reshards the root after forward, for the
    same reason)."""
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    layers = list(model.layers.values())
    for i, block in enumerate(layers):
        fully_shard(block, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=i < len(layers) - 1)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy)
