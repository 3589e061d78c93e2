"""Qwen3 weights between this repository's names and Hugging Face transformers' (`Qwen3ForCausalLM`).

Only the names differ: our RoPE rotates the two halves of each head as HF's does, so no rows are
reordered. Llama's names plus the per-head q/k norms; a tied model's HF files have no lm_head.weight.
"""

import torch

from torchtitan.models.hf_convert import (
    check_rope,
    decoder_config,
    expected_tensors,
    from_hf_names,
    to_hf_names,
)
from torchtitan.models.llama.hf_convert import ATTENTION as LLAMA_ATTENTION
from torchtitan.models.llama.hf_convert import NAMES as LLAMA_NAMES
from torchtitan.models.qwen3 import Qwen3ModelArgs

MODEL_TYPE = "qwen3"

# Ours -> HF; "{}" is a layer number.
NAMES = {
    **LLAMA_NAMES,
    "layers.{}.attention.q_norm.weight": "model.layers.{}.self_attn.q_norm.weight",
    "layers.{}.attention.k_norm.weight": "model.layers.{}.self_attn.k_norm.weight",
}


def to_hf(state_dict: dict[str, torch.Tensor], model_args: Qwen3ModelArgs) -> dict[str, torch.Tensor]:
    """Our model's state dict -> HF Qwen3ForCausalLM's."""
    return to_hf_names(state_dict, NAMES, model_args.tie_word_embeddings)


def from_hf(state_dict: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """HF Qwen3ForCausalLM's state dict -> our model's (`config`, its config.json, changes nothing: the
    layout is the same); a tied model's lm_head becomes a copy of the embeddings."""
    return from_hf_names(state_dict, NAMES)


def hf_config(
    model_args: Qwen3ModelArgs,
    state_dict: dict[str, torch.Tensor],
    max_position_embeddings: int,
    dtype: torch.dtype,
) -> dict:
    """config.json of the HF model (less "architectures", the spec's): full causal attention in every
    layer, as ours, so no sliding window."""
    return {
        "model_type": MODEL_TYPE,
        **decoder_config(model_args, state_dict, max_position_embeddings, dtype),
        "rope_scaling": None,
        "use_sliding_window": False,
        "sliding_window": None,
    }


ATTENTION = (*LLAMA_ATTENTION, "self_attn.q_norm.weight", "self_attn.k_norm.weight")


def hf_tensors(config: dict, mtp_layers: int = 0) -> list[str]:
    """Every tensor a Qwen3ForCausalLM folder of `config` holds (hf_reader.py refuses one missing)."""
    return expected_tensors(config, config["num_hidden_layers"], ATTENTION)


def check_flavor(config: dict, model_args: Qwen3ModelArgs, where: str) -> None:
    """The folder's RoPE is the flavour's: rope_theta, and no rope_scaling (ours has none)."""
    check_rope(config, {"rope_theta": model_args.rope_theta, "rope_scaling": None}, where)
