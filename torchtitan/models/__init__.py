"""The model registry: model.name -> its family's spec (torchtitan/models/spec.py), and the arguments a
job builds its model with.

Torch-free, so that the preflight checks a flavour and its shape before any worker starts."""

import os
from dataclasses import replace

from torchtitan.config.options import ConfigError, JobConfig, ModelConfig
from torchtitan.config.paths import read_json
from torchtitan.models.deepseek_v3 import deepseek_flops_per_token, deepseek_v3_configs
from torchtitan.models.llama import llama2_configs, llama3_configs
from torchtitan.models.qwen3 import qwen3_configs
from torchtitan.models.qwen3_5 import qwen3_5_configs, qwen3_5_flops_per_token
from torchtitan.models.qwen3_5_moe import qwen3_5_moe_configs, qwen3_5_moe_flops_per_token
from torchtitan.models.qwen3_moe import moe_flops_per_token, qwen3_moe_configs
from torchtitan.models.spec import ModelArgs, ModelSpec

HF_CONFIG = "config.json"  # what makes a folder a Hugging Face model's
# A vision-language folder (Qwen3.5's released checkpoints) holds its text model's settings under this
# key of config.json, and the text model's tensors under "model.language_model." instead of "model.".
TEXT_CONFIG = "text_config"


def _llama(name: str, flavors: dict) -> ModelSpec:
    return ModelSpec(
        name=name,
        flavors=flavors,
        model="torchtitan.models.llama.model:Transformer",
        tp_plan="torchtitan.models.llama.tp_plan:llama_block_plan",
        hf_adapter="torchtitan.models.llama.hf_convert",
        hf_architecture="LlamaForCausalLM",
    )


MODEL_SPECS: dict[str, ModelSpec] = {
    "llama2": _llama("llama2", llama2_configs),
    "llama3": _llama("llama3", llama3_configs),
    "qwen3": ModelSpec(
        name="qwen3",
        flavors=qwen3_configs,
        model="torchtitan.models.qwen3.model:Transformer",
        tp_plan="torchtitan.models.qwen3.tp_plan:qwen3_block_plan",
        hf_adapter="torchtitan.models.qwen3.hf_convert",
        hf_architecture="Qwen3ForCausalLM",
    ),
    "qwen3_moe": ModelSpec(
        name="qwen3_moe",
        flavors=qwen3_moe_configs,
        model="torchtitan.models.qwen3_moe.model:Transformer",
        tp_plan="torchtitan.models.qwen3.tp_plan:qwen3_block_plan",
        hf_adapter="torchtitan.models.qwen3_moe.hf_convert",
        hf_architecture="Qwen3MoeForCausalLM",
        flops_per_token=moe_flops_per_token,
        moe=True,
    ),
    "qwen3_5": ModelSpec(
        name="qwen3_5",
        flavors=qwen3_5_configs,
        model="torchtitan.models.qwen3_5.model:Transformer",
        tp_plan="torchtitan.models.qwen3_5.tp_plan:qwen3_5_block_plan",
        hf_adapter="torchtitan.models.qwen3_5.hf_convert",
        hf_architecture="Qwen3_5ForCausalLM",
        flops_per_token=qwen3_5_flops_per_token,
    ),
    "qwen3_5_moe": ModelSpec(
        name="qwen3_5_moe",
        flavors=qwen3_5_moe_configs,
        model="torchtitan.models.qwen3_5_moe.model:Transformer",
        tp_plan="torchtitan.models.qwen3_5.tp_plan:qwen3_5_block_plan",
        hf_adapter="torchtitan.models.qwen3_5_moe.hf_convert",
        hf_architecture="Qwen3_5MoeForCausalLM",
        flops_per_token=qwen3_5_moe_flops_per_token,
        moe=True,
    ),
    "deepseek_v3": ModelSpec(
        name="deepseek_v3",
        flavors=deepseek_v3_configs,
        model="torchtitan.models.deepseek_v3.model:Transformer",
        tp_plan="torchtitan.models.deepseek_v3.tp_plan:deepseek_v3_block_plan",
        hf_adapter="torchtitan.models.deepseek_v3.hf_convert",
        hf_architecture="DeepseekV3ForCausalLM",
        flops_per_token=deepseek_flops_per_token,
        moe=True,
        hf_expert_bias=True,
        mtp=True,
    ),
}


