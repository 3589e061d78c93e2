"""What every family's Hugging Face adapter (`torchtitan/models/<family>/hf_convert.py`, the spec's
`hf_adapter`) shares: renaming parameters by a table, the tied output layer, and the config.json keys
of any decoder built on Llama's transformer.

An adapter module has `MODEL_TYPE` (config.json's "model_type", by which convert_hf_to_dcp.py picks
it), `to_hf(state_dict, model_args)`, `from_hf(state_dict, config)` and
`hf_config(model_args, state_dict, max_position_embeddings, dtype)` (config.json, less
"architectures": that is the spec's `hf_architecture`) and `hf_tensors(config, mtp_layers)` (every
tensor a folder of that config.json holds: `expected_tensors`).
"""

import re
from collections.abc import Callable

import torch

from torchtitan.config.options import ConfigError
from torchtitan.models.spec import ModelArgs

# Tensors of HF folders that no family here has a place for, left out by name (the reader says which):
# their pattern -> what they are.
SKIPPED = {
    re.compile(r"(model\.)?mtp\..+"): "multi-token prediction",
    re.compile(r".+\.rotary_emb\.inv_freq"): "RoPE frequencies, which the model computes",
}

# A vision-language folder's text model (config.json's `language_model`: models/__init__.py's text_config)
# under this prefix instead of "model.", its vision encoder under VISION (left out).
LANGUAGE_MODEL = "model.language_model."
VISION = {re.compile(r"model\.visual\..+"): "vision encoder"}


def in_folder(names: list[str], config: dict) -> list[str]:
    """A text model's tensor names as the folder of `config` holds them (a vision-language folder: the
    text model's under LANGUAGE_MODEL)."""
    if not config.get("language_model"):
        return names
    return [LANGUAGE_MODEL + n.removeprefix("model.") if n.startswith("model.") else n for n in names]


def text_model(state_dict: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """The folder's tensors (of `config`) under the text model's names: `in_folder` undone."""
    if not config.get("language_model"):
        return state_dict
    return {
        "model." + n.removeprefix(LANGUAGE_MODEL) if n.startswith(LANGUAGE_MODEL) else n: w
        for n, w in state_dict.items()
    }


# (our parameter name, its tensor in the source layout) -> the tensor in the target layout.
RowOrder = Callable[[str, torch.Tensor], torch.Tensor]


def _as_is(name: str, w: torch.Tensor) -> torch.Tensor:
    return w


def rename(name: str, table: dict[str, str]) -> str:
    """`name` through `table`, whose keys and values have "{}" where a layer number goes."""
    layer = re.search(r"layers\.(\d+)\.", name)
    pattern = name.replace(layer.group(0), "layers.{}.", 1) if layer else name
    if pattern not in table:
        raise KeyError(f"no parameter named {name!r} in this model family")
    return table[pattern].format(layer.group(1)) if layer else table[pattern]


def to_hf_names(
    state_dict: dict[str, torch.Tensor], names: dict[str, str], tied: bool, rows: RowOrder = _as_is
) -> dict[str, torch.Tensor]:
    """Our state dict -> HF's, renamed by `names` (ours -> HF's), each tensor through `rows`. A tied
    output layer is left out: HF's tied models have no lm_head.weight in their files."""
    return {
        rename(name, names): rows(name, w).contiguous()
        for name, w in state_dict.items()
        if not (tied and name == "output.weight")
    }


def from_hf_names(
    state_dict: dict[str, torch.Tensor], names: dict[str, str], rows: RowOrder = _as_is
) -> dict[str, torch.Tensor]:
    """HF's state dict -> ours, renamed by the inverse of `names` (ours -> HF's), each tensor through
    `rows`. A tied model's missing lm_head becomes output.weight, a copy of the embeddings: our state
    dict has both keys, tied or not, so the checkpoint starts a tied run and an untied one alike."""
    inverse = {hf: ours for ours, hf in names.items()}
    converted = {}
    for hf_name, w in state_dict.items():
        name = rename(hf_name, inverse)
        converted[name] = rows(name, w).contiguous()
    if "output.weight" not in converted:
        converted["output.weight"] = converted["tok_embeddings.weight"].clone()
    return converted


# Our stacked experts' weights [experts, out, in] -> the Hub's per-expert Linear of each (Qwen3-MoE's and
# DeepSeek-V3's files: `model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`).
EXPERTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_OUR_EXPERTS = re.compile(r"layers\.(\d+)\.feed_forward\.experts\.(w[123])")
_HF_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+_proj)\.weight")


