"""Qwen3.5 (dense) on the shared decoder: blocks whose token mixer is Gated DeltaNet
(gated_deltanet.py) or, every `full_attention_interval`-th layer, gated attention (attention.py), each
with a dense SwiGLU; every norm zero-centred (1 + w). The embeddings, output (tied or not), seeded init
and pipeline-stage shape are the shared decoder's (torchtitan/models/decoder.py)."""

import torch
from torch import nn

from torchtitan.models import decoder
from torchtitan.models.llama.model import precompute_freqs_cis
from torchtitan.models.qwen3_5 import LINEAR_ATTENTION, Qwen35ModelArgs
from torchtitan.models.qwen3_5.attention import GatedAttention, ZeroCentredRMSNorm
from torchtitan.models.qwen3_5.gated_deltanet import GatedDeltaNet


class Block(decoder.TransformerBlock):
    """The shared pre-norm block with Qwen3.5's mixer of its layer (`attention`: GatedDeltaNet or
    GatedAttention) and zero-centred norms; its feed-forward a dense SwiGLU unless given (Qwen3.5-MoE's
    mixture of experts)."""

    def __init__(self, layer_id: int, model_args: Qwen35ModelArgs, feed_forward: nn.Module | None = None):
        linear = model_args.layer_type(layer_id) == LINEAR_ATTENTION
        mixer = GatedDeltaNet(model_args) if linear else GatedAttention(model_args)
        if feed_forward is None:
            feed_forward = decoder.FeedForward(model_args.dim, model_args.hidden_dim)
        super().__init__(layer_id, model_args, mixer, feed_forward)
        self.attention_norm = ZeroCentredRMSNorm(model_args.dim, eps=model_args.norm_eps)
        self.ffn_norm = ZeroCentredRMSNorm(model_args.dim, eps=model_args.norm_eps)


class Transformer(decoder.Decoder):
    """Qwen3.5 decoder returning float logits. Parameter names: the shared decoder's, with each block's
    mixer under `attention` (Gated DeltaNet's parameters named as transformers' `linear_attn`, the
    attention's as Qwen3's); hf_convert.py maps them."""

    def __init__(self, model_args: Qwen35ModelArgs):
        super().__init__(model_args)
        self.norm = ZeroCentredRMSNorm(model_args.dim, eps=model_args.norm_eps)

    @staticmethod
    def build_block(layer_id: int, model_args: Qwen35ModelArgs) -> nn.Module:
        return Block(layer_id, model_args)

    def _precompute_freqs_cis(self, device: torch.device | None = None) -> torch.Tensor:
        """RoPE's table of the rotated features only (a quarter of the attention's head)."""
        args = self.model_args
        return precompute_freqs_cis(args.rotary_dim, args.max_seq_len, args.rope_theta, device=device)
