"""Llama 2, Llama 3 and Llama 3.1: the model's arguments and the families' standard sizes (flavours).

Importing this package does not import torch, so the preflight can check a flavour; the model
itself is `torchtitan.models.llama.model.Transformer`. `vocab_size` is left at -1 in every
flavour: the trainer sets it from the tokenizer.
"""

from dataclasses import dataclass, replace

# Llama 3.1's RoPE scaling (model._scale_rope_freqs), in transformers' terms: the published config.json's
# rope_scaling, which the export writes and the Hugging Face reader compares.
LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@dataclass
class ModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # None: same as n_heads (no GQA)
    vocab_size: int = -1  # -1: set from the tokenizer
    multiple_of: int = 256  # SwiGLU hidden dim is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000
    use_scaled_rope: bool = False  # Llama 3.1 long-context RoPE frequency scaling
    max_seq_len: int = 2048
    # Scale the init std of output projections by layer depth rather than by model depth.
    depth_init: bool = True
    # model.attn_mask_type; block_causal finds documents by these token ids (models/documents.py).
    attn_mask_type: str = "causal"
    eos_id: int | None = None
    bos_id: int | None = None

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def tie_word_embeddings(self) -> bool:
        """Llama 2 and 3 (as built here) keep the output layer apart from the embeddings."""
        return False

    @property
    def ffn_hidden_dim(self) -> int:
        """SwiGLU's hidden size: 2/3 of a 4*dim MLP's (the same parameter count), times
        ffn_dim_multiplier, rounded up to a multiple of multiple_of."""
        hidden_dim = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden_dim = int(self.ffn_dim_multiplier * hidden_dim)
        return self.multiple_of * ((hidden_dim + self.multiple_of - 1) // self.multiple_of)


llama2_configs = {
    "debugmodel": ModelArgs(dim=256, n_layers=6, n_heads=16),
    "7B": ModelArgs(dim=4096, n_layers=32, n_heads=32),
    "13B": ModelArgs(dim=5120, n_layers=40, n_heads=40),
    "70B": ModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        multiple_of=4096,
    ),
}

llama3_configs = {
    "debugmodel": ModelArgs(dim=256, n_layers=6, n_heads=16, rope_theta=500000),
    # Llama 3.2 1B's shape (without its tied embeddings): a one-GPU benchmark size.
    "1B": ModelArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim_multiplier=1.5,
        multiple_of=256,
        rope_theta=500000,
    ),
    "8B": ModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        multiple_of=1024,
        rope_theta=500000,
    ),
    "70B": ModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        multiple_of=4096,
        rope_theta=500000,
    ),
    # Llama 3.1 405B (there was no Llama 3 405B): RoPE scaled as in its published config.json.
    "405B": ModelArgs(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        ffn_dim_multiplier=1.2,
        multiple_of=4096,
        rope_theta=500000,
        use_scaled_rope=True,
    ),
}
# Llama 3.1 8B and 70B: Llama 3's shapes, their RoPE frequencies scaled for a 128K context
# (train_configs/llama3_8b_128k.toml); 8B and 70B stay Llama 3's, unscaled.
llama3_configs["3.1_8B"] = replace(llama3_configs["8B"], use_scaled_rope=True)
llama3_configs["3.1_70B"] = replace(llama3_configs["70B"], use_scaled_rope=True)