def experts_to_hf(state_dict: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """Our state dict -> (its tensors other than the experts, the experts as HF's per-expert Linears)."""
    rest, experts = {}, {}
    for name, w in state_dict.items():
        match = _OUR_EXPERTS.fullmatch(name)
        if match is None:
            rest[name] = w
            continue
        layer, ours = match.groups()
        for e, expert_w in enumerate(w.unbind(0)):
            experts[f"model.layers.{layer}.mlp.experts.{e}.{EXPERTS[ours]}.weight"] = expert_w.contiguous()
    return rest, experts


def experts_from_hf(state_dict: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """HF's state dict -> (its tensors other than the experts, each layer's experts stacked under our
    names, in expert order)."""
    ours_of = {hf: ours for ours, hf in EXPERTS.items()}
    rest, by_expert = {}, {}
    for name, w in state_dict.items():
        match = _HF_EXPERTS.fullmatch(name)
        if match is None:
            rest[name] = w
            continue
        layer, e, proj = match.groups()
        by_expert.setdefault(f"layers.{layer}.feed_forward.experts.{ours_of[proj]}", {})[int(e)] = w
    stacked = {name: torch.stack([ws[e] for e in range(len(ws))]) for name, ws in by_expert.items()}
    return rest, stacked


def decoder_config(
    model_args: ModelArgs,
    state_dict: dict[str, torch.Tensor],
    max_position_embeddings: int,
    dtype: torch.dtype,
) -> dict:
    """The config.json keys every family here shares. Sizes are read from our state dict (the vocabulary
    as padded), the rest from `model_args` (which also has `norm_eps` and `rope_theta`)."""
    vocab_size, dim = state_dict["tok_embeddings.weight"].shape
    dense_mlp = state_dict.get("layers.0.feed_forward.w1.weight")  # None where layer 0 holds experts
    return {
        "hidden_size": dim,
        "intermediate_size": dense_mlp.shape[0] if dense_mlp is not None else None,
        "num_hidden_layers": len({k.split(".")[1] for k in state_dict if k.startswith("layers.")}),
        "num_attention_heads": model_args.n_heads,
        "num_key_value_heads": model_args.n_kv_heads or model_args.n_heads,
        "head_dim": model_args.head_dim,
        "vocab_size": vocab_size,
        "rms_norm_eps": model_args.norm_eps,
        "rope_theta": float(model_args.rope_theta),
        "max_position_embeddings": max_position_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": model_args.tie_word_embeddings,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


# A decoder layer's norms and dense SwiGLU, as every family's files name them (after "model.layers.N.").
LAYER_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight")
DENSE_MLP = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


def expected_tensors(
    config: dict,
    layers: int,
    attention: tuple[str, ...],
    sparse: Callable[[int], bool] = lambda layer: False,
    moe: tuple[str, ...] = (),
    experts: int = 0,
) -> list[str]:
    """Every tensor a folder of `config` holds for the model (names after "model.layers.N." for the
    per-layer ones): embeddings, final norm, the head unless tied, and each of `layers` layers' norms,
    `attention`, and either the dense SwiGLU or, where `sparse(layer)`, the router's `moe` tensors and
    `experts` experts' Linears. A reader checks a folder against it, so a missing tensor is named."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.get("tie_word_embeddings", False):
        names.append("lm_head.weight")
    for layer in range(layers):
        own = [*LAYER_NORMS, *attention]
        if sparse(layer):
            own += [*moe, *(f"mlp.experts.{e}.{p}.weight" for e in range(experts) for p in EXPERTS.values())]
        else:
            own += DENSE_MLP
        names += [f"model.layers.{layer}.{name}" for name in own]
    return names


# The fields of each RoPE type a config.json may name (transformers' rope_type), beyond rope_theta.
ROPE_FIELDS = {
    "default": (),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": (
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
    ),
}


def rope_settings(config: dict) -> dict:
    """A config.json's RoPE: rope_type, rope_theta and the type's fields, read from `rope_parameters`
    (transformers 5) or `rope_scaling` and `rope_theta` (the Hub's), with transformers' defaults."""
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    fields = {key: rope.get(key) for key in ROPE_FIELDS.get(rope_type, ())}
    return {"rope_type": rope_type, "rope_theta": float(theta), **fields}


def check_rope(config: dict, flavour_config: dict, where: str) -> None:
    """The folder's config.json (`config`) rotates as the flavour does (`flavour_config`: what the export
    writes for it), else one line naming the first field that differs: a Llama 3 folder for a Llama 3.1
    flavour would train, and generate, with other positions than the folder's."""
    theirs, ours = rope_settings(config), rope_settings(flavour_config)
    fields = sorted((ours.keys() | theirs.keys()) - {"rope_type", "rope_theta"})
    for key in ["rope_type", "rope_theta", *fields]:
        if ours.get(key) != theirs.get(key):
            raise ConfigError(
                f"model.flavor: {where}'s config.json has RoPE {key} {theirs.get(key)}, the flavour "
                f"{ours.get(key)}; set model.flavor to one with the folder's RoPE"
            )
