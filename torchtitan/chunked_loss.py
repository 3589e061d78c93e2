"""Cross entropy of the output projection, a chunk of tokens at a time (`training.loss_chunk_tokens`).

The logits of a batch (tokens x vocabulary: 2.1 GB in fp32 for 4096 tokens of Llama 3's 128256) and
their gradient never exist whole: forward projects and scores one chunk of hidden states at a time,
keeping only the hidden states, the weight and the labels; backward projects each chunk again to
get its share of the hidden states' and the weight's gradients. The price is one more projection
matmul per step (its forward recomputed)."""

import torch
import torch.nn.functional as F


class _ChunkedCrossEntropySum(torch.autograd.Function):
    """Sum over the rows of `hidden` (tokens, dim) of the cross entropy of `hidden @ weight.T` in fp32."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int):
        ctx.save_for_backward(hidden, weight, labels)
        ctx.chunk = chunk
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            logits = (hidden[start : start + chunk] @ weight.T).float()
            total = total + F.cross_entropy(logits, labels[start : start + chunk], reduction="sum")
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        hidden, weight, labels = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden)
        # Summed in fp32 over the chunks, whatever the matmul dtype.
        grad_weight = torch.zeros_like(weight, dtype=torch.float32)
        for start in range(0, hidden.shape[0], ctx.chunk):
            rows = hidden[start : start + ctx.chunk]
            logits = (rows @ weight.T).float()
            # d(cross entropy)/d(logits) = softmax - one-hot of the label.
            grad_logits = torch.softmax(logits, dim=-1)
            grad_logits.scatter_add_(
                1, labels[start : start + ctx.chunk, None], torch.full_like(grad_logits[:, :1], -1.0)
            )
            grad_logits = (grad_logits * grad_total).to(hidden.dtype)
            grad_hidden[start : start + ctx.chunk] = grad_logits @ weight
            grad_weight += (grad_logits.T @ rows).float()
        return grad_hidden, grad_weight.to(weight.dtype), None, None


def chunked_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int
) -> torch.Tensor:
    """Mean cross entropy of the logits `hidden @ weight.T` (upcast to fp32) against `labels`, as
    `F.cross_entropy(F.linear(hidden, weight).float(), labels)` but `chunk_tokens` tokens at a time.

    hidden: (..., dim) final-norm outputs; weight: (vocab, dim); labels: (...) token ids. Under
    autocast the matmuls run in its dtype, as the output projection's would."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    with torch.autocast(device_type, enabled=False):
        total = _ChunkedCrossEntropySum.apply(hidden.flatten(0, -2), weight, labels.flatten(), chunk_tokens)
    return total / labels.numel()
