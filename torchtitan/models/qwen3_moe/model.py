"""Qwen3-MoE on Qwen3's transformer: a block's feed-forward is the shared mixture of experts
(torchtitan/models/moe.py) in the sparse layers, Qwen3's dense SwiGLU in the others."""

from torch import nn

from torchtitan.models import decoder
from torchtitan.models.moe import MoE
from torchtitan.models.qwen3 import model as qwen3
from torchtitan.models.qwen3_moe import Qwen3MoeModelArgs


class Transformer(qwen3.Transformer):
    """Qwen3-MoE decoder returning float logits; a sparse layer's feed-forward holds
    `feed_forward.router.weight`, `feed_forward.experts.w1/w2/w3` [experts, out, in] and the
    `feed_forward.expert_bias` buffer."""

    @staticmethod
    def build_block(layer_id: int, model_args: Qwen3MoeModelArgs) -> nn.Module:
        if model_args.is_sparse(layer_id):
            feed_forward = MoE(
                model_args.dim,
                model_args.moe_hidden_dim,
                model_args.num_experts,
                model_args.top_k,
                norm_topk_prob=model_args.norm_topk_prob,
            )
        else:
            feed_forward = decoder.FeedForward(model_args.dim, model_args.hidden_dim)
        return decoder.TransformerBlock(layer_id, model_args, qwen3.Attention(model_args), feed_forward)
