"""Llama 2 / Llama 3 transformer with Meta's parameter names: the shared decoder
(torchtitan/models/decoder.py) with Llama's attention (GQA, interleaved RoPE, Llama 3.1's RoPE scaling).
"""

import math

import torch
from torch import nn

from torchtitan.models.decoder import (
    CausalAttention,
    Decoder,
    FeedForward,
    TransformerBlock,
    rotations,
    upcast,
)
from torchtitan.models.documents import Documents
from torchtitan.models.init import trunc_normal_
from torchtitan.models.llama import LLAMA3_ROPE_SCALING, ModelArgs


def _scale_rope_freqs(freqs: torch.Tensor) -> torch.Tensor:
    """Llama 3.1 RoPE scaling (`LLAMA3_ROPE_SCALING`): slow down low frequencies 8x, keep high ones,
    blend between, as transformers' "llama3" rope_type."""
    scaling = LLAMA3_ROPE_SCALING
    scale_factor, low_freq_factor = scaling["factor"], scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / freqs
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * freqs / scale_factor + smooth * freqs
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / scale_factor, blended)
    return torch.where(wavelen < high_freq_wavelen, freqs, scaled)


def rope_frequencies(
    dim: int, theta: float, use_scaled: bool = False, device: torch.device | None = None
) -> torch.Tensor:
    """RoPE's inverse frequencies (dim // 2,) of a head of `dim` features: transformers' inv_freq, in
    torch's default dtype."""
    freqs = 1.0 / (theta ** (upcast(torch.arange(0, dim, 2, device=device)[: dim // 2]) / dim))
    return _scale_rope_freqs(freqs) if use_scaled else freqs


def precompute_freqs_cis(
    dim: int, end: int, theta: float = 10000.0, use_scaled: bool = False, device: torch.device | None = None
) -> torch.Tensor:
    """Complex rotations e^{i * pos * freq} of shape (end, dim // 2) for positions 0..end-1, in torch's
    default dtype (complex64; complex128 under training.float64)."""
    freqs = rope_frequencies(dim, theta, use_scaled, device)
    t = torch.arange(end, device=device, dtype=torch.get_default_dtype())
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(
    xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate interleaved (even, odd) pairs of q/k features, in float32 (`upcast`) for accuracy.

    xq, xk: (bs, seqlen, n_heads, head_dim); freqs_cis: (seqlen, head_dim // 2) complex, or per token
    (bs, seqlen, head_dim // 2) (positions within documents: block_causal).
    """
    freqs_cis = freqs_cis.view(-1, xq.shape[1], 1, xq.shape[-1] // 2)
    xq_ = torch.view_as_complex(upcast(xq).reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(upcast(xk).reshape(*xk.shape[:-1], -1, 2))
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class Attention(nn.Module):
    """Causal multi-head attention with GQA and RoPE.

    Head counts are read from the projected tensors, so the module also runs when tensor
    parallelism shards wq/wk/wv column-wise (each rank then holds a subset of heads).
    """

    def __init__(self, model_args: ModelArgs):
        super().__init__()
        n_kv_heads = model_args.n_kv_heads or model_args.n_heads
        self.head_dim = model_args.head_dim
        self.wq = nn.Linear(model_args.dim, model_args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(model_args.dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(model_args.dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(model_args.n_heads * self.head_dim, model_args.dim, bias=False)
        self.sdpa = CausalAttention()

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            trunc_normal_(linear.weight, std=0.02)
        trunc_normal_(self.wo.weight, std=init_std)

    def forward(
        self, x: torch.Tensor, freqs_cis: torch.Tensor, documents: Documents | None = None
    ) -> torch.Tensor:
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        # Under sequence parallelism x may be sharded on seqlen; the projections are not.
        bs, seqlen = xq.shape[:2]
        xq = xq.view(bs, seqlen, -1, self.head_dim)
        xk = xk.view(bs, seqlen, -1, self.head_dim)
        xv = xv.view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, rotations(freqs_cis, seqlen))
        output = self.sdpa(xq, xk, xv, documents).contiguous().view(bs, seqlen, -1)
        return self.wo(output)


class Transformer(Decoder):
    """Llama decoder returning float logits (no loss); the shared decoder's shape and names."""

    @staticmethod
    def build_block(layer_id: int, model_args: ModelArgs) -> nn.Module:
        feed_forward = FeedForward(model_args.dim, model_args.ffn_hidden_dim)
        return TransformerBlock(layer_id, model_args, Attention(model_args), feed_forward)

    def _precompute_freqs_cis(self, device: torch.device | None = None) -> torch.Tensor:
        return precompute_freqs_cis(
            self.model_args.head_dim,
            self.model_args.max_seq_len,
            self.model_args.rope_theta,
            self.model_args.use_scaled_rope,
            device=device,
        )
