"""Qwen3 (dense) on the Llama transformer: its own attention (per-head q/k norms, its head size,
half-rotation RoPE) and an exact SwiGLU size; the embeddings, blocks, final norm, output (tied or not),
seeded init and pipeline-stage shape are the shared decoder's (torchtitan/models/decoder.py)."""

import torch
from torch import nn

from torchtitan.models import decoder
from torchtitan.models.documents import Documents
from torchtitan.models.init import ones_
from torchtitan.models.llama import model as llama
from torchtitan.models.qwen3 import Qwen3ModelArgs


def apply_rotary_emb(
    xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate feature i of each head with feature i + head_dim / 2 (transformers' `rotate_half`
    layout, so Hugging Face weights need no permutation), in float32.

    xq, xk: (bs, seqlen, n_heads, head_dim); freqs_cis: (seqlen, head_dim // 2) complex, or per token
    (bs, seqlen, head_dim // 2)."""
    cos_sin = torch.view_as_real(freqs_cis).view(-1, xq.shape[1], 1, xq.shape[-1] // 2, 2)
    cos, sin = cos_sin[..., 0], cos_sin[..., 1]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).type_as(x)

    return rotate(xq), rotate(xk)


class Attention(llama.Attention):
    """Llama's causal GQA attention (its projections, with Qwen3's head size) with an RMSNorm over each
    query and key head before RoPE.

    Head counts are read from the projected tensors, so the module also runs when tensor
    parallelism shards wq/wk/wv column-wise; the norms then see this rank's heads (their weights
    are replicated and their gradients summed over the TP group, see the TP plan)."""

    def __init__(self, model_args: Qwen3ModelArgs):
        super().__init__(model_args)
        self.q_norm = decoder.RMSNorm(self.head_dim, eps=model_args.norm_eps)
        self.k_norm = decoder.RMSNorm(self.head_dim, eps=model_args.norm_eps)

    def init_weights(self, init_std: float) -> None:
        super().init_weights(init_std)
        ones_(self.q_norm.weight)
        ones_(self.k_norm.weight)

    def forward(
        self, x: torch.Tensor, freqs_cis: torch.Tensor, documents: Documents | None = None
    ) -> torch.Tensor:
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        bs, seqlen = xq.shape[:2]
        xq = self.q_norm(xq.view(bs, seqlen, -1, self.head_dim))
        xk = self.k_norm(xk.view(bs, seqlen, -1, self.head_dim))
        xv = xv.view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, decoder.rotations(freqs_cis, seqlen))
        output = self.sdpa(xq, xk, xv, documents).contiguous().view(bs, seqlen, -1)
        return self.wo(output)


class Transformer(llama.Transformer):
    """Qwen3 decoder returning float logits; parameter names are Llama's plus
    `layers.N.attention.q_norm.weight` and `k_norm.weight`."""

    @staticmethod
    def build_block(layer_id: int, model_args: Qwen3ModelArgs) -> nn.Module:
        feed_forward = decoder.FeedForward(model_args.dim, model_args.hidden_dim)
        return decoder.TransformerBlock(layer_id, model_args, Attention(model_args), feed_forward)

    def _precompute_freqs_cis(self, device: torch.device | None = None) -> torch.Tensor:
        args = self.model_args
        return llama.precompute_freqs_cis(args.head_dim, args.max_seq_len, args.rope_theta, device=device)
