"""The model registry: model.name -> its family's spec (torchtitan/models/spec.py), and the arguments a
job builds its model with.

Torch-free, so that the preflight checks a flavour and its shape before any worker starts."""

from dataclasses import replace

from torchtitan.config.options import ConfigError, JobConfig, ModelConfig
from torchtitan.models.llama import llama2_configs, llama3_configs
from torchtitan.models.qwen3 import qwen3_configs
from torchtitan.models.qwen3_moe import moe_flops_per_token, qwen3_moe_configs
from torchtitan.models.spec import ModelArgs, ModelSpec


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
}


def model_spec(model_config: ModelConfig) -> ModelSpec:
    return MODEL_SPECS[model_config.name]


def flavor_args(model_config: ModelConfig) -> ModelArgs:
    """The shared table entry of the job's flavour (do not change it: `build_model_args` copies)."""
    flavors = model_spec(model_config).flavors
    if model_config.flavor not in flavors:
        raise ConfigError(
            f"model.flavor: {model_config.name} has no flavor {model_config.flavor!r}; "
            f"choose one of {', '.join(flavors)}"
        )
    return flavors[model_config.flavor]


def vocab_size(model_config: ModelConfig, tokenizer_words: int) -> int:
    """Embedding and output rows: the tokenizer's vocabulary, padded up to model.vocab_size."""
    if 0 < model_config.vocab_size < tokenizer_words:
        raise ConfigError(
            f"model.vocab_size: {model_config.vocab_size} is smaller than the tokenizer's {tokenizer_words} "
            "tokens; use -1 or a larger value"
        )
    return max(model_config.vocab_size, tokenizer_words)


def build_model_args(
    job_config: JobConfig, tokenizer_words: int, eos_id: int | None = None, bos_id: int | None = None
) -> ModelArgs:
    """A copy of the job's flavour with the vocabulary, context and attention mask it trains with
    (block_causal finds the documents by the tokenizer's `eos_id` and `bos_id`)."""
    mask = job_config.model.attn_mask_type
    if mask == "block_causal" and eos_id is None:
        raise ConfigError("model.attn_mask_type: block_causal needs the tokenizer's EOS id; use causal")
    return replace(
        flavor_args(job_config.model),
        vocab_size=vocab_size(job_config.model, tokenizer_words),
        max_seq_len=job_config.training.seq_len,
        attn_mask_type=mask,
        eos_id=eos_id,
        bos_id=bos_id,
    )
