"""Qwen3-MoE weights between this repository's names and layout and Hugging Face transformers'
(`Qwen3MoeForCausalLM`), in the Hub's file layout: one Linear per expert
(`model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`) and the router as `mlp.gate.weight`.
transformers 5 fuses the experts in memory when it loads such files, and splits them when it saves.

Ours holds each layer's experts as 3-D weights [experts, out, in], each expert's slice being its HF
Linear weight. Attention, norms and dense layers are Qwen3's. The balancing bias (`expert_bias`) has no
place in HF's model: convert_dcp_to_hf.py refuses a non-zero one unless told to drop it, and a
converted HF model starts with a zero bias.
"""

import torch

from torchtitan.models.hf_convert import (
    check_rope,
    decoder_config,
    expected_tensors,
    experts_from_hf,
    experts_to_hf,
    from_hf_names,
    to_hf_names,
)
from torchtitan.models.qwen3.hf_convert import ATTENTION
from torchtitan.models.qwen3.hf_convert import NAMES as QWEN3_NAMES
from torchtitan.models.qwen3_moe import Qwen3MoeModelArgs

MODEL_TYPE = "qwen3_moe"

NAMES = {**QWEN3_NAMES, "layers.{}.feed_forward.router.weight": "model.layers.{}.mlp.gate.weight"}


def to_hf(state_dict: dict[str, torch.Tensor], model_args: Qwen3MoeModelArgs) -> dict[str, torch.Tensor]:
    """Our model's state dict (without `expert_bias`) -> HF Qwen3MoeForCausalLM's."""
    dense, experts = experts_to_hf(state_dict)
    return {**to_hf_names(dense, NAMES, model_args.tie_word_embeddings), **experts}


def from_hf(state_dict: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """HF Qwen3MoeForCausalLM's state dict (Hub layout) -> our model's, each sparse layer's experts
    stacked and a zero `expert_bias` added (`config`, its config.json, changes nothing)."""
    dense, experts = experts_from_hf(state_dict)
    converted = {**from_hf_names(dense, NAMES), **experts}
    for name in [n for n in converted if n.endswith("feed_forward.router.weight")]:
        num_experts = converted[name].shape[0]
        converted[name.replace("router.weight", "expert_bias")] = torch.zeros(num_experts)
    return converted


def hf_config(
    model_args: Qwen3MoeModelArgs,
    state_dict: dict[str, torch.Tensor],
    max_position_embeddings: int,
    dtype: torch.dtype,
) -> dict:
    """config.json of the HF model (less "architectures", the spec's); `intermediate_size` is the dense
    layers' SwiGLU size (the flavour's, as in the released config.json files, even with no dense layer)."""
    return {
        "model_type": MODEL_TYPE,
        **decoder_config(model_args, state_dict, max_position_embeddings, dtype),
        "intermediate_size": model_args.hidden_dim,
        "moe_intermediate_size": model_args.moe_hidden_dim,
        "num_experts": model_args.num_experts,
        "num_experts_per_tok": model_args.top_k,
        "norm_topk_prob": model_args.norm_topk_prob,
        "decoder_sparse_step": model_args.decoder_sparse_step,
        "mlp_only_layers": list(model_args.mlp_only_layers),
        "rope_scaling": None,
        "use_sliding_window": False,
        "sliding_window": None,
    }


def hf_tensors(config: dict, mtp_layers: int = 0) -> list[str]:
    """Every tensor a Qwen3MoeForCausalLM folder of `config` holds (hf_reader.py refuses one missing):
    sparse layers as transformers places them (not in mlp_only_layers, every decoder_sparse_step-th)."""
    # transformers 5 writes num_local_experts, the Hub's files num_experts (128: transformers' default).
    experts = config.get("num_experts", config.get("num_local_experts", 128))
    step = config.get("decoder_sparse_step") or 1
    dense = set(config.get("mlp_only_layers") or [])

    def sparse(layer: int) -> bool:
        return experts > 0 and layer not in dense and (layer + 1) % step == 0

    return expected_tensors(
        config, config["num_hidden_layers"], ATTENTION, sparse, ("mlp.gate.weight",), experts
    )


def check_flavor(config: dict, model_args: Qwen3MoeModelArgs, where: str) -> None:
    """The folder's RoPE is the flavour's: rope_theta, and no rope_scaling (ours has none)."""
    check_rope(config, {"rope_theta": model_args.rope_theta, "rope_scaling": None}, where)
