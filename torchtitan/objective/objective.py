"""The training objective: the language model's cross entropy and the terms added to it (TERMS), built
once per job and handed to the train step, the pipeline's last stage and the validator, which score a
micro-batch through the same `Objective.loss`.

One normalisation. A cross-entropy term is the sum over its targets (labels that are not IGNORE_INDEX)
divided by the step's count of them over the global batch, N: counted once on the host, over the step's
micro-batches and the data-parallel ranks, before context parallelism shares the rows' tokens out (a
row's cp ranks count it once). A micro-batch's term divides its sum (a cp rank's: its tokens' share) by
N / scale, scale = micro-batches x dp ranks x cp ranks x pipeline micro-batches: the gradients'
accumulation, FSDP's average over dp x cp and the schedule's division by its micro-batches turn that
into the sum over the step's targets divided by N, whatever the layout. Packed text has a target at
every position, so its loss is the mean over the step's tokens. Validation sums over the targets of
every batch and divides by their count (`summing`, `mean_over_ranks`). The balance losses
(load_balance.py) are per micro-batch, as their papers define them, averaged over the micro-batches
alike. docs/objectives.md has every term's formula.
"""

import contextlib
import math
from collections.abc import Iterator
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan.config.options import JobConfig
from torchtitan.config_rules import gradient_accumulation_steps
from torchtitan.datasets.layout import IGNORE_INDEX
from torchtitan.objective.chunked_cross_entropy import chunked_cross_entropy
from torchtitan.objective.load_balance import LoadBalance
from torchtitan.objective.mtp import MTPLoss, mtp_targets
from torchtitan.objective.z_loss import ZLoss
from torchtitan.parallelisms.distributed import dist_sum
from torchtitan.parallelisms.parallel_dims import Meshes, ParallelDims
from torchtitan.parallelisms.parallelize import autocast_context
from torchtitan.parallelisms.pipeline_layout import num_microbatches, stage_layers


class Term(Protocol):
    """A loss term added to the language model's (TERMS builds each from the job)."""

    def __call__(
        self, part: nn.Module, outputs: tuple[torch.Tensor, ...], labels: torch.Tensor, router_stats: tuple
    ) -> torch.Tensor | None:
        """The weighted term of a training micro-batch (None: nothing this micro-batch): `outputs` the
        model's (or last stage's) outputs, `labels` (bs, seqlen, 1 + MTP depths), `router_stats` what a
        pipeline's stages passed on (empty without a pipeline)."""

    def step_done(self) -> dict[str, torch.Tensor]:
        """After the optimizer step: the step's metrics, the same on every rank."""


def _local(loss: torch.Tensor) -> torch.Tensor:
    """Under loss parallel a loss is a replicated DTensor; the terms added to it are this rank's."""
    return loss.to_local() if isinstance(loss, DTensor) else loss


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The cross entropy of (bs, seqlen, vocab) logits summed over the (bs, seqlen) labels' targets."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")


