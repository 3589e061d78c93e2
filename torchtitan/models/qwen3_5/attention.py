"""Qwen3.5's gated full attention (transformers' `Qwen3_5Attention`, Qwen3-Next's) and its zero-centred
RMSNorm.

What sets it apart from Qwen3's attention: the query projection is twice as wide, each head's rows
[query (head_dim) | gate (head_dim)], and the attention's output is multiplied by sigmoid(gate) before
the output projection; the q/k norms are zero-centred (1 + w, w initialised to zeros); RoPE turns only
the first `rotary_dim` features of each head (a quarter), in transformers' rotate-half layout.

Its projections keep the repository's names (wq, wk, wv, wo, q_norm, k_norm; the converter maps them to
q_proj, ...), so Qwen3's tensor-parallel plan of a block fits it, and its SDPA is the shared
`CausalAttention` (causal or block_causal), which context parallelism replaces as in every family."""

import torch
from torch import nn

from torchtitan.models import decoder
from torchtitan.models.documents import Documents
from torchtitan.models.init import trunc_normal_, zeros_
from torchtitan.models.qwen3.model import apply_rotary_emb
from torchtitan.models.qwen3_5 import Qwen35ModelArgs


class ZeroCentredRMSNorm(decoder.RMSNorm):
    """RMSNorm times (1 + w), w initialised to zeros, multiplied in float32 before the cast back
    (transformers' `Qwen3_5RMSNorm`, Gemma's): Qwen3.5's every norm but the gated one."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__(dim, eps)
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self._norm(decoder.upcast(x)) * (1 + decoder.upcast(self.weight))).type_as(x)

    def reset_parameters(self) -> None:
        zeros_(self.weight)


def apply_partial_rotary_emb(
    xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's rotate-half RoPE on the first 2 * freqs_cis.shape[-1] features of each head; the rest
    pass through. xq, xk: (bs, seqlen, heads, head_dim)."""
    rotary_dim = 2 * freqs_cis.shape[-1]
    q_rot, k_rot = apply_rotary_emb(xq[..., :rotary_dim], xk[..., :rotary_dim], freqs_cis)
    return torch.cat([q_rot, xq[..., rotary_dim:]], dim=-1), torch.cat([k_rot, xk[..., rotary_dim:]], dim=-1)


class GatedAttention(nn.Module):
    """Causal GQA attention with a sigmoid output gate per feature, zero-centred q/k norms before RoPE
    and RoPE on part of each head (module docstring). freqs_cis: the table (or per-token rotations) of
    `rotary_dim` features, (seqlen, rotary_dim // 2).

    Head counts are read from the projected tensors, so the module also runs when tensor parallelism
    shards wq/wk/wv column-wise: wq's rows are whole heads' [query | gate], so a column shard keeps each
    head's gate with its query."""

    def __init__(self, model_args: Qwen35ModelArgs):
        super().__init__()
        n_kv_heads = model_args.n_kv_heads or model_args.n_heads
        self.head_dim = model_args.head_dim
        self.wq = nn.Linear(model_args.dim, 2 * model_args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(model_args.dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(model_args.dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(model_args.n_heads * self.head_dim, model_args.dim, bias=False)
        self.q_norm = ZeroCentredRMSNorm(self.head_dim, eps=model_args.norm_eps)
        self.k_norm = ZeroCentredRMSNorm(self.head_dim, eps=model_args.norm_eps)
        self.sdpa = decoder.CausalAttention()

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            trunc_normal_(linear.weight, std=0.02)
        trunc_normal_(self.wo.weight, std=init_std)
        self.q_norm.init_weights()
        self.k_norm.init_weights()

    def forward(
        self, x: torch.Tensor, freqs_cis: torch.Tensor, documents: Documents | None = None
    ) -> torch.Tensor:
        bs, seqlen = x.shape[:2]
        xq, gate = self.wq(x).view(bs, seqlen, -1, 2 * self.head_dim).chunk(2, dim=-1)
        xq = self.q_norm(xq)
        xk = self.k_norm(self.wk(x).view(bs, seqlen, -1, self.head_dim))
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_partial_rotary_emb(xq, xk, decoder.rotations(freqs_cis, seqlen))
        output = self.sdpa(xq, xk, xv, documents).reshape(bs, seqlen, -1)
        return self.wo(output * torch.sigmoid(gate.reshape(bs, seqlen, -1)))
