"""DeepSeek-V3 weights between this repository's names and layout and Hugging Face transformers'
(`DeepseekV3ForCausalLM`; Kimi K2's and Moonlight's folders too), in the Hub's file layout: one Linear
per expert (`model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`), as transformers saves them.

Only names differ, and the experts are stacked: transformers' rope_interleave=True rotates interleaved
pairs as our complex RoPE does, so no rows are reordered. The routing bias is HF's
`mlp.gate.e_score_correction_bias`: unlike Qwen3-MoE's, it is saved and loaded.

Multi-token prediction: depth i's layer is DeepSeek's `model.layers.{N + i}` after the N decoder layers
(layer 61 of DeepSeek-V3), its block under the block's names, with `enorm`, `hnorm`, `eh_proj` and
`shared_head.norm`; DeepSeek's files also hold copies of the embeddings and the output head there
(`embed_tokens`, `shared_head.head`), which speculative decoders load: the export writes them, the import
skips them (the model shares the main ones). A folder's depths beyond model.mtp_layers are skipped on
load (all of them with mtp_layers 0), as transformers' DeepseekV3ForCausalLM skips them all.
"""

import re

import torch

from torchtitan.config.options import ConfigError
from torchtitan.models.deepseek_v3 import DeepSeekV3ModelArgs
from torchtitan.models.hf_convert import (
    EXPERTS,
    decoder_config,
    expected_tensors,
    experts_from_hf,
    experts_to_hf,
    from_hf_names,
    rope_settings,
    to_hf_names,
)
from torchtitan.models.llama.hf_convert import NAMES as LLAMA_NAMES

MODEL_TYPE = "deepseek_v3"

_ATTENTION = {
    "wq_a": "q_a_proj",
    "q_norm": "q_a_layernorm",
    "wq_b": "q_b_proj",
    "wkv_a": "kv_a_proj_with_mqa",
    "kv_norm": "kv_a_layernorm",
    "wkv_b": "kv_b_proj",
}
# Ours -> HF; "{}" is a layer number. Llama's names but its wk/wv, which MLA has not.
NAMES = {
    **{ours: hf for ours, hf in LLAMA_NAMES.items() if not re.search(r"\.w[kv]\.", ours)},
    **{
        f"layers.{{}}.attention.{o}.weight": f"model.layers.{{}}.self_attn.{h}.weight"
        for o, h in _ATTENTION.items()
    },
    "layers.{}.feed_forward.router.weight": "model.layers.{}.mlp.gate.weight",
    "layers.{}.feed_forward.expert_bias": "model.layers.{}.mlp.gate.e_score_correction_bias",
    "layers.{}.feed_forward.shared_expert.w1.weight": "model.layers.{}.mlp.shared_experts.gate_proj.weight",
    "layers.{}.feed_forward.shared_expert.w3.weight": "model.layers.{}.mlp.shared_experts.up_proj.weight",
    "layers.{}.feed_forward.shared_expert.w2.weight": "model.layers.{}.mlp.shared_experts.down_proj.weight",
}


# A multi-token prediction depth's own tensors, ours (after "mtp.{i}.") -> DeepSeek's (after
# "model.layers.{N + i}."); its block's are a decoder layer's.
MTP_NAMES = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "norm.weight": "shared_head.norm.weight",
}
# DeepSeek's copies of the shared embeddings and head in each depth's layer: ours -> theirs.
MTP_COPIES = {"tok_embeddings.weight": "embed_tokens.weight", "output.weight": "shared_head.head.weight"}
_OUR_MTP = re.compile(r"mtp\.(\d+)\.(block\.)?(.+)")


def to_hf(state_dict: dict[str, torch.Tensor], model_args: DeepSeekV3ModelArgs) -> dict[str, torch.Tensor]:
    """Our model's state dict (the routing bias included) -> HF DeepseekV3ForCausalLM's, multi-token
    prediction's depths as DeepSeek's layers N + i (with the copies of the embeddings and head)."""
    main, mtp = {}, {}
    for name, w in state_dict.items():
        match = _OUR_MTP.fullmatch(name)
        if match is None:
            main[name] = w
            continue
        depth, in_block, rest = match.groups()
        layer = model_args.n_layers + int(depth)
        if in_block:  # the block's tensors as decoder layer N + i's
            main[f"layers.{layer}.{rest}"] = w
        else:
            mtp[f"model.layers.{layer}.{MTP_NAMES[rest]}"] = w.contiguous()
    for depth in range(model_args.mtp_layers):
        for ours, theirs in MTP_COPIES.items():
            mtp[f"model.layers.{model_args.n_layers + depth}.{theirs}"] = state_dict[ours].clone()
    dense, experts = experts_to_hf(main)
    return {**to_hf_names(dense, NAMES, model_args.tie_word_embeddings), **experts, **mtp}


