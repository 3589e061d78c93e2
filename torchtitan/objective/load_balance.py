"""Expert load balancing for mixture-of-experts models (torchtitan/models/moe.py), each optional:

- `moe.aux_loss_weight`: the auxiliary loss of transformers' Qwen3-MoE, num_experts * sum_e f_e * P_e,
  where f_e is the share of (token, choice) assignments that went to expert e and P_e its mean router
  probability, both pooled over the sparse layers and the tokens of a micro-batch. f_e (no gradient) is
  counted over the micro-batch of every data-parallel, context-parallel and tensor-parallel rank, and
  the mean of the ranks' P_e is the global one, so the loss of a micro-batch is the same whatever the
  layout (a cp rank routes its pieces of each sequence as a dp rank its sequences: both are ranks
  whose tokens differ, over which FSDP averages the gradients).
- `moe.sequence_aux_loss_weight`: DeepSeek-V3's sequence-wise balance loss (`sequence_balance`, below),
  per sparse layer and sequence (a row of the micro-batch); a micro-batch's is the sum over the layers
  of its mean over the sequences. A sequence's counts are summed over the tensor- and context-parallel
  ranks that hold its tokens; each rank's loss is its tokens' share.
- `moe.bias_update_rate`: DeepSeek-V3's auxiliary-loss-free balancing. After each optimizer step every
  expert's routing bias moves by rate * sign(mean load - its load), from the tokens all data-parallel
  (context-parallel and tensor-parallel) ranks sent it during the step: the same bias on every rank.
"""

import torch
import torch.distributed as dist
from torch import nn

from torchtitan.config.options import MoEConfig
from torchtitan.models.moe import MoE
from torchtitan.parallelisms.parallel_dims import Meshes


