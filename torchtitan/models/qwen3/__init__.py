"""Qwen3 (dense): the model's arguments and the released sizes (flavours), as transformers'
`Qwen3ForCausalLM` and the Hub's config.json files define them.

What sets Qwen3 apart from Llama 3: an RMSNorm on each query and key head before RoPE (`q_norm`,
`k_norm`), a head size of its own (128 in every released size, not dim / n_heads), RoPE that rotates
the two halves of each head (transformers' `rotate_half`), rope_theta 1e6, norm eps 1e-6, an exact
SwiGLU hidden size, and embeddings tied to the output layer in the sizes up to 4B. Torch-free, like
every family's arguments; the model is `torchtitan.models.qwen3.model.Transformer`. `vocab_size` is
-1 in every flavour, set from the tokenizer (the released models' 151,936: `model.vocab_size`).
"""

from dataclasses import dataclass


@dataclass
class Qwen3ModelArgs:
    dim: int = 4096
    n_layers: int = 36
    n_heads: int = 32
    n_kv_heads: int | None = 8  # None: same as n_heads (no GQA)
    head_dim: int = 128
    hidden_dim: int = 12288  # SwiGLU hidden size (HF's intermediate_size)
    vocab_size: int = -1  # -1: set from the tokenizer
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000
    max_seq_len: int = 4096
    tie_word_embeddings: bool = False
    # Scale the init std of output projections by layer depth rather than by model depth.
    depth_init: bool = True
    # model.attn_mask_type; block_causal finds documents by these token ids (models/documents.py).
    attn_mask_type: str = "causal"
    eos_id: int | None = None
    bos_id: int | None = None


_SMALL = dict(n_kv_heads=8, head_dim=128, tie_word_embeddings=True)
qwen3_configs = {
    # Tiny, for the tests and the CPU recipe: head_dim 32 is not dim / n_heads (256 / 4 = 64), as in
    # the released sizes; untied like 8B and up (so every layout runs it, pipelines too), and tied
    # like 0.6B to 4B.
    "debugmodel": Qwen3ModelArgs(dim=256, n_layers=6, n_heads=4, n_kv_heads=2, head_dim=32, hidden_dim=768),
    "debugmodel_tied": Qwen3ModelArgs(
        dim=256, n_layers=6, n_heads=4, n_kv_heads=2, head_dim=32, hidden_dim=768, tie_word_embeddings=True
    ),
    "0.6B": Qwen3ModelArgs(dim=1024, n_layers=28, n_heads=16, hidden_dim=3072, **_SMALL),
    "1.7B": Qwen3ModelArgs(dim=2048, n_layers=28, n_heads=16, hidden_dim=6144, **_SMALL),
    "4B": Qwen3ModelArgs(dim=2560, n_layers=36, n_heads=32, hidden_dim=9728, **_SMALL),
    "8B": Qwen3ModelArgs(dim=4096, n_layers=36, n_heads=32, hidden_dim=12288),
    "14B": Qwen3ModelArgs(dim=5120, n_layers=40, n_heads=40, hidden_dim=17408),
    "32B": Qwen3ModelArgs(dim=5120, n_layers=64, n_heads=64, hidden_dim=25600),
}
