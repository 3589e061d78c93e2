"""Qwen3.5-MoE on Qwen3.5's decoder: each block's feed-forward is the shared mixture of experts
(torchtitan/models/moe.py) with Qwen3.5-MoE's gated shared expert."""

from torch import nn

from torchtitan.models.moe import MoE
from torchtitan.models.qwen3_5 import model as qwen3_5
from torchtitan.models.qwen3_5_moe import Qwen35MoeModelArgs


class Transformer(qwen3_5.Transformer):
    """Qwen3.5-MoE decoder returning float logits; a block's feed-forward holds
    `feed_forward.router.weight`, `feed_forward.experts.w1/w2/w3` [experts, out, in],
    `feed_forward.shared_expert.w1/w2/w3`, `feed_forward.shared_expert_gate.weight` and the
    `feed_forward.expert_bias` buffer."""

    @staticmethod
    def build_block(layer_id: int, model_args: Qwen35MoeModelArgs) -> nn.Module:
        feed_forward = MoE(
            model_args.dim,
            model_args.moe_hidden_dim,
            model_args.num_experts,
            model_args.top_k,
            norm_topk_prob=model_args.norm_topk_prob,
            shared_hidden_dim=model_args.shared_hidden_dim,
            shared_gate=True,
        )
        return qwen3_5.Block(layer_id, model_args, feed_forward)
