"""Qwen3.5-MoE: Qwen3.5's Gated DeltaNet hybrid (torchtitan/models/qwen3_5) with a mixture of experts
in every layer, as transformers' `Qwen3_5MoeForCausalLM` and the released config.json files define it.

A family of its own (`model.name` qwen3_5_moe), as Qwen3-MoE is beside Qwen3: what a registry entry
fixes differs from the dense family's (the loop balances experts, [moe] options and expert parallelism
apply, and the Hugging Face class and model_type are Qwen3_5Moe's). Each layer's feed-forward is the
shared mixture of experts (torchtitan/models/moe.py): softmax router, the top-k weights renormalised, and
a shared SwiGLU expert scaled per token by sigmoid(shared_expert_gate(x)). Torch-free.
"""

from dataclasses import dataclass

from torchtitan.models.qwen3_5 import Qwen35ModelArgs, qwen3_5_flops_per_token


@dataclass
class Qwen35MoeModelArgs(Qwen35ModelArgs):
    num_experts: int = 256
    top_k: int = 8  # HF's num_experts_per_tok
    moe_hidden_dim: int = 512  # each expert's SwiGLU hidden size (HF's moe_intermediate_size)
    shared_hidden_dim: int = 512  # the shared expert's (HF's shared_expert_intermediate_size)
    norm_topk_prob: bool = True  # Qwen3.5-MoE always renormalises


def qwen3_5_moe_flops_per_token(model_args: Qwen35MoeModelArgs, num_params: int, seq_len: int) -> int:
    """Qwen3.5's count (the delta rule's and the attention layers' FLOPs) on the active parameters: each
    token runs top_k of every layer's num_experts experts (and all of its other weights)."""
    args = model_args
    idle = args.n_layers * (args.num_experts - args.top_k) * 3 * args.dim * args.moe_hidden_dim
    return qwen3_5_flops_per_token(args, num_params - idle, seq_len)


# The released sizes share these: 16 key heads of 128, value heads of 128, 2 kv heads, untied.
_RELEASED = dict(n_kv_heads=2, linear_n_key_heads=16, linear_key_head_dim=128, linear_value_head_dim=128)
qwen3_5_moe_configs = {
    # Tiny, for the tests and the CPU recipe, every path on: GQA, twice as many value heads as key heads,
    # partial RoPE, three linear-attention layers and one full-attention, 8 experts of which each token
    # takes 2, the gated shared expert.
    "debugmodel": Qwen35MoeModelArgs(
        dim=256,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=64,
        linear_n_key_heads=2,
        linear_n_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        num_experts=8,
        top_k=2,
        moe_hidden_dim=128,
        shared_hidden_dim=128,
    ),
    "35B-A3B": Qwen35MoeModelArgs(
        dim=2048,
        n_layers=40,
        n_heads=16,
        linear_n_value_heads=32,
        num_experts=256,
        top_k=8,
        moe_hidden_dim=512,
        shared_hidden_dim=512,
        **_RELEASED,
    ),
    "122B-A10B": Qwen35MoeModelArgs(
        dim=3072,
        n_layers=48,
        n_heads=32,
        linear_n_value_heads=64,
        num_experts=256,
        top_k=8,
        moe_hidden_dim=1024,
        shared_hidden_dim=1024,
        **_RELEASED,
    ),
    "397B-A17B": Qwen35MoeModelArgs(
        dim=4096,
        n_layers=60,
        n_heads=32,
        linear_n_value_heads=64,
        num_experts=512,
        top_k=10,
        moe_hidden_dim=1024,
        shared_hidden_dim=1024,
        **_RELEASED,
    ),
    # Qwen3-Next's size (its folders read as this family's: hf_convert.py), vocabulary 151,936.
    "Next-80B-A3B": Qwen35MoeModelArgs(
        dim=2048,
        n_layers=48,
        n_heads=16,
        linear_n_value_heads=32,
        num_experts=512,
        top_k=10,
        moe_hidden_dim=512,
        shared_hidden_dim=512,
        **_RELEASED,
    ),
}
