"""Qwen3.5 (dense): the Gated DeltaNet hybrid, as transformers' `Qwen3_5ForCausalLM` and the released
config.json files define it (issue 65, in progress: the mixture-of-experts sizes and Qwen3-Next come
later).

Three linear-attention layers (Gated DeltaNet: gated_deltanet.py, its delta rule: delta_rule.py) for
every gated full-attention layer (attention.py): layer i is full attention iff (i + 1) is a multiple of
`full_attention_interval`, unless `layer_types` lists them. Every norm is zero-centred (1 + w), the
attention's head is 256 wide with RoPE (theta 1e7) on its first quarter, and the feed-forward is a dense
SwiGLU. Torch-free, like every family's arguments. `vocab_size` is -1 in every flavour, set from the
tokenizer (the released models' 248,320: `model.vocab_size`).
"""

from dataclasses import dataclass

from torchtitan.config.options import ConfigError
from torchtitan.models.spec import flops_per_token

LINEAR_ATTENTION, FULL_ATTENTION = "linear_attention", "full_attention"
DELTA_RULE_CHUNK = 64  # the chunked delta rule's chunk (delta_rule.py), what its FLOPs are counted on


@dataclass
class Qwen35ModelArgs:
    dim: int = 4096
    n_layers: int = 32
    # Gated attention.
    n_heads: int = 16
    n_kv_heads: int | None = 4  # None: same as n_heads (no GQA)
    head_dim: int = 256
    rope_theta: float = 10_000_000
    partial_rotary_factor: float = 0.25  # RoPE on the first head_dim * this features of each head
    # Gated DeltaNet: key heads (each serving n_value_heads / n_key_heads value heads), head sizes and
    # the depthwise causal convolution's width.
    linear_n_key_heads: int = 16
    linear_n_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel: int = 4
    full_attention_interval: int = 4
    layer_types: tuple[str, ...] | None = None  # None: from full_attention_interval
    hidden_dim: int = 12288  # SwiGLU hidden size (HF's intermediate_size)
    vocab_size: int = -1  # -1: set from the tokenizer
    norm_eps: float = 1e-6
    max_seq_len: int = 4096
    tie_word_embeddings: bool = False
    # Scale the init std of output projections by layer depth rather than by model depth.
    depth_init: bool = True
    # model.attn_mask_type; block_causal finds documents by these token ids (models/documents.py).
    attn_mask_type: str = "causal"
    eos_id: int | None = None
    bos_id: int | None = None

    def __post_init__(self) -> None:
        """A listed `layer_types` names each block's mixer, one per block: refused in one line (before
        any worker, flavor_args builds these) rather than a block missing its kind or one left over."""
        kinds = self.layer_types
        if kinds is None:
            return
        if len(kinds) != self.n_layers:
            raise ConfigError(
                f"model.n_layers: {self.n_layers} blocks, but the flavour lists {len(kinds)} layer_types; "
                f"set model.n_layers to {len(kinds)} (or 0, the flavour's depth), or use a flavour without "
                "layer_types (every full_attention_interval-th block attention)"
            )
        if unknown := sorted(set(kinds) - {LINEAR_ATTENTION, FULL_ATTENTION}):
            raise ConfigError(
                f"model.flavor: its layer_types holds {unknown[0]!r}; each is {LINEAR_ATTENTION!r} or "
                f"{FULL_ATTENTION!r}"
            )

    def layer_type(self, layer_id: int) -> str:
        """LINEAR_ATTENTION or FULL_ATTENTION: layer `layer_id`'s token mixer."""
        if self.layer_types is not None:
            return self.layer_types[layer_id]
        return FULL_ATTENTION if (layer_id + 1) % self.full_attention_interval == 0 else LINEAR_ATTENTION

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


def qwen3_5_flops_per_token(model_args: Qwen35ModelArgs, num_params: int, seq_len: int) -> int:
    """Training FLOPs per token, for MFU: 6 per parameter (the conv's too: 2 per weight and token
    forward); the full-attention layers' scores and weighted sum as every family's (12 heads head_dim
    seq_len each); and each linear-attention layer's delta rule, which does not grow with the sequence.
    Per value head and token, forward, as the chunked rule computes it (chunk C): k k^T and q k^T over
    the chunk (2 C dk each), the triangular solves for u and w (C/2 (dk + dv) multiply-adds, on
    average), the output's in-chunk term (2 C dv) and three products with the dk x dv state (2 dk dv
    each); training is 3 times the forward."""
    args = model_args
    kinds = [args.layer_type(i) for i in range(args.n_layers)]
    full = kinds.count(FULL_ATTENTION)
    c, dk, dv = DELTA_RULE_CHUNK, args.linear_key_head_dim, args.linear_value_head_dim
    per_head = 4 * c * dk + c * (dk + dv) + 2 * c * dv + 6 * dk * dv
    delta_rule = 3 * (args.n_layers - full) * args.linear_n_value_heads * per_head
    return flops_per_token(num_params, full, args.n_heads, args.head_dim, seq_len) + delta_rule


# The released dense sizes share these: 16 key heads of 128, value heads of 128, a conv of 4.
_RELEASED = dict(linear_n_key_heads=16, linear_key_head_dim=128, linear_value_head_dim=128)
qwen3_5_configs = {
    # Tiny, for the tests and the CPU recipe, every path on: GQA, twice as many value heads as key heads,
    # RoPE on a quarter of the head (16 of 64), three linear-attention layers and one full-attention.
    "debugmodel": Qwen35ModelArgs(
        dim=256,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=64,
        linear_n_key_heads=2,
        linear_n_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        hidden_dim=512,
    ),
    "0.8B": Qwen35ModelArgs(
        dim=1024,
        n_layers=24,
        n_heads=8,
        n_kv_heads=2,
        linear_n_value_heads=16,
        hidden_dim=3584,
        tie_word_embeddings=True,
        **_RELEASED,
    ),
    "2B": Qwen35ModelArgs(
        dim=2048,
        n_layers=24,
        n_heads=8,
        n_kv_heads=2,
        linear_n_value_heads=16,
        hidden_dim=6144,
        tie_word_embeddings=True,
        **_RELEASED,
    ),
    "4B": Qwen35ModelArgs(
        dim=2560,
        n_layers=32,
        n_heads=16,
        n_kv_heads=4,
        linear_n_value_heads=32,
        hidden_dim=9216,
        tie_word_embeddings=True,
        **_RELEASED,
    ),
    "9B": Qwen35ModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=16,
        n_kv_heads=4,
        linear_n_value_heads=32,
        hidden_dim=12288,
        **_RELEASED,
    ),
    "27B": Qwen35ModelArgs(
        dim=5120,
        n_layers=64,
        n_heads=24,
        n_kv_heads=4,
        linear_n_value_heads=48,
        hidden_dim=17408,
        **_RELEASED,
    ),
}
