"""Qwen3.5 (dense) weights between this repository's names and Hugging Face transformers'
(`Qwen3_5ForCausalLM`, a text-only folder: model_type "qwen3_5_text").

Only the names differ, by a table: Gated DeltaNet's parameters keep transformers' names under
`linear_attn` (ours: the block's `attention`), the gated attention's are Qwen3's (wq -> q_proj, ...,
wq's rows already per head [query | gate] as transformers' q_proj); in_proj_qkv's rows and the conv's
channels are reordered, grouped by key head in ours (gated_deltanet.py's `grouped_by_key_head`: how
tensor parallelism splits them by head). Which layers are which is config.json's `layer_types`, checked
against the flavour's. The released checkpoints are vision-language folders (model_type "qwen3_5", the
text model's settings under `text_config`): their text model is read from `model.language_model.*`, the
vision encoder (`model.visual.*`) and the MTP head (`mtp.*`) left out and named."""

import torch

from torchtitan.config.options import ConfigError
from torchtitan.models.hf_convert import (
    VISION,
    RowOrder,
    check_rope,
    decoder_config,
    expected_tensors,
    from_hf_names,
    in_folder,
    text_model,
    to_hf_names,
)
from torchtitan.models.qwen3.hf_convert import NAMES as QWEN3_NAMES
from torchtitan.models.qwen3_5 import FULL_ATTENTION, LINEAR_ATTENTION, Qwen35ModelArgs
from torchtitan.models.qwen3_5.gated_deltanet import grouped_by_key_head

MODEL_TYPE = "qwen3_5_text"
ALSO_READS = ("qwen3_5",)  # the released vision-language folders

# Gated DeltaNet's tensors, the same after "attention." (ours) and "linear_attn." (HF's).
GATED_DELTANET = (
    "in_proj_qkv.weight",
    "in_proj_z.weight",
    "in_proj_b.weight",
    "in_proj_a.weight",
    "conv1d.weight",
    "A_log",
    "dt_bias",
    "norm.weight",
    "out_proj.weight",
)
ATTENTION = tuple(
    f"self_attn.{name}.weight" for name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
)

# Ours -> HF; "{}" is a layer number. Qwen3's (its attention, SwiGLU, norms) and Gated DeltaNet's.
NAMES = {
    **QWEN3_NAMES,
    **{f"layers.{{}}.attention.{name}": f"model.layers.{{}}.linear_attn.{name}" for name in GATED_DELTANET},
}


def layer_types(config: dict) -> list[str]:
    """config.json's `layer_types`, or transformers' default from `full_attention_interval` (4)."""
    if config.get("layer_types") is not None:
        return list(config["layer_types"])
    interval = config.get("full_attention_interval", 4)
    return [
        FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION
        for i in range(config["num_hidden_layers"])
    ]


def key_head_rows(n_key_heads: int, key_dim: int, inverse: bool) -> RowOrder:
    """in_proj_qkv's rows and the conv's channels between HF's order and ours (grouped by key head)."""

    def rows(name: str, w: torch.Tensor) -> torch.Tensor:
        if name.endswith(("attention.in_proj_qkv.weight", "attention.conv1d.weight")):
            return grouped_by_key_head(w, n_key_heads, key_dim, inverse)
        return w

    return rows


def folder_rows(config: dict) -> RowOrder:
    """HF's row order to ours for a folder of `config` (transformers' defaults where it leaves them out)."""
    return key_head_rows(
        config.get("linear_num_key_heads", 16), config.get("linear_key_head_dim", 128), False
    )


def to_hf(state_dict: dict[str, torch.Tensor], model_args: Qwen35ModelArgs) -> dict[str, torch.Tensor]:
    """Our model's state dict -> HF Qwen3_5ForCausalLM's."""
    rows = key_head_rows(model_args.linear_n_key_heads, model_args.linear_key_head_dim, inverse=True)
    return to_hf_names(state_dict, NAMES, model_args.tie_word_embeddings, rows)


def from_hf(state_dict: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """HF Qwen3_5ForCausalLM's state dict (or a vision-language folder's text model) -> our model's; a
    tied model's lm_head becomes a copy of the embeddings."""
    return from_hf_names(text_model(state_dict, config), NAMES, folder_rows(config))


def _rope(model_args: Qwen35ModelArgs) -> dict:
    return {
        "rope_type": "default",
        "rope_theta": float(model_args.rope_theta),
        "partial_rotary_factor": model_args.partial_rotary_factor,
    }


def hf_config(
    model_args: Qwen35ModelArgs,
    state_dict: dict[str, torch.Tensor],
    max_position_embeddings: int,
    dtype: torch.dtype,
) -> dict:
    """config.json of the HF model (less "architectures", the spec's): the layer types listed."""
    config = {
        "model_type": MODEL_TYPE,
        **decoder_config(model_args, state_dict, max_position_embeddings, dtype),
        "rope_parameters": _rope(model_args),
        "linear_num_key_heads": model_args.linear_n_key_heads,
        "linear_num_value_heads": model_args.linear_n_value_heads,
        "linear_key_head_dim": model_args.linear_key_head_dim,
        "linear_value_head_dim": model_args.linear_value_head_dim,
        "linear_conv_kernel_dim": model_args.linear_conv_kernel,
    }
    del config["rope_theta"]  # in rope_parameters
    config["layer_types"] = [model_args.layer_type(i) for i in range(config["num_hidden_layers"])]
    return config


def hf_tensors(config: dict, mtp_layers: int = 0) -> list[str]:
    """Every tensor a Qwen3_5ForCausalLM folder of `config` holds (hf_reader.py refuses one missing), or
    of its text model in a vision-language folder."""
    names = expected_tensors(config, config["num_hidden_layers"], ())
    for layer, kind in enumerate(layer_types(config)):
        own = ATTENTION if kind == FULL_ATTENTION else tuple(f"linear_attn.{n}" for n in GATED_DELTANET)
        names += [f"model.layers.{layer}.{name}" for name in own]
    return in_folder(names, config)


def skipped(config: dict, mtp_layers: int = 0) -> dict:
    """A vision-language folder's vision encoder (its MTP head is every family's `SKIPPED`)."""
    return VISION


def check_flavor(config: dict, model_args: Qwen35ModelArgs, where: str) -> None:
    """The folder's RoPE (theta, the rotated share of the head) and layer types are the flavour's."""
    check_rope(config, {"rope_parameters": _rope(model_args)}, where)
    rope = config.get("rope_parameters") or {}
    factor = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25))
    if factor != model_args.partial_rotary_factor:
        raise ConfigError(
            f"model.flavor: {where}'s config.json has partial_rotary_factor {factor}, the flavour "
            f"{model_args.partial_rotary_factor}; set model.flavor to one with the folder's RoPE"
        )
    ours = [model_args.layer_type(i) for i in range(config["num_hidden_layers"])]
    if layer_types(config) != ours:
        raise ConfigError(
            f"model.flavor: {where}'s config.json has layer_types {layer_types(config)}, the flavour "
            f"{ours}; set model.flavor to one with the folder's layer types"
        )
