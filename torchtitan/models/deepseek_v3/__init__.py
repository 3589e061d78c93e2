"""DeepSeek-V3: the model's arguments and the released sizes (flavours), as transformers'
`DeepseekV3ForCausalLM` and the Hub's config.json files define them (Kimi K2 and Moonlight are the same
architecture at other sizes).

Multi-head latent attention (MLA): the queries come through a low-rank bottleneck (`q_lora_rank`; 0: one
plain projection), the keys and values of every head from one shared latent of `kv_lora_rank` features
per token, normed, plus one RoPE key of `qk_rope_head_dim` features that all heads share. A head's query
and key are `qk_nope_head_dim` features without position and `qk_rope_head_dim` rotated ones, its value
`v_head_dim`. RoPE is YaRN-scaled (`rope_factor` > 1), and the softmax scale then grows by mscale^2 at
every sequence length (torchtitan's bug #4117 dropped it below the original context).

DeepSeekMoE: the first `first_k_dense_replace` layers keep a dense SwiGLU of `hidden_dim`, the others a
mixture of experts (torchtitan/models/moe.py) with `n_shared_experts` always-on experts, sigmoid scores
(softmax as an option), the routing bias choosing only, group-limited routing (`n_group`,
`topk_group`), `norm_topk_prob` and `routed_scaling_factor`. Multi-token prediction is not modelled (a
folder's MTP layers are skipped on load). Torch-free, like every family's arguments.
"""

import math
from dataclasses import dataclass


@dataclass
class DeepSeekV3ModelArgs:
    dim: int = 7168
    n_layers: int = 61
    n_heads: int = 128
    n_kv_heads: int | None = None  # MLA expands keys and values to every head: not GQA
    # -1: set from the tokenizer or the Hugging Face folder (the released models': 129,280 for DeepSeek-V3,
    # 163,840 for Moonlight and Kimi K2: model.vocab_size)
    vocab_size: int = -1
    norm_eps: float = 1e-6
    max_seq_len: int = 4096
    hidden_dim: int = 18432  # the dense layers' SwiGLU (HF's intermediate_size)
    # Multi-head latent attention.
    q_lora_rank: int = 1536  # 0: a plain wq
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # RoPE and YaRN (rope_factor 1: plain RoPE); mscale is HF's mscale_all_dim (and mscale).
    rope_theta: float = 10000.0
    rope_factor: float = 40.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    original_seq_len: int = 4096
    mscale: float = 1.0
    # DeepSeekMoE.
    first_k_dense_replace: int = 3
    num_experts: int = 256
    top_k: int = 8  # HF's num_experts_per_tok
    moe_hidden_dim: int = 2048  # each routed expert's SwiGLU (HF's moe_intermediate_size)
    n_shared_experts: int = 1
    score_func: str = "sigmoid"  # or "softmax"
    n_group: int = 8
    topk_group: int = 4
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    tie_word_embeddings: bool = False
    depth_init: bool = True
    # model.attn_mask_type; block_causal finds documents by these token ids (models/documents.py).
    attn_mask_type: str = "causal"
    eos_id: int | None = None
    bos_id: int | None = None

    @property
    def head_dim(self) -> int:
        """A head's query and key size (its value's is v_head_dim)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_sparse(self, layer_id: int) -> bool:
        return layer_id >= self.first_k_dense_replace

    @property
    def sparse_layers(self) -> int:
        return max(0, self.n_layers - self.first_k_dense_replace)

    @property
    def yarn_scale(self) -> float:
        """mscale^2 with YaRN (1 without): what the softmax scale is multiplied by, whatever the
        sequence length, as in transformers (torchtitan's #4117 dropped it below original_seq_len)."""
        if self.rope_factor <= 1 or not self.mscale:
            return 1.0
        return (0.1 * self.mscale * math.log(self.rope_factor) + 1.0) ** 2

    @property
    def softmax_scale(self) -> float:
        return self.head_dim**-0.5 * self.yarn_scale


def deepseek_flops_per_token(model_args: DeepSeekV3ModelArgs, num_params: int, seq_len: int) -> int:
    """Training FLOPs per token on the active parameters (top_k of each MoE layer's routed experts, all
    of its other weights), plus MLA's attention: scores over head_dim features and the weighted sum over
    v_head_dim, per head, 6 FLOPs per multiply-add (forward and backward), the causal mask not
    discounted (spec.flops_per_token's convention)."""
    args = model_args
    idle = args.sparse_layers * (args.num_experts - args.top_k) * 3 * args.dim * args.moe_hidden_dim
    attention = 6 * args.n_layers * args.n_heads * (args.head_dim + args.v_head_dim) * seq_len
    return 6 * (num_params - idle) + attention


_YARN_OFF = dict(rope_factor=1.0)
deepseek_v3_configs = {
    # Tiny, for the tests and the CPU recipe, with every path on: a q LoRA, YaRN (factor 40 on a 4096
    # context, as the released models), sigmoid routing in 2 groups of 4 experts (1 kept), a shared
    # expert, the routed scale, a dense first layer.
    "debugmodel": DeepSeekV3ModelArgs(
        dim=256,
        n_layers=3,
        n_heads=4,
        hidden_dim=512,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        first_k_dense_replace=1,
        num_experts=8,
        top_k=2,
        moe_hidden_dim=128,
        n_group=2,
        topk_group=1,
    ),
    # Moonlight-16B-A3B (moonshotai/Moonlight-16B-A3B's config.json): DeepSeek-V3's shape with no q
    # LoRA, 64 experts in one group, no YaRN, 163,840 tokens.
    "16B": DeepSeekV3ModelArgs(
        dim=2048,
        n_layers=27,
        n_heads=16,
        hidden_dim=11264,
        q_lora_rank=0,
        first_k_dense_replace=1,
        num_experts=64,
        top_k=6,
        moe_hidden_dim=1408,
        n_shared_experts=2,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.446,
        rope_theta=50000.0,
        norm_eps=1e-5,
        max_seq_len=8192,
        **_YARN_OFF,
    ),
    "671B": DeepSeekV3ModelArgs(),
    # Kimi K2 (moonshotai/Kimi-K2-Instruct's config.json): 384 experts in one group, 64 heads, one dense
    # layer, routed scale 2.827, YaRN 32 (beta_fast = beta_slow = 1) on rope_theta 50000.
    "kimi_k2": DeepSeekV3ModelArgs(
        n_heads=64,
        first_k_dense_replace=1,
        num_experts=384,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.827,
        rope_theta=50000.0,
        rope_factor=32.0,
        beta_fast=1.0,
    ),
}
deepseek_v3_configs["debugmodel_plain_q"] = DeepSeekV3ModelArgs(
    **{**vars(deepseek_v3_configs["debugmodel"]), "q_lora_rank": 0}
)
# The debug model 4 layers deep, 2 dense then 2 sparse: enough for the multi-stage pipeline schedules
# (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV) at PP 2, whose 4 stages
# then hold dense and sparse layers apart and on each rank both (scripts/parity_layouts.py).
deepseek_v3_configs["debugmodel_4_layers"] = DeepSeekV3ModelArgs(
    **{**vars(deepseek_v3_configs["debugmodel"]), "n_layers": 4, "first_k_dense_replace": 2}
)