def text_config(config: dict) -> dict:
    """The text model's settings of a config.json: a vision-language folder's `text_config`, with the
    folder's model_type and tie_word_embeddings and `language_model` True (where its tensors are);
    any other config.json as it is."""
    text = config.get(TEXT_CONFIG)
    if not isinstance(text, dict):
        return config
    tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    return {
        **text,
        "model_type": config.get("model_type"),
        "tie_word_embeddings": tied,
        "language_model": True,
    }


def model_spec(model_config: ModelConfig) -> ModelSpec:
    return MODEL_SPECS[model_config.name]


def flavor_args(model_config: ModelConfig) -> ModelArgs:
    """The job's flavour, on `model.n_layers` blocks where set (the shared table entry otherwise: do not
    change it, `build_model_args` copies)."""
    flavors = model_spec(model_config).flavors
    if model_config.flavor not in flavors:
        raise ConfigError(
            f"model.flavor: {model_config.name} has no flavor {model_config.flavor!r}; "
            f"choose one of {', '.join(flavors)}"
        )
    args = flavors[model_config.flavor]
    return replace(args, n_layers=model_config.n_layers) if model_config.n_layers else args


def hf_vocab_size(path: str | None) -> int | None:
    """The vocabulary of the Hugging Face folder a run starts from (checkpoint.initial_load_path: its
    config.json's vocab_size), None for another checkpoint or none. The Hub's models pad it beyond
    their tokenizer's ids (Qwen3: 151,936 rows for 151,669 ids)."""
    config_path = os.path.join(path, HF_CONFIG) if path is not None else ""
    if not os.path.isfile(config_path):
        return None
    config = read_json("checkpoint.initial_load_path", config_path)
    words = text_config(config).get("vocab_size") if isinstance(config, dict) else None
    if not isinstance(words, int) or words < 1:
        raise ConfigError(
            f"checkpoint.initial_load_path: {config_path} has no positive integer vocab_size; point it at a "
            "Hugging Face model folder"
        )
    return words


def vocab_size(job_config: JobConfig, tokenizer_words: int) -> int:
    """Embedding and output rows: model.vocab_size when set, else those of the Hugging Face folder the
    run starts from, else the tokenizer's vocabulary; never fewer than the tokenizer's ids."""
    model_config = job_config.model
    if 0 < model_config.vocab_size < tokenizer_words:
        raise ConfigError(
            f"model.vocab_size: {model_config.vocab_size} is smaller than the tokenizer's {tokenizer_words} "
            "tokens; use -1 or a larger value"
        )
    folder_words = hf_vocab_size(job_config.checkpoint.initial_load_path)
    if model_config.vocab_size != -1 or folder_words is None:
        return max(model_config.vocab_size, tokenizer_words)
    if folder_words < tokenizer_words:
        raise ConfigError(
            f"model.vocab_size: -1 takes the vocabulary of checkpoint.initial_load_path, whose "
            f"{folder_words} rows are fewer than the tokenizer's {tokenizer_words} ids; set "
            "model.tokenizer_path to the folder's tokenizer"
        )
    return folder_words


def build_model_args(
    job_config: JobConfig, tokenizer_words: int, eos_id: int | None = None, bos_id: int | None = None
) -> ModelArgs:
    """A copy of the job's flavour with the vocabulary, context and attention mask it trains with
    (block_causal finds the documents by the tokenizer's `eos_id` and `bos_id`)."""
    mask = job_config.model.attn_mask_type
    if mask == "block_causal" and eos_id is None:
        raise ConfigError("model.attn_mask_type: block_causal needs the tokenizer's EOS id; use causal")
    # Multi-token prediction depths, for the families that have them (config_rules.check_mtp).
    mtp = {"mtp_layers": job_config.model.mtp_layers} if model_spec(job_config.model).mtp else {}
    return replace(
        flavor_args(job_config.model),
        vocab_size=vocab_size(job_config, tokenizer_words),
        max_seq_len=job_config.training.seq_len,
        attn_mask_type=mask,
        eos_id=eos_id,
        bos_id=bos_id,
        **mtp,
    )
