"""Qwen3.5-MoE weights between this repository's names and layout and Hugging Face transformers'
(`Qwen3_5MoeForCausalLM`, a text-only folder: model_type "qwen3_5_moe_text").

Qwen3.5's names (torchtitan/models/qwen3_5/hf_convert.py) for the token mixers and norms; the mixture of
experts as the files hold it: one Linear per expert (`mlp.experts.E.{gate,up,down}_proj.weight`, what
transformers' save_pretrained writes and its loader reads, fusing them in memory into
`gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I]), the router `mlp.gate.weight`, the shared expert
`mlp.shared_expert.*` and its gate `mlp.shared_expert_gate.weight` [1, H]. Ours stacks each layer's
experts as [experts, out, in], each expert's slice its HF Linear weight. The balancing bias
(`expert_bias`) has no place in HF's model: a converted model starts with a zero one.
"""

import torch

from torchtitan.models.hf_convert import (
    DENSE_MLP,
    EXPERTS,
    experts_from_hf,
    experts_to_hf,
    from_hf_names,
    to_hf_names,
)
from torchtitan.models.qwen3_5 import hf_convert as dense
from torchtitan.models.qwen3_5_moe import Qwen35MoeModelArgs

MODEL_TYPE = "qwen3_5_moe_text"

# The shared expert's SwiGLU: ours -> HF's (after "model.layers.N.").
SHARED = {ours: f"mlp.shared_expert.{proj}" for ours, proj in EXPERTS.items()}
NAMES = {
    **{k: v for k, v in dense.NAMES.items() if ".feed_forward." not in k},
    "layers.{}.feed_forward.router.weight": "model.layers.{}.mlp.gate.weight",
    "layers.{}.feed_forward.shared_expert_gate.weight": "model.layers.{}.mlp.shared_expert_gate.weight",
    **{
        f"layers.{{}}.feed_forward.shared_expert.{ours}.weight": f"model.layers.{{}}.{shared}.weight"
        for ours, shared in SHARED.items()
    },
}
# A layer's mixture-of-experts tensors other than the experts (after "model.layers.N.").
MOE = (
    "mlp.gate.weight",
    "mlp.shared_expert_gate.weight",
    *(f"{shared}.weight" for shared in SHARED.values()),
)


def to_hf(state_dict: dict[str, torch.Tensor], model_args: Qwen35MoeModelArgs) -> dict[str, torch.Tensor]:
    """Our model's state dict (without `expert_bias`) -> HF Qwen3_5MoeForCausalLM's, experts per expert."""
    rest, experts = experts_to_hf(state_dict)
    return {**to_hf_names(rest, NAMES, model_args.tie_word_embeddings), **experts}


def from_hf(state_dict: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """HF Qwen3_5MoeForCausalLM's state dict (per-expert files) -> our model's, each layer's experts
    stacked and a zero `expert_bias` added."""
    rest, experts = experts_from_hf(state_dict)
    converted = {**from_hf_names(rest, NAMES), **experts}
    for name in [n for n in converted if n.endswith("feed_forward.router.weight")]:
        converted[name.replace("router.weight", "expert_bias")] = torch.zeros(converted[name].shape[0])
    return converted


def hf_config(
    model_args: Qwen35MoeModelArgs,
    state_dict: dict[str, torch.Tensor],
    max_position_embeddings: int,
    dtype: torch.dtype,
) -> dict:
    """config.json of the HF model (less "architectures", the spec's): Qwen3.5's, with the experts'."""
    config = dense.hf_config(model_args, state_dict, max_position_embeddings, dtype)
    del config["intermediate_size"]  # no dense layer
    return {
        **config,
        "model_type": MODEL_TYPE,
        "num_experts": model_args.num_experts,
        "num_experts_per_tok": model_args.top_k,
        "moe_intermediate_size": model_args.moe_hidden_dim,
        "shared_expert_intermediate_size": model_args.shared_hidden_dim,
    }


def hf_tensors(config: dict, mtp_layers: int = 0) -> list[str]:
    """Every tensor a Qwen3_5MoeForCausalLM folder of `config` holds (hf_reader.py refuses one missing):
    Qwen3.5's with each layer's dense SwiGLU replaced by its router, shared expert and experts."""
    names = [
        n for n in dense.hf_tensors(config, mtp_layers) if not n.endswith(tuple(f".{m}" for m in DENSE_MLP))
    ]
    for layer in range(config["num_hidden_layers"]):
        names += [f"model.layers.{layer}.{name}" for name in MOE]
        names += [
            f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"
            for e in range(config["num_experts"])
            for proj in EXPERTS.values()
        ]
    return names


check_flavor = dense.check_flavor
