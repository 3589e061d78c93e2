"""Qwen3.5-MoE weights between this repository's names and layout and Hugging Face transformers'
(`Qwen3_5MoeForCausalLM`, a text-only folder: model_type "qwen3_5_moe_text").

Qwen3.5's names (torchtitan/models/qwen3_5/hf_convert.py) for the token mixers and norms; the mixture of
experts as the files hold it: one Linear per expert (`mlp.experts.E.{gate,up,down}_proj.weight`, what
transformers' save_pretrained writes and its loader reads, fusing them in memory into
`gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I]), the router `mlp.gate.weight`, the shared expert
`mlp.shared_expert.*` and its gate `mlp.shared_expert_gate.weight` [1, H]. Ours stacks each layer's
experts as [experts, out, in], each expert's slice its HF Linear weight. The balancing bias
(`expert_bias`) has no place in HF's model: a converted model starts with a zero one.

Read, not written: the released vision-language folders (model_type "qwen3_5_moe": the text model under
`model.language_model.*`, as Qwen3.5's) and Qwen3-Next's (`Qwen3NextForCausalLM`, "qwen3_next"), whose
Gated DeltaNet projections are fused per key head g: `in_proj_qkvz` rows [q_g (dk), k_g (dk), v_g (r dv),
z_g (r dv)] for g = 0..Hk-1, `in_proj_ba` rows [b_g (r), a_g (r)] (r = Hv / Hk, value head g r + j): their
rows regrouped into Qwen3.5's `in_proj_qkv` [q; k; v], `in_proj_z`, `in_proj_b` and `in_proj_a` (then,
as any Qwen3.5 folder's, in_proj_qkv's rows and the conv's channels grouped by key head).
"""

import re

import torch

from torchtitan.config.options import ConfigError
from torchtitan.models.hf_convert import (
    DENSE_MLP,
    EXPERTS,
    experts_from_hf,
    experts_to_hf,
    from_hf_names,
    in_folder,
    text_model,
    to_hf_names,
)
from torchtitan.models.qwen3_5 import hf_convert as dense
from torchtitan.models.qwen3_5_moe import Qwen35MoeModelArgs

MODEL_TYPE = "qwen3_5_moe_text"
NEXT = "qwen3_next"
ALSO_READS = ("qwen3_5_moe", NEXT)  # the released vision-language folders; Qwen3-Next's
_FUSED = re.compile(r"model\.layers\.(\d+)\.linear_attn\.in_proj_(qkvz|ba)\.weight")

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
    rows = dense.key_head_rows(model_args.linear_n_key_heads, model_args.linear_key_head_dim, inverse=True)
    return {**to_hf_names(rest, NAMES, model_args.tie_word_embeddings, rows), **experts}


def from_hf(state_dict: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """HF Qwen3_5MoeForCausalLM's state dict (per-expert files; or a vision-language folder's text model,
    or Qwen3-Next's) -> our model's, each layer's experts stacked and a zero `expert_bias` added."""
    state_dict = text_model(state_dict, config)
    if config.get("model_type") == NEXT:
        state_dict = _unfused(state_dict, config)
    rest, experts = experts_from_hf(state_dict)
    converted = {**from_hf_names(rest, NAMES, dense.folder_rows(config)), **experts}
    for name in [n for n in converted if n.endswith("feed_forward.router.weight")]:
        converted[name.replace("router.weight", "expert_bias")] = torch.zeros(converted[name].shape[0])
    return converted


def _unfused(state_dict: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """Qwen3-Next's fused Gated DeltaNet projections as Qwen3.5's: each key head's group of rows
    regrouped (rows move whole: hf_reader.py runs this on row numbers)."""
    hk, dk, dv = (config[k] for k in ("linear_num_key_heads", "linear_key_head_dim", "linear_value_head_dim"))
    r = config["linear_num_value_heads"] // hk
    out = {}
    for name, w in state_dict.items():
        match = _FUSED.fullmatch(name)
        if match is None:
            out[name] = w
            continue
        prefix = f"model.layers.{match.group(1)}.linear_attn.in_proj_"
        groups = w.view(hk, -1, *w.shape[1:])
        if match.group(2) == "qkvz":
            q, k, v, z = groups.split([dk, dk, r * dv, r * dv], dim=1)
            out[prefix + "qkv.weight"] = torch.cat([t.flatten(0, 1) for t in (q, k, v)])
            out[prefix + "z.weight"] = z.flatten(0, 1)
        else:
            b, a = groups.split([r, r], dim=1)
            out[prefix + "b.weight"], out[prefix + "a.weight"] = b.flatten(0, 1), a.flatten(0, 1)
    return out


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
    Qwen3.5's with each layer's dense SwiGLU replaced by its router, shared expert and experts; in a
    vision-language folder, its text model's; in Qwen3-Next's, the fused projections."""
    next_ = config.get("model_type") == NEXT
    if next_ and (config.get("mlp_only_layers") or (config.get("decoder_sparse_step") or 1) != 1):
        raise ConfigError(
            "model.name: this Qwen3-Next folder has dense layers (mlp_only_layers, decoder_sparse_step), "
            "which qwen3_5_moe has no place for; give one with experts in every layer"
        )
    text = dense.hf_tensors({**config, "language_model": False}, mtp_layers)
    names = [n for n in text if not n.endswith(tuple(f".{m}" for m in DENSE_MLP))]
    for layer in range(config["num_hidden_layers"]):
        names += [f"model.layers.{layer}.{name}" for name in MOE]
        names += [
            f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"
            for e in range(config["num_experts"])
            for proj in EXPERTS.values()
        ]
    if next_:
        fused = {"in_proj_qkv.weight": "in_proj_qkvz.weight", "in_proj_b.weight": "in_proj_ba.weight"}
        dropped = ("in_proj_z.weight", "in_proj_a.weight")
        names = [n for n in names if not n.endswith(dropped)]
        names = [_fused_name(n, fused) for n in names]
    return in_folder(names, config)


def _fused_name(name: str, fused: dict[str, str]) -> str:
    """`name` with a Qwen3.5 projection's tensor name replaced by Qwen3-Next's fused one."""
    for split, joined in fused.items():
        if name.endswith("." + split):
            return name.removesuffix(split) + joined
    return name


def skipped(config: dict, mtp_layers: int = 0) -> dict:
    """A vision-language folder's vision encoder (its MTP head is every family's `SKIPPED`)."""
    return dense.skipped(config, mtp_layers)


def check_flavor(config: dict, model_args: Qwen35MoeModelArgs, where: str) -> None:
    """Qwen3.5's checks (RoPE, layer types), and the folder's norm_topk_prob (Qwen3-Next's) the flavour's."""
    dense.check_flavor(config, model_args, where)
    if config.get("norm_topk_prob", True) != model_args.norm_topk_prob:
        raise ConfigError(
            f"model.flavor: {where}'s config.json has norm_topk_prob {config.get('norm_topk_prob')}, the "
            f"flavour {model_args.norm_topk_prob}; set model.flavor to one with the folder's routing"
        )