class LoadBalance:
    """What balances a mixture of experts' layers (`track`: this rank's model parts'): its losses,
    weighted, for the objective (objective.py), and the routing biases. Meshes: `dp_cp` the ranks whose
    tokens differ (data-parallel x context-parallel), `pp` the pipeline, `tp` the tensor-parallel ranks,
    each routing its own sequence shard of the batch (torchtitan/models/llama/tp_plan.py), `cp` the
    context-parallel ranks, each routing its own pieces of every sequence (a sequence's counts for the
    sequence-wise loss)."""

    def __init__(self, config: MoEConfig, num_experts: int, top_k: int, meshes: Meshes) -> None:
        dp, tp, cp = meshes.dp_cp, meshes.tp, meshes.cp
        self.layers: list[MoE] = []
        # The same on every rank: a pipeline stage of dense layers only still joins the collectives.
        self.aux_loss_weight = config.aux_loss_weight
        self.sequence_aux_loss_weight = config.sequence_aux_loss_weight
        self.num_experts, self.top_k = num_experts, top_k
        self.bias_update_rate = config.bias_update_rate
        self.pp = meshes.pp
        self.dp_degree = dp.size() if dp is not None else 1
        self.tp_degree = tp.size() if tp is not None else 1
        # The ranks among which each global batch's tokens are routed.
        self.token_groups = [mesh.get_group() for mesh in (dp, tp) if mesh is not None]
        self.aux_losses: list[torch.Tensor] = []  # this step's, one per micro-batch
        # The ranks that hold one sequence's tokens, and the factor that makes a context-parallel rank's
        # share of a loss its gradient's: FSDP averages over the cp ranks (as their language-model
        # losses are each a mean over their own tokens) where it sums over the tp ranks.
        self.sequence_groups = [mesh.get_group() for mesh in (tp, cp) if mesh is not None]
        self.dp_group = dp.get_group() if dp is not None else None
        self.cp_degree = cp.size() if cp is not None else 1
        # This step's sequence-wise losses (this rank's shares) summed over layers and micro-batches,
        # and how many (layer, micro-batch) pairs they are.
        self.sequence_losses = [torch.zeros(()), 0]

    def track(self, model_parts: list[nn.Module]) -> "LoadBalance":
        """Balance the mixture-of-experts layers of `model_parts` (this rank's): they keep the statistics
        the losses need from each training forward."""
        self.layers = [m for part in model_parts for m in part.modules() if isinstance(m, MoE)]
        for layer in self.layers:
            layer.keep_router_stats = self.aux_loss_weight > 0
            layer.keep_sequence_stats = self.sequence_aux_loss_weight > 0
        return self

    @property
    def router_stats_travel(self) -> tuple[bool, bool]:
        """What a pipeline's stages pass on beside the activations (parallelisms/pipeline.py's
        RouterStatsStage): the pooled loss's statistics, the sequence-wise losses so far."""
        return self.aux_loss_weight > 0, self.sequence_aux_loss_weight > 0

    def weighted_losses(self, router_stats: tuple[torch.Tensor, ...] = ()) -> torch.Tensor | None:
        """A micro-batch's weighted balance losses (None when off): from this rank's layers, or from what
        a pipeline's stages passed on (`router_stats`: the pooled loss's statistics, then the sum of the
        stages' sequence-wise losses)."""
        losses = []
        if self.aux_loss_weight:
            if router_stats:
                counts, prob_sums, *router_stats = router_stats
                losses.append(self.aux_loss_weight * self.pooled_aux_loss(counts, prob_sums))
            else:
                losses.append(self.aux_loss_weight * self.aux_loss())
        if self.sequence_aux_loss_weight:
            sequence = router_stats[0].sum() if router_stats else self.sequence_aux_loss()
            losses.append(self.sequence_aux_loss_weight * sequence)
        return sum(losses[1:], losses[0]) if losses else None

    def _sum_over_tokens(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks that route the global batch's tokens."""
        for group in self.token_groups:
            dist.all_reduce(tensor, group=group)
        return tensor

    def aux_loss(self) -> torch.Tensor:
        """The auxiliary loss of the training forward just run through this rank's layers."""
        counts = torch.stack([m.router_stats[0] for m in self.layers]).sum(0)
        prob_sums = torch.stack([m.router_stats[1] for m in self.layers]).sum(0)
        for layer in self.layers:
            layer.router_stats = None  # the loss holds their graph now
        return self.pooled_aux_loss(counts, prob_sums)

    def pooled_aux_loss(self, counts: torch.Tensor, prob_sums: torch.Tensor) -> torch.Tensor:
        """The auxiliary loss of a micro-batch from its (token, choice) counts and router probability
        sums per expert, pooled over the sparse layers (with the router's gradient); a pipeline's last
        stage gets them from every stage. Under TP, this rank's share of its data-parallel rank's loss:
        the tp ranks' router gradients are summed."""
        rows = counts.sum() / self.top_k  # sparse layers x this rank's tokens
        shares = self._sum_over_tokens(counts.float()) / (rows * self.dp_degree * self.tp_degree)
        loss = self.num_experts * (shares * prob_sums / (rows * self.tp_degree)).sum()
        self.aux_losses.append(loss.detach())
        return loss

    def sequence_aux_loss(self, layers: list[MoE] | None = None) -> torch.Tensor:
        """The sequence-wise balance loss (without its weight) of the training forward just run through
        `layers` (default: all of this rank's): per layer, the mean over the micro-batch's sequences;
        summed over the layers. A pipeline stage takes its own layers' (the loss is a sum over layers).
        With TP or CP, this rank's share: summed over the tp ranks and averaged over the cp ranks (as
        FSDP reduces their gradients), the shares make the loss."""
        stats = [m.sequence_stats for m in (self.layers if layers is None else layers)]
        for layer in self.layers if layers is None else layers:
            layer.sequence_stats = None  # the loss holds their graph now
        stats = [s for s in stats if s is not None]  # None: no training forward (shape inference)
        if not stats:
            return torch.zeros(())
        counts = torch.stack([counts for counts, _ in stats])  # (layers, sequences, experts)
        for group in self.sequence_groups:
            dist.all_reduce(counts, group=group)
        losses = sequence_balance(counts, torch.stack([sums for _, sums in stats]), self.top_k).mean(-1)
        self.sequence_losses[0] = self.sequence_losses[0].to(losses.device) + losses.detach().sum()
        self.sequence_losses[1] += len(stats)
        return self.cp_degree * losses.sum()

    def __call__(
        self, part: nn.Module, outputs: tuple[torch.Tensor, ...], labels: torch.Tensor, router_stats: tuple
    ) -> torch.Tensor | None:
        """The objective's term (objective.py's Term): the micro-batch's weighted balance losses."""
        return self.weighted_losses(router_stats)

    @torch.no_grad()
    def step_done(self) -> dict[str, torch.Tensor]:
        """After the optimizer step: move the biases; this step's metrics, the same on every rank: the
        expert load (max / mean tokens per expert, averaged over the sparse layers) and the mean auxiliary
        loss of its micro-batches when it is on."""
        if not self.layers:  # a pipeline stage of dense layers only
            counts = torch.zeros(0, 1, device=self.pp.device_type if self.pp else "cpu")
        else:
            counts = self._sum_over_tokens(torch.stack([m.tokens_per_expert for m in self.layers]))
        if self.bias_update_rate:
            for layer, load in zip(self.layers, counts):
                layer.expert_bias += self.bias_update_rate * torch.sign(load.mean() - load)
        for layer in self.layers:
            layer.tokens_per_expert.zero_()
        # Pipeline stages hold different layers: the load ratio is averaged over all of them.
        ratios = counts.max(-1).values / counts.mean(-1)
        # torch.full launches a kernel; torch.tensor(..., device=cuda) would copy and wait for the GPU.
        load = torch.stack([ratios.sum(), torch.full((), float(len(ratios)), device=ratios.device)])
        if self.pp is not None:
            dist.all_reduce(load, group=self.pp.get_group())
        metrics = {"expert_load": load[0] / load[1]}
        if self.aux_loss_weight:
            # Pipelines: the last stage computes it, the others add nothing.
            aux_loss = torch.stack(self.aux_losses).mean() if self.aux_losses else torch.zeros(())
            aux_loss = self._sum_over_tokens(aux_loss.to(counts.device)) / self.dp_degree
            if self.pp is not None:
                dist.all_reduce(aux_loss, group=self.pp.get_group())
            metrics["aux_loss"] = aux_loss
        self.aux_losses = []
        if self.sequence_aux_loss_weight:
            metrics["seq_aux_loss"] = self._sequence_metric(counts.device)
        return metrics

    def _sequence_metric(self, device: torch.device) -> torch.Tensor:
        """The step's sequence-wise balance loss (without its weight), the mean over the sparse layers,
        the micro-batches and the global batch's sequences: 1.0 when every sequence spreads its tokens
        evenly over the experts. The same on every rank."""
        total, pairs = self.sequence_losses
        total = total.to(device)
        for group in self.sequence_groups:  # the tp and cp ranks' shares of the sequences' losses
            dist.all_reduce(total, group=group)
        if self.dp_group is not None:
            dist.all_reduce(total, group=self.dp_group)
        total = total / self.dp_degree
        summed = torch.stack([total, torch.full((), float(pairs), device=device)])
        if self.pp is not None:  # each stage holds its own layers'
            dist.all_reduce(summed, group=self.pp.get_group())
        self.sequence_losses = [torch.zeros((), device=device), 0]
        return summed[0] / summed[1].clamp(min=1)


def sequence_balance(counts: torch.Tensor, score_sums: torch.Tensor, top_k: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss (eqs. 17-20, without alpha) of each sequence, from its
    (token, choice) counts per expert, (..., experts), over all of the sequence's tokens, and the sums of
    its tokens' normalised scores s'_{t,e} per expert, over all of them or over a share (this rank's
    tokens): with T = sum_e counts_e / K tokens, f_e = E counts_e / (K T) (no gradient) and
    P_e = score_sums_e / T, sum_e f_e P_e, (...); on a share of the tokens, that share of it: the
    shares of a sequence's tokens add up to its loss, and their gradients to its gradient."""
    tokens = counts.sum(-1, keepdim=True) / top_k
    f = counts.shape[-1] * counts / (top_k * tokens)
    return (f * score_sums / tokens).sum(-1)
