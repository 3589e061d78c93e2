"""The z-loss (`training.z_loss_weight`; PaLM, arXiv:2204.02311 §5): weight x the mean over the targets of
log(Z)^2, Z = sum over the vocabulary of exp(logit), the softmax's normaliser. It pulls log(Z) towards 0,
which keeps the logits from drifting far from normalised (PaLM: 1e-4), for the stability of long runs.

Normalised as every term (objective.py): the sum over the micro-batch's targets divided by the step's
count of them over the global batch, so the same on every layout. It needs the logits whole: not with
the chunked loss (training.loss_chunk_tokens) nor with tensor parallelism's vocabulary shards."""

from typing import Any

import torch
from torch import nn

from torchtitan.config.options import ConfigError, JobConfig
from torchtitan.datasets.layout import IGNORE_INDEX
from torchtitan.parallelisms.distributed import dist_sum


class ZLoss:
    """The objective's term (objective.py's Term) for `training.z_loss_weight`; logs `z_loss`, the
    step's mean over its targets (unweighted)."""

    def __init__(self, weight: float, objective: Any) -> None:
        self.weight, self.objective = weight, objective
        self.sum = torch.zeros((), device=objective.device)  # the step's so far

    @classmethod
    def build(cls, job_config: JobConfig, model_args: Any, objective: Any) -> "ZLoss | None":
        weight = job_config.training.z_loss_weight
        if not weight:
            return None
        if job_config.training.loss_chunk_tokens:
            raise ConfigError(
                "training.z_loss_weight: the z-loss needs the whole logits, which training.loss_chunk_tokens "
                "never makes; set one of them to 0"
            )
        if job_config.parallelism.tensor_parallel_degree > 1:
            raise ConfigError(
                "training.z_loss_weight: the z-loss does not run on tensor parallelism's vocabulary-sharded "
                "logits; set it to 0 or parallelism.tensor_parallel_degree to 1"
            )
        return cls(weight, objective)

    def __call__(
        self, part: nn.Module, outputs: tuple[torch.Tensor, ...], labels: torch.Tensor, router_stats: tuple
    ) -> torch.Tensor:
        targets = labels[..., 0] != IGNORE_INDEX
        log_z = torch.logsumexp(outputs[0], dim=-1)
        z_loss = (log_z.square() * targets).sum() / self.objective.denominators[0]
        self.sum = self.sum + z_loss.detach() / self.objective.scale
        return self.weight * z_loss

    def step_done(self) -> dict[str, torch.Tensor]:
        total, self.sum = self.sum, torch.zeros_like(self.sum)
        for mesh in (self.objective.meshes.dp_cp, self.objective.meshes.pp):
            if mesh is not None:
                total = dist_sum(total, mesh)
        return {"z_loss": total}
