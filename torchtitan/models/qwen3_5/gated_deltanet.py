"""Gated DeltaNet, Qwen3.5's linear-attention token mixer (transformers' `Qwen3_5GatedDeltaNet`), in
PyTorch: the same parameters under the same names (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`,
`conv1d.weight`, `A_log`, `dt_bias`, `norm.weight`, `out_proj`), so Hugging Face weights load by name.

x -> q, k, v (one projection), a depthwise causal convolution of width 4 and SiLU on them; z (the output
gate), b and a -> beta = sigmoid(b), the log decay g = -exp(A_log) softplus(a + dt_bias) <= 0; q and k
L2-normed, q scaled by dk^-0.5, each key head repeated for its n_value_heads / n_key_heads value heads;
the gated delta rule (delta_rule.py) from a zero state; an RMSNorm of each head's output times SiLU(z);
out_proj. The decay, the norms and the rule run in float32 (torch's default dtype, `upcast`), whatever
the matmuls'.

One layout differs from transformers': in_proj_qkv's rows and the conv's channels are grouped by key
head, [q, k, v of the value heads it serves] for each key head in turn (transformers': every q, then
every k, then every v; hf_convert.py reorders them both ways, bit for bit, `grouped_by_key_head`), so
that tensor parallelism's plain split of rows (Shard(0), tp_plan.py) gives each rank whole key heads
with their value heads, and the conv's channels with them. The rows' order changes no result (nor Adam's
or Muon's updates, which a row permutation commutes with).

Packed documents (block_causal), with no Python loop over them: the convolution's taps that reach back
into the previous document are zeroed (a mask from the document ids, one per tap), and g is -inf at
each document's first token, which the delta rule takes as a state reset (exact, see delta_rule.py), so
each document runs as if alone.

Context parallelism: how the layer runs along its sequence (the conv's reach back, the resets, the rule)
is its `sequence` module's, the whole sequence on this rank (`WholeSequence`); context parallelism swaps
it for one that runs a rank's pieces of each sequence and chains them with the other ranks'
(parallelisms/context_parallel_deltanet.py), as it swaps the attention's `sdpa`.

Head counts are read from the projected tensors (b has one column per value head), as in the other
families' attention, so the module needs no change when a parallelism gives it a share of the heads;
its per-channel and per-head tensors (the conv's taps, A_log, dt_bias) are read as their local shard.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan.models.decoder import upcast
from torchtitan.models.documents import Documents
from torchtitan.models.init import ones_, trunc_normal_, uniform_
from torchtitan.models.qwen3_5 import Qwen35ModelArgs
from torchtitan.models.qwen3_5.delta_rule import chunk_gated_delta_rule


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim: fla's and transformers' form (not F.normalize's
    x / max(|x|, eps), which differs for small vectors)."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a parameter tensor parallelism split by channel or head (tp_plan.py): its
    gradient is that shard's."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def grouped_by_key_head(
    weight: torch.Tensor, n_key_heads: int, key_dim: int, inverse: bool = False
) -> torch.Tensor:
    """in_proj_qkv's rows (or the conv's channels: dim 0) from transformers' order [every q; every k;
    every v] to ours, [q; k; v of the value heads it serves] per key head (module docstring);
    `inverse`: ours back to transformers'."""
    rest = weight.shape[1:]
    per_key = weight.shape[0] // n_key_heads  # 2 key_dim + its value heads' width
    widths = [key_dim, key_dim, per_key - 2 * key_dim]
    if inverse:
        parts = weight.reshape(n_key_heads, per_key, *rest).split(widths, dim=1)
        return torch.cat([part.flatten(0, 1) for part in parts])
    parts = weight.split([n_key_heads * width for width in widths])
    return torch.cat([part.reshape(n_key_heads, -1, *rest) for part in parts], dim=1).flatten(0, 1)


def document_starts(ids: torch.Tensor) -> torch.Tensor:
    """(bs, seqlen) bool: the first token of each document (of each row too)."""
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    return starts