def from_hf(state_dict: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """HF DeepseekV3ForCausalLM's state dict (Hub layout; the MTP layers `skipped` leaves, as
    `mtp.{i}.*`) -> our model's, each MoE layer's experts stacked (`config`: its config.json)."""
    n_layers = config["num_hidden_layers"]
    main, mtp = {}, {}
    theirs_to_ours = {theirs: ours for ours, theirs in MTP_NAMES.items()}
    for name, w in state_dict.items():
        match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        if match is None or int(match.group(1)) < n_layers:
            main[name] = w
        elif match.group(2) in theirs_to_ours:
            mtp[f"mtp.{int(match.group(1)) - n_layers}.{theirs_to_ours[match.group(2)]}"] = w
        else:  # the depth's block, as a decoder layer's first
            main[name] = w
    dense, experts = experts_from_hf(main)
    converted = {**from_hf_names(dense, NAMES), **experts}
    for name in list(converted):  # the depths' blocks under their names
        layer = re.match(r"layers\.(\d+)\.", name)
        if layer and int(layer.group(1)) >= n_layers:
            depth = int(layer.group(1)) - n_layers
            converted[f"mtp.{depth}.block.{name[layer.end() :]}"] = converted.pop(name)
    return {**converted, **mtp}


def hf_tensors(config: dict, mtp_layers: int = 0) -> list[str]:
    """Every tensor a DeepseekV3ForCausalLM folder of `config` holds for a model of `mtp_layers` depths
    (hf_reader.py refuses one missing): the kept depths' blocks and own tensors, not their copies of the
    embeddings and head (which the model shares)."""
    first, depths = config["num_hidden_layers"], min(config.get("num_nextn_predict_layers") or 0, mtp_layers)
    q = ("q_proj",) if not config.get("q_lora_rank") else ("q_a_proj", "q_a_layernorm", "q_b_proj")
    attention = (*q, "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")
    moe = ["mlp.gate.weight", "mlp.gate.e_score_correction_bias"]
    if config.get("n_shared_experts", 1):
        moe += [f"mlp.shared_experts.{p}.weight" for p in EXPERTS.values()]
    experts = config.get("n_routed_experts", 256)
    dense = config.get("first_k_dense_replace", _HF_DEFAULTS["first_k_dense_replace"])
    freq = config.get("moe_layer_freq") or 1

    def sparse(layer: int) -> bool:
        return experts > 0 and layer >= dense and layer % freq == 0

    names = expected_tensors(
        config, first + depths, tuple(f"self_attn.{a}.weight" for a in attention), sparse, tuple(moe), experts
    )
    return names + [
        f"model.layers.{first + d}.{theirs}" for d in range(depths) for theirs in MTP_NAMES.values()
    ]


def skipped(config: dict, mtp_layers: int = 0) -> dict[re.Pattern, str]:
    """The folder's tensors this family has no place for, beyond every family's (hf_convert.SKIPPED):
    the multi-token prediction layers (numbered after the decoder's: DeepSeek-V3's layer 61) beyond the
    model's `mtp_layers`, and the kept ones' copies of the embeddings and head."""
    first, count = config["num_hidden_layers"], config.get("num_nextn_predict_layers") or 0
    patterns = {}
    if count > mtp_layers:
        layers = "|".join(str(first + i) for i in range(mtp_layers, count))
        patterns[re.compile(rf"model\.layers\.({layers})\..+")] = "multi-token prediction layers"
    if kept := min(count, mtp_layers):
        layers = "|".join(str(first + i) for i in range(kept))
        copies = "|".join(re.escape(theirs) for theirs in MTP_COPIES.values())
        patterns[re.compile(rf"model\.layers\.({layers})\.({copies})")] = (
            "multi-token prediction's copies of the embeddings and output head (shared here)"
        )
    return patterns


# transformers' DeepseekV3Config defaults (the 671B values), for the keys a config.json may leave out.
_HF_DEFAULTS = {
    "first_k_dense_replace": 3,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "rms_norm_eps": 1e-6,
}


def _settings(config: dict) -> dict:
    """What a config.json sets that the weights' shapes do not show, with transformers' defaults, its
    RoPE as `rope_settings` reads it."""
    settings = {key: config.get(key, default) for key, default in _HF_DEFAULTS.items()}
    return {**settings, **rope_settings(config)}


def check_flavor(config: dict, model_args: DeepSeekV3ModelArgs, where: str) -> None:
    """The folder's config.json computes what the flavour does beyond its shapes (the reader checks
    those): routing, norms' eps and RoPE; else one line naming the first difference (e.g. a Kimi K2
    folder of YaRN 64 for the flavour's 32), rather than training another model than the folder's."""
    # transformers' router is sigmoid whatever config.json's scoring_func says.
    ours = {**_settings(hf_config_settings(model_args)), "scoring": model_args.score_func}
    theirs = {**_settings(config), "scoring": "sigmoid"}
    for key in sorted(ours.keys() | theirs.keys()):
        if ours.get(key) != theirs.get(key):
            raise ConfigError(
                f"model.flavor: {where}'s config.json has {key} {theirs.get(key)}, the flavour "
                f"{ours.get(key)}; set model.flavor to one of the folder's settings"
            )


def hf_config_settings(model_args: DeepSeekV3ModelArgs) -> dict:
    """The config.json keys of `_settings` as the export writes them."""
    args = model_args
    return {
        "first_k_dense_replace": args.first_k_dense_replace,
        "num_experts_per_tok": args.top_k,
        "n_group": args.n_group,
        "topk_group": args.topk_group,
        "norm_topk_prob": args.norm_topk_prob,
        "routed_scaling_factor": args.routed_scaling_factor,
        "rms_norm_eps": args.norm_eps,
        "rope_parameters": rope_parameters(args),
    }


def rope_parameters(model_args: DeepSeekV3ModelArgs) -> dict:
    """transformers' rope_parameters: YaRN's, its cos/sin factor 1 (mscale = mscale_all_dim), or plain."""
    args = model_args
    if args.rope_factor <= 1:
        return {"rope_type": "default", "rope_theta": float(args.rope_theta)}
    return {
        "rope_type": "yarn",
        "rope_theta": float(args.rope_theta),
        "factor": float(args.rope_factor),
        "original_max_position_embeddings": args.original_seq_len,
        "beta_fast": float(args.beta_fast),
        "beta_slow": float(args.beta_slow),
        "mscale": float(args.mscale),
        "mscale_all_dim": float(args.mscale),
    }


def hf_config(
    model_args: DeepSeekV3ModelArgs,
    state_dict: dict[str, torch.Tensor],
    max_position_embeddings: int,
    dtype: torch.dtype,
) -> dict:
    """config.json of the HF model (less "architectures", the spec's). transformers' router is sigmoid
    only, so a softmax-routed model is refused; with YaRN the context is factor x the original (as in the
    released config.json files, and what transformers expects)."""
    args = model_args
    if args.score_func != "sigmoid":
        raise ConfigError(
            f"model.flavor: transformers' DeepseekV3 routes with sigmoid scores only, and this model with "
            f"{args.score_func}; it has no Hugging Face form"
        )
    config = decoder_config(args, state_dict, max_position_embeddings, dtype)
    del config["head_dim"], config["rope_theta"]  # transformers derives them (rope_parameters)
    if args.rope_factor > 1:
        max_position_embeddings = int(args.rope_factor * args.original_seq_len)
    return {
        "model_type": MODEL_TYPE,
        **config,
        "max_position_embeddings": max_position_embeddings,
        "intermediate_size": args.hidden_dim,
        **hf_config_settings(args),
        "q_lora_rank": args.q_lora_rank or None,
        "kv_lora_rank": args.kv_lora_rank,
        "qk_nope_head_dim": args.qk_nope_head_dim,
        "qk_rope_head_dim": args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim,
        "rope_interleave": True,
        "moe_intermediate_size": args.moe_hidden_dim,
        "n_routed_experts": args.num_experts,
        "n_shared_experts": args.n_shared_experts,
        "scoring_func": args.score_func,
        "topk_method": "noaux_tc",
        "num_nextn_predict_layers": args.mtp_layers,
    }
