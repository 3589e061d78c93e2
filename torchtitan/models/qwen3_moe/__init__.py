"""Qwen3-MoE: the model's arguments and the released sizes (flavours), as transformers'
`Qwen3MoeForCausalLM` and the Hub's config.json files define them.

Qwen3's attention and embeddings (torchtitan/models/qwen3), with a mixture-of-experts feed-forward
(torchtitan/models/moe.py) in the sparse layers: layer i is sparse unless it is in `mlp_only_layers`,
and only every `decoder_sparse_step`-th layer is ((i + 1) % step == 0); the others keep a dense
SwiGLU of `hidden_dim`. The router's scores are a softmax, a token's top-k weights renormalised
(`norm_topk_prob`), as in every released size. Torch-free, like every family's arguments.
"""

from dataclasses import dataclass

from torchtitan.models.qwen3 import Qwen3ModelArgs
from torchtitan.models.spec import flops_per_token


@dataclass
class Qwen3MoeModelArgs(Qwen3ModelArgs):
    num_experts: int = 128
    top_k: int = 8  # HF's num_experts_per_tok
    moe_hidden_dim: int = 768  # each expert's SwiGLU hidden size (HF's moe_intermediate_size)
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def is_sparse(self, layer_id: int) -> bool:
        return layer_id not in self.mlp_only_layers and (layer_id + 1) % self.decoder_sparse_step == 0

    @property
    def sparse_layers(self) -> int:
        return sum(self.is_sparse(i) for i in range(self.n_layers))


def moe_flops_per_token(model_args: Qwen3MoeModelArgs, num_params: int, seq_len: int) -> int:
    """Training FLOPs per token counted on the active parameters: each token runs top_k of the
    num_experts experts of a sparse layer (and all of its other weights)."""
    idle_experts = model_args.num_experts - model_args.top_k
    idle = model_args.sparse_layers * idle_experts * 3 * model_args.dim * model_args.moe_hidden_dim
    args = model_args
    return flops_per_token(num_params - idle, args.n_layers, args.n_heads, args.head_dim, seq_len)


_RELEASED = dict(n_kv_heads=4, head_dim=128, num_experts=128, top_k=8)
qwen3_moe_configs = {
    # Tiny, for the tests and the CPU recipe: 8 experts of which each token takes 2, and a dense first
    # layer (mlp_only_layers), so both kinds of block are exercised.
    "debugmodel": Qwen3MoeModelArgs(
        dim=256,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=32,
        hidden_dim=768,
        num_experts=8,
        top_k=2,
        moe_hidden_dim=256,
        mlp_only_layers=(0,),
    ),
    "30B-A3B": Qwen3MoeModelArgs(
        dim=2048, n_layers=48, n_heads=32, hidden_dim=6144, moe_hidden_dim=768, **_RELEASED
    ),
    "235B-A22B": Qwen3MoeModelArgs(
        dim=4096, n_layers=94, n_heads=64, hidden_dim=12288, moe_hidden_dim=1536, **_RELEASED
    ),
}
