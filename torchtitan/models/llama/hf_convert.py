"""Llama weights between this repository's names and layout (Meta's) and Hugging Face transformers'.

Two differences: the parameter names, and the order of the q/k projection rows. Meta's RoPE rotates
interleaved feature pairs (0, 1), (2, 3), ... of each head, HF's rotates the two halves of each head
against each other, so wq and wk rows are permuted per head (wk with the kv head count, for GQA).
"""

from collections.abc import Callable

import torch

from torchtitan.models.hf_convert import (
    RowOrder,
    check_rope,
    decoder_config,
    expected_tensors,
    from_hf_names,
    to_hf_names,
)
from torchtitan.models.llama import LLAMA3_ROPE_SCALING, ModelArgs

MODEL_TYPE = "llama"

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


def interleaved_to_halves(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder the rows of each head of a q/k projection from RoPE pairs (0, 1), (2, 3), ... to
    (0, 2, 4, ..., 1, 3, 5, ...)."""
    out_dim, in_dim = w.shape
    return w.view(n_heads, out_dim // n_heads // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def halves_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of `interleaved_to_halves`."""
    out_dim, in_dim = w.shape
    return w.view(n_heads, 2, out_dim // n_heads // 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def _rope_rows(
    permute: Callable[[torch.Tensor, int], torch.Tensor], n_heads: int, n_kv_heads: int
) -> RowOrder:
    """`permute` on the rows of wq (by query heads) and wk (by kv heads, for GQA): those RoPE rotates."""

    def rows(name: str, w: torch.Tensor) -> torch.Tensor:
        if name.endswith("attention.wq.weight"):
            return permute(w, n_heads)
        if name.endswith("attention.wk.weight"):
            return permute(w, n_kv_heads)
        return w

    return rows


def to_hf(state_dict: dict[str, torch.Tensor], model_args: ModelArgs) -> dict[str, torch.Tensor]:
    """Our model's state dict -> HF LlamaForCausalLM's."""
    rows = _rope_rows(interleaved_to_halves, model_args.n_heads, model_args.n_kv_heads or model_args.n_heads)
    return to_hf_names(state_dict, NAMES, model_args.tie_word_embeddings, rows)


def from_hf(state_dict: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """HF LlamaForCausalLM's state dict (`config`: its config.json) -> our model's; a tied lm_head
    becomes a copy of the embeddings."""
    n_heads = config["num_attention_heads"]
    rows = _rope_rows(halves_to_interleaved, n_heads, config.get("num_key_value_heads", n_heads))
    return from_hf_names(state_dict, NAMES, rows)


def hf_config(
    model_args: ModelArgs,
    state_dict: dict[str, torch.Tensor],
    max_position_embeddings: int,
    dtype: torch.dtype,
) -> dict:
    """config.json of the HF model (less "architectures", the spec's)."""
    return {
        "model_type": MODEL_TYPE,
        **decoder_config(model_args, state_dict, max_position_embeddings, dtype),
        **_rope(model_args),
        "mlp_bias": False,
    }


ATTENTION = tuple(f"self_attn.{p}_proj.weight" for p in "qkvo")


def hf_tensors(config: dict, mtp_layers: int = 0) -> list[str]:
    """Every tensor a LlamaForCausalLM folder of `config` holds (hf_reader.py refuses one missing)."""
    return expected_tensors(config, config["num_hidden_layers"], ATTENTION)


def check_flavor(config: dict, model_args: ModelArgs, where: str) -> None:
    """The folder's RoPE (rope_theta, rope_scaling) is the flavour's: Llama 3's and 3.1's have one shape."""
    check_rope(config, _rope(model_args), where)


def _rope(model_args: ModelArgs) -> dict:
    """config.json's RoPE keys for the flavour."""
    scaling = dict(LLAMA3_ROPE_SCALING) if model_args.use_scaled_rope else None
    return {"rope_theta": float(model_args.rope_theta), "rope_scaling": scaling}
