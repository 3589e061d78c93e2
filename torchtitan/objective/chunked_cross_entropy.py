"""Cross entropy of the output projection, a chunk of tokens at a time (`training.loss_chunk_tokens`).

The logits of a batch (tokens x vocabulary: 2.1 GB in fp32 for 4096 tokens of Llama 3's 128256) and
their gradient never exist whole: forward projects and scores one chunk of hidden states at a time,
keeping only the hidden states, the weight and the labels; backward projects each chunk again to
get its share of the hidden states' and the weight's gradients. The price is one more projection
matmul per step (its forward recomputed).

With tensor parallelism the output projection is sharded along the vocabulary and so are the
chunks' logits: each rank scores its own vocabulary slice, and the log-sum-exp of a chunk comes
from all-reducing its maximum and its sum of exponentials over the TP group, the label's logit from
the rank that holds it (loss parallel, never gathering the logits nor the weight); each token's
log-sum-exp is kept for the backward, which then needs no collective per chunk."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from torchtitan.datasets.layout import IGNORE_INDEX


class _ChunkedCrossEntropySum(torch.autograd.Function):
    """Sum over the rows of `hidden` (tokens, dim) of the cross entropy of `hidden @ weight.T` in fp32.

    With a process `group`, `weight` holds the vocabulary's rows from `vocab_start` on and `hidden`
    is the same on every rank of the group: the log-sum-exp and the label's logit are all-reduced
    over it, and the gradient of `hidden` is this rank's part of a sum over the group."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk: int, vocab_start: int, group):
        # The labels as rows of this rank's weight; the others score 0 here (another rank holds them).
        rows = labels - vocab_start
        owned = (rows >= 0) & (rows < weight.shape[0])
        scored = (labels != IGNORE_INDEX).float()  # tokens without a target (chat data) score nothing
        rows = torch.where(owned, rows, 0)
        # Kept for backward with vocabulary shards; one process recomputes the softmax whole.
        log_sum_exp = torch.empty(
            hidden.shape[0] if group is not None else 0, dtype=torch.float32, device=hidden.device
        )
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            end = start + chunk
            logits = (hidden[start:end] @ weight.T).float()
            if group is None:  # the whole vocabulary here: torch's fused cross entropy is the fastest
                total = total + F.cross_entropy(logits, labels[start:end], reduction="sum")
                continue
            maxima = logits.max(dim=1).values
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
            label_logits = torch.where(owned[start:end], logits.gather(1, rows[start:end, None])[:, 0], 0.0)
            # In place: a chunk's logits are the largest temporary, and there is one copy of them.
            sums = torch.stack([logits.sub_(maxima[:, None]).exp_().sum(dim=1), label_logits])
            dist.all_reduce(sums, group=group)
            log_sum_exp[start:end] = maxima + sums[0].log()
            total = total + ((log_sum_exp[start:end] - sums[1]) * scored[start:end]).sum()
        ctx.save_for_backward(hidden, weight, rows, owned, scored, log_sum_exp)
        ctx.chunk, ctx.sharded = chunk, group is not None
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        hidden, weight, rows, owned, scored, log_sum_exp = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden)
        # Summed in fp32 over the chunks, whatever the matmul dtype.
        grad_weight = torch.zeros_like(weight, dtype=torch.float32)
        for start in range(0, hidden.shape[0], ctx.chunk):
            end = start + ctx.chunk
            logits = (hidden[start:end] @ weight.T).float()
            # d(cross entropy)/d(logits) = softmax - one-hot of the label (on the rank holding it); the
            # softmax over vocabulary shards from the log-sum-exp of the whole vocabulary.
            if ctx.sharded:
                grad_logits = logits.sub_(log_sum_exp[start:end, None]).exp_()
            else:
                grad_logits = torch.softmax(logits, dim=-1)
            grad_logits.scatter_add_(1, rows[start:end, None], -owned[start:end, None].float())
            grad_logits = (grad_logits * (grad_total * scored[start:end, None])).to(hidden.dtype)
            grad_hidden[start:end] = grad_logits @ weight
            grad_weight += (grad_logits.T @ hidden[start:end]).float()
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None


def _vocab_shard(hidden: torch.Tensor, weight: DTensor) -> tuple[torch.Tensor, torch.Tensor, int, object]:
    """TP's vocabulary-sharded projection as local tensors: the hidden states whole on every rank
    (all-gathered along the sequence under sequence parallelism; their gradient, a partial sum on
    each rank, is reduce-scattered back, or all-reduced where they were replicated), this rank's rows
    of the weight, the vocabulary id of its first row, and the TP group."""
    mesh = weight.device_mesh
    if weight.placements != (Shard(0),):
        raise ValueError(f"the output weight must be sharded along the vocabulary, got {weight.placements}")
    if not isinstance(hidden, DTensor):
        hidden = DTensor.from_local(hidden, mesh, [Replicate()], run_check=False)
    hidden = hidden.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
    _, vocab_start = Shard.local_shard_size_and_offset(weight.shape[0], mesh.size(), mesh.get_local_rank())
    return hidden, weight.to_local(), vocab_start, mesh.get_group()


def chunked_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int
) -> torch.Tensor:
    """Summed cross entropy of the logits `hidden @ weight.T` (upcast to fp32) against `labels` over the
    tokens whose label is not IGNORE_INDEX, as `F.cross_entropy(F.linear(hidden, weight).float(), labels,
    reduction="sum")` but `chunk_tokens` tokens at a time (the objective divides it: objective.py).

    hidden: (..., dim) final-norm outputs; weight: (vocab, dim); labels: (...) token ids. Under
    autocast the matmuls run in its dtype, as the output projection's would. With TP, `weight` is
    the output projection's DTensor (Shard(0) on the TP mesh) and `hidden` a DTensor sharded along
    the sequence (sequence parallelism) or replicated, or a plain tensor, the same on every rank:
    each rank scores its vocabulary shard, and every rank gets the whole loss."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    vocab_start, group = 0, None
    if isinstance(weight, DTensor):
        hidden, weight, vocab_start, group = _vocab_shard(hidden, weight)
    with torch.autocast(device_type, enabled=False):
        total = _ChunkedCrossEntropySum.apply(
            hidden.flatten(0, -2), weight, labels.flatten(), chunk_tokens, vocab_start, group
        )
    return total