class Objective:
    """What a step minimises and logs (module docstring). `begin_step` counts a step's targets before its
    micro-batches run; `loss` scores one; `step_done` gives the step's metrics."""

    def __init__(
        self,
        job_config: JobConfig,
        model_args: Any,
        parallel_dims: ParallelDims,
        meshes: Meshes,
        device: torch.device,
    ) -> None:
        training = job_config.training
        self.meshes, self.device = meshes, device
        self.mtp_depths = getattr(model_args, "mtp_layers", 0)
        self.chat = job_config.chat.enable
        self.autocast = autocast_context(training, device)
        # The micro-batches and ranks whose mean the gradients take (module docstring).
        self.pipeline_microbatches = 1
        if parallel_dims.pp_enabled:
            stages = len(stage_layers(job_config, model_args.n_layers))
            self.pipeline_microbatches = num_microbatches(job_config, stages)
        self.ranks = math.prod(m.size() for m in (meshes.dp, meshes.cp) if m is not None)
        # The step's micro-batches and ranks, whose mean the gradients take (set by begin_step).
        self.scale = (
            gradient_accumulation_steps(training, parallel_dims) * self.ranks * self.pipeline_microbatches
        )
        self.counts: torch.Tensor | None = None  # the step's targets (1 + depths), over the global batch
        self.denominators: torch.Tensor | None = None
        # Compiled, the loss fuses the log-softmax and its backward over the (large) logits: +3% tokens/s
        # and -4 GiB on a 1B model (docs/performance.md). Under TP the loss scores vocabulary shards
        # (DTensors, collectives): left uncompiled.
        backend = training.compile_backend
        compile_loss = training.compile and not parallel_dims.loss_parallel_enabled
        self.cross_entropy = (
            torch.compile(cross_entropy_sum, backend=backend) if compile_loss else cross_entropy_sum
        )
        # The output projection and the loss a chunk of tokens at a time: no whole logits.
        self.chunk_tokens = training.loss_chunk_tokens
        compile_chunked = training.compile and not parallel_dims.tp_enabled
        chunked = chunked_cross_entropy
        self.chunked = torch.compile(chunked, backend=backend) if compile_chunked else chunked
        self.terms: list[Term] = [
            t for build in TERMS if (t := build(job_config, model_args, self)) is not None
        ]

    @property
    def balance(self) -> LoadBalance | None:
        return next((term for term in self.terms if isinstance(term, LoadBalance)), None)

    def track(self, model_parts: list[nn.Module]) -> None:
        """The model parts this rank trains (a mixture of experts' layers keep their statistics)."""
        if self.balance is not None:
            self.balance.track(model_parts)

    def router_stats_travel(self) -> tuple[bool, bool]:
        """What a pipeline's stages pass on beside the activations for the balance losses."""
        return self.balance.router_stats_travel if self.balance is not None else (False, False)

    def sequence_loss(self, layers: list[nn.Module]) -> torch.Tensor:
        """A pipeline stage's sequence-wise balance loss (unweighted), which it passes on."""
        return self.balance.sequence_aux_loss(layers)

    def targets(
        self, inputs: torch.Tensor, labels: torch.Tensor, document_ids: torch.Tensor | None, mtp: bool = True
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """A host batch's targets, (bs, seqlen, 1 + MTP depths): the next tokens', then (with `mtp`) each
        depth's, shifted on whole sequences (a context-parallel rank's last tokens need the next one's
        first); and the model's keyword arguments they come with (the depths' input tokens)."""
        if not (self.mtp_depths and mtp):
            return labels.unsqueeze(-1), {}
        mtp_tokens, mtp_labels = mtp_targets(inputs, labels, document_ids, self.mtp_depths)
        return torch.cat([labels.unsqueeze(-1), mtp_labels], dim=-1), {"mtp_tokens": mtp_tokens}

    @staticmethod
    def count(labels: torch.Tensor) -> torch.Tensor:
        """The targets of host labels (bs, seqlen, columns), per column."""
        return (labels != IGNORE_INDEX).sum((0, 1))

    def begin_step(self, step_labels: list[torch.Tensor]) -> None:
        """Count the step's targets: `step_labels`, this rank's micro-batches' (host, whole rows)."""
        counts = sum(self.count(labels) for labels in step_labels)
        counts = counts.to(device=self.device, dtype=torch.float32)
        if self.meshes.dp is not None:
            counts = dist_sum(counts, self.meshes.dp)
        self.counts = counts
        self.scale = len(step_labels) * self.ranks * self.pipeline_microbatches
        self.denominators = counts.clamp(min=1) / self.scale

    @contextlib.contextmanager
    def summing(self) -> Iterator[None]:
        """Scores are sums over the targets (a pipeline's, over its schedule's micro-batches: the train
        step takes their mean), for evaluation; the step's denominators are restored after."""
        saved = self.denominators
        columns = 1 + self.mtp_depths
        self.denominators = torch.full((columns,), 1 / self.pipeline_microbatches, device=self.device)
        try:
            yield
        finally:
            self.denominators = saved

    def cross_entropy_term(
        self, part: nn.Module, output: torch.Tensor, labels: torch.Tensor, column: int
    ) -> torch.Tensor:
        """Column `column`'s cross entropy (0: the next token's; k: MTP depth k's) of a micro-batch,
        normalised: `output` the logits, or with the chunked loss the normed hidden states, which it
        projects by `part`'s output weight under autocast."""
        if self.chunk_tokens:
            with self.autocast:
                total = self.chunked(output, part.output.weight, labels[..., column], self.chunk_tokens)
        else:
            total = self.cross_entropy(output, labels[..., column])
        return total / self.denominators[column]

    def loss(
        self,
        part: nn.Module,
        output: torch.Tensor | tuple[torch.Tensor, ...],
        labels: torch.Tensor,
        router_stats: tuple = (),
        training: bool = True,
    ) -> torch.Tensor:
        """A micro-batch's loss: the language model's value (logged), with the gradient of the whole
        objective when `training` (every term's weighted loss added). `output`: the model's (or last
        pipeline stage's), or each one's with MTP (the main one first); `labels` as `targets` gives."""
        outputs = output if isinstance(output, tuple) else (output,)
        loss = self.cross_entropy_term(part, outputs[0], labels, 0)
        if not training:
            return loss
        added = [t for term in self.terms if (t := term(part, outputs, labels, router_stats)) is not None]
        if not added:
            return loss
        extra = sum(added[1:], added[0])
        # The value stays the language model's loss; the gradient gains the terms'.
        return _local(loss) + (extra - extra.detach())

    def step_done(self) -> dict[str, torch.Tensor]:
        """After the optimizer step: each term's metrics (a mixture of experts' routing biases move)."""
        return {name: value for term in self.terms for name, value in term.step_done().items()}

    @property
    def trained_tokens(self) -> torch.Tensor | None:
        """Chat data's tokens with a target in the last step's global batch (None for packed text)."""
        return self.counts[0] if self.chat and self.counts is not None else None

    def mean_over_ranks(self, total: torch.Tensor, targets: torch.Tensor) -> float:
        """An evaluation's mean loss from a rank's summed loss (a cp rank's share; 0 on pipeline ranks
        without the last stage) and its count of targets (whole rows)."""
        for mesh in (self.meshes.pp, self.meshes.dp_cp):
            if mesh is not None:
                total = dist_sum(total, mesh)
        if self.meshes.dp is not None:
            targets = dist_sum(targets, self.meshes.dp)
        return total.item() / max(targets.item(), 1)


class MTPTerm:
    """Multi-token prediction's weighted loss (mtp.py), on the depths' outputs."""

    def __init__(self, objective: Objective, depths: int, weight: float, device: torch.device) -> None:
        self.objective = objective
        self.mtp = MTPLoss(depths, weight, device)

    @classmethod
    def build(cls, job_config: JobConfig, model_args: Any, objective: Objective) -> "MTPTerm | None":
        depths = getattr(model_args, "mtp_layers", 0)
        return cls(objective, depths, job_config.model.mtp_loss_weight, objective.device) if depths else None

    def __call__(
        self, part: nn.Module, outputs: tuple[torch.Tensor, ...], labels: torch.Tensor, router_stats: tuple
    ) -> torch.Tensor | None:
        if len(outputs) == 1:
            return None
        term = self.objective.cross_entropy_term
        depths = [_local(term(part, out, labels, k)) for k, out in enumerate(outputs[1:], 1)]
        return self.mtp.weighted(depths, self.objective.scale)

    def step_done(self) -> dict[str, torch.Tensor]:
        return self.mtp.step_metrics(self.objective.meshes)


def build_balance(job_config: JobConfig, model_args: Any, objective: Objective) -> LoadBalance | None:
    """A mixture of experts' balancing (load_balance.py), for the families whose arguments have experts."""
    if not getattr(model_args, "num_experts", 0):
        return None
    return LoadBalance(job_config.moe, model_args.num_experts, model_args.top_k, objective.meshes)


# The terms added to the language model's loss, each built from the job (None where it is off).
TERMS = (MTPTerm.build, build_balance, ZLoss.build)
