"""Llama weights between this repository's names and layout (Meta's) and Hugging Face transformers'.

Two differences: the parameter names, and the order of the q/k projection rows. Meta's RoPE rotates
interleaved feature pairs (0, 1), (2, 3), ... of each head, HF's rotates the two halves of each head
against each other, so wq and wk rows are permuted per head (wk with the kv head count, for GQA).
"""

import re

import torch

from torchtitan.models.llama.model import ModelArgs

# Ours -> HF; "{}" is a layer number.
NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "layers.{}.attention.wq.weight": "model.layers.{}.self_attn.q_proj.weight",
    "layers.{}.attention.wk.weight": "model.layers.{}.self_attn.k_proj.weight",
    "layers.{}.attention.wv.weight": "model.layers.{}.self_attn.v_proj.weight",
    "layers.{}.attention.wo.weight": "model.layers.{}.self_attn.o_proj.weight",
    "layers.{}.feed_forward.w1.weight": "model.layers.{}.mlp.gate_proj.weight",
    "layers.{}.feed_forward.w3.weight": "model.layers.{}.mlp.up_proj.weight",
    "layers.{}.feed_forward.w2.weight": "model.layers.{}.mlp.down_proj.weight",
    "layers.{}.attention_norm.weight": "model.layers.{}.input_layernorm.weight",
    "layers.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
}
HF_NAMES = {hf: ours for ours, hf in NAMES.items()}

# Llama 3.1's RoPE scaling, as applied by model._scale_rope_freqs, in HF's terms.
LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _rename(name: str, table: dict[str, str]) -> str:
    layer = re.search(r"layers\.(\d+)\.", name)
    pattern = name.replace(layer.group(0), "layers.{}.", 1) if layer else name
    if pattern not in table:
        raise KeyError(f"no Llama parameter named {name!r}")
    return table[pattern].format(layer.group(1)) if layer else table[pattern]


def interleaved_to_halves(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder the rows of each head of a q/k projection from RoPE pairs (0, 1), (2, 3), ... to
    (0, 2, 4, ..., 1, 3, 5, ...)."""
    out_dim, in_dim = w.shape
    return w.view(n_heads, out_dim // n_heads // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def halves_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of `interleaved_to_halves`."""
    out_dim, in_dim = w.shape
    return w.view(n_heads, 2, out_dim // n_heads // 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def _rope_heads(name: str, n_heads: int, n_kv_heads: int) -> int | None:
    """The heads whose rows RoPE rotates in parameter `name` (our name); None where there is no RoPE."""
    if name.endswith("attention.wq.weight"):
        return n_heads
    if name.endswith("attention.wk.weight"):
        return n_kv_heads
    return None


def to_hf(state_dict: dict[str, torch.Tensor], n_heads: int, n_kv_heads: int) -> dict[str, torch.Tensor]:
    """Our model's state dict -> HF LlamaForCausalLM's."""
    converted = {}
    for name, w in state_dict.items():
        heads = _rope_heads(name, n_heads, n_kv_heads)
        converted[_rename(name, NAMES)] = (interleaved_to_halves(w, heads) if heads else w).contiguous()
    return converted


def from_hf(state_dict: dict[str, torch.Tensor], n_heads: int, n_kv_heads: int) -> dict[str, torch.Tensor]:
    """HF LlamaForCausalLM's state dict -> our model's; a tied lm_head becomes a copy of the embeddings."""
    converted = {}
    for hf_name, w in state_dict.items():
        name = _rename(hf_name, HF_NAMES)
        heads = _rope_heads(name, n_heads, n_kv_heads)
        converted[name] = (halves_to_interleaved(w, heads) if heads else w).contiguous()
    if "output.weight" not in converted:
        converted["output.weight"] = converted["tok_embeddings.weight"].clone()
    return converted


def hf_config(
    args: ModelArgs, state_dict: dict[str, torch.Tensor], max_position_embeddings: int, dtype: torch.dtype
) -> dict:
    """config.json of the HF model; sizes are read from our state dict, the rest from `args`."""
    vocab_size, dim = state_dict["tok_embeddings.weight"].shape
    n_kv_heads = args.n_kv_heads or args.n_heads
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": dim,
        "intermediate_size": state_dict["layers.0.feed_forward.w1.weight"].shape[0],
        "num_hidden_layers": len({k.split(".")[1] for k in state_dict if k.startswith("layers.")}),
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": dim // args.n_heads,
        "vocab_size": vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": float(args.rope_theta),
        "rope_scaling": dict(LLAMA3_ROPE_SCALING) if args.use_scaled_rope else None,
        "max_position_embeddings": max_position_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
