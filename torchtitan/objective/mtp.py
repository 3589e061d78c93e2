"""Multi-token prediction's objective (DeepSeek-V3 paper §2.2, eq. 25; the depths themselves are
torchtitan/models/mtp.py): each depth's targets, shifted on the host, and its loss.

Depth k's loss L_k is its cross entropy summed over its targets divided by the step's count of them
(objective.py's normalisation); the MTP loss is `model.mtp_loss_weight` / D x the sum over the depths.
A target that is not in the token's own document, or lies beyond the window, is IGNORE_INDEX (the
model's docstring says why).
"""

import torch

from torchtitan.datasets.layout import IGNORE_INDEX
from torchtitan.parallelisms.distributed import dist_sum
from torchtitan.parallelisms.parallel_dims import Meshes


def mtp_targets(
    tokens: torch.Tensor, labels: torch.Tensor, document_ids: torch.Tensor | None, depths: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(bs, seqlen, depths) input tokens and targets of the MTP depths for a (bs, seqlen) batch whose
    `labels` are the next tokens (label i = token i+1; IGNORE_INDEX where untrained, e.g. chat prompts):
    depth k (index k-1) at position i takes token i+k and targets label i+k (token i+k+1), kept only when
    i+k+1 is inside the window and in the same document as i (`document_ids`: block_causal's; None: the
    window is one document). Elsewhere the input token is 0 and the target IGNORE_INDEX."""
    bs, seqlen = tokens.shape
    ids = document_ids if document_ids is not None else torch.zeros_like(tokens)
    inputs = torch.zeros(bs, seqlen, depths, dtype=tokens.dtype, device=tokens.device)
    targets = torch.full((bs, seqlen, depths), IGNORE_INDEX, dtype=labels.dtype, device=labels.device)
    for k in range(1, depths + 1):
        span = seqlen - k - 1  # positions whose token i+k+1 is inside the window
        if span <= 0:
            continue
        same = ids[:, :span] == ids[:, k + 1 : k + 1 + span]
        inputs[:, :span, k - 1] = torch.where(same, tokens[:, k : k + span], 0)
        targets[:, :span, k - 1] = torch.where(same, labels[:, k : k + span], IGNORE_INDEX)
    return inputs, targets


class MTPLoss:
    """The weighted MTP loss of a micro-batch from its depths' losses, and their means over the step
    (`mtp_loss_k`), logged."""

    def __init__(self, depths: int, weight: float, device: torch.device) -> None:
        self.depths, self.weight = depths, weight
        self.sums = torch.zeros(depths, device=device)  # each depth's loss of the step so far

    def weighted(self, depth_losses: list[torch.Tensor], scale: int) -> torch.Tensor:
        """lambda / D x the sum of the depths' losses (each normalised by the objective, which averages
        them over `scale` micro-batches and ranks); counts them for the step's metrics."""
        losses = torch.stack(depth_losses)
        self.sums += losses.detach() / scale
        return self.weight / self.depths * losses.sum()

    def step_metrics(self, meshes: Meshes) -> dict[str, torch.Tensor]:
        """The step's loss per depth, the mean over the global batch's targets (summed over the ranks
        whose tokens differ, and the pipeline, whose last stage holds it); restarts the count."""
        sums, self.sums = self.sums, torch.zeros_like(self.sums)
        for mesh in (meshes.dp_cp, meshes.pp):
            if mesh is not None:
                sums = dist_sum(sums, mesh)
        return {f"mtp_loss_{depth + 1}": value for depth, value in enumerate(sums)}