class CausalConv1d(nn.Module):
    """Depthwise causal convolution over (bs, seqlen, channels), no bias: output t of channel c is
    sum_i weight[c, 0, i] * x[t - (W - 1) + i] (nn.Conv1d's weight layout, transformers' parameter),
    zeros before the sequence. As a sum over the W taps, each of which, given the documents, is zeroed
    where it would reach into an earlier document."""

    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))

    def forward(self, x: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        width, length = self.weight.shape[-1], x.shape[1]
        taps = local(self.weight)[:, 0]  # (channels, W); tap W - 1 is the token itself
        out = x * taps[:, width - 1]
        for back in range(1, width):
            earlier = F.pad(x, (0, 0, back, 0))[:, :length]
            if document_ids is not None:
                # -1 before the sequence: no document has it.
                same = F.pad(document_ids, (back, 0), value=-1)[:, :length] == document_ids
                earlier = earlier * same[..., None]
            out = out + earlier * taps[:, width - 1 - back]
        return out

    def init_weights(self) -> None:
        trunc_normal_(self.weight, std=0.02)


class WholeSequence(nn.Module):
    """Gated DeltaNet along a whole sequence held by this rank (module docstring: context parallelism
    replaces it); `documents` are the whole sequences' (block_causal) or None."""

    def conv(self, conv1d: CausalConv1d, x: torch.Tensor, documents: Documents | None) -> torch.Tensor:
        return conv1d(x, documents.ids if documents is not None else None)

    def resets(self, documents: Documents) -> torch.Tensor:
        """(bs, seqlen) bool: where the state restarts (each document's first token)."""
        return document_starts(documents.ids)

    def rule(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        documents: Documents | None,
    ) -> torch.Tensor:
        return chunk_gated_delta_rule(q, k, v, g, beta)[0]


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output (float32), times a plain weight (init ones, not 1 + w), one weight
    shared by every head: transformers' `Qwen3_5RMSNormGated` less its gate, SiLU(z), which the layer
    multiplies after it in the same order (one input, so that tensor parallelism's sequence-parallel
    style on the heads' dim fits it, its weight replicated and its gradient summed over the ranks)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = upcast(x)
        normed = normed * torch.rsqrt(normed.square().mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.type_as(x)

    def init_weights(self) -> None:
        ones_(self.weight)


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear-attention layer (module docstring): (bs, seqlen, dim) -> (bs, seqlen, dim),
    called as every family's attention, `(x, freqs_cis, documents=)` (it has no RoPE: freqs_cis is
    unused)."""

    def __init__(self, model_args: Qwen35ModelArgs):
        super().__init__()
        args = model_args
        n_k, n_v = args.linear_n_key_heads, args.linear_n_value_heads
        if n_v % n_k:
            raise ValueError(f"linear_n_value_heads {n_v} is not a multiple of linear_n_key_heads {n_k}")
        self.key_dim, self.value_dim = args.linear_key_head_dim, args.linear_value_head_dim
        self.heads_per_key = n_v // n_k  # value heads each key head serves
        key_width, value_width = n_k * self.key_dim, n_v * self.value_dim
        self.in_proj_qkv = nn.Linear(args.dim, 2 * key_width + value_width, bias=False)
        self.in_proj_z = nn.Linear(args.dim, value_width, bias=False)
        self.in_proj_b = nn.Linear(args.dim, n_v, bias=False)
        self.in_proj_a = nn.Linear(args.dim, n_v, bias=False)
        self.conv1d = CausalConv1d(2 * key_width + value_width, args.linear_conv_kernel)
        self.dt_bias = nn.Parameter(torch.ones(n_v))
        self.A_log = nn.Parameter(torch.zeros(n_v))
        self.norm = GatedRMSNorm(self.value_dim, eps=args.norm_eps)
        self.out_proj = nn.Linear(value_width, args.dim, bias=False)
        self.sequence = WholeSequence()

    def init_weights(self, init_std: float) -> None:
        """transformers' init (initializer_range 0.02, dt_bias 1, A = U(0.01, 16)), with the residual
        stream's depth-scaled std for out_proj as every family's output projections."""
        for linear in (self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a):
            trunc_normal_(linear.weight, std=0.02)
        self.conv1d.init_weights()
        ones_(self.dt_bias)
        uniform_(self.A_log, 0.01, 16)
        with torch.no_grad():
            self.A_log.log_()
        self.norm.init_weights()
        trunc_normal_(self.out_proj.weight, std=init_std)

    def forward(
        self, x: torch.Tensor, freqs_cis: torch.Tensor | None = None, documents: Documents | None = None
    ) -> torch.Tensor:
        bs, seqlen = x.shape[:2]
        b, a = self.in_proj_b(x), self.in_proj_a(x)
        n_v = b.shape[-1]
        n_k = n_v // self.heads_per_key
        qkv = F.silu(self.sequence.conv(self.conv1d, self.in_proj_qkv(x), documents)).view(
            bs, seqlen, n_k, -1
        )
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.heads_per_key * self.value_dim], dim=-1)
        q = l2norm(upcast(q)) * self.key_dim**-0.5
        k = l2norm(upcast(k))
        if self.heads_per_key > 1:
            q = q.repeat_interleave(self.heads_per_key, dim=2)
            k = k.repeat_interleave(self.heads_per_key, dim=2)
        beta = upcast(b).sigmoid()
        g = -upcast(local(self.A_log)).exp() * F.softplus(upcast(a) + upcast(local(self.dt_bias)))
        if documents is not None:
            g = g.masked_fill(self.sequence.resets(documents)[..., None], float("-inf"))
        v = upcast(v).reshape(bs, seqlen, n_v, self.value_dim)
        out = self.sequence.rule(q, k, v, g, beta, documents)
        z = self.in_proj_z(x).view(bs, seqlen, n_v, self.value_dim)
        out = (self.norm(out.type_as(x)) * F.silu(upcast(z))).type_as(x).reshape(bs, seqlen, -1)
        return self.out_proj(out)
