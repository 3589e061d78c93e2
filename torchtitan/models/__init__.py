"""The model registry: model.name -> its flavours, and the arguments a job builds its model with.

Torch-free, so that the preflight checks a flavour and its shape before any worker starts."""

from dataclasses import replace

from torchtitan.config_manager import ConfigError, JobConfig, ModelConfig
from torchtitan.models.llama import ModelArgs, llama2_configs, llama3_configs

MODEL_FLAVORS: dict[str, dict[str, ModelArgs]] = {"llama2": llama2_configs, "llama3": llama3_configs}


def flavor_args(model_config: ModelConfig) -> ModelArgs:
    """The shared table entry of the job's flavour (do not change it: `build_model_args` copies)."""
    flavors = MODEL_FLAVORS[model_config.name]
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


def build_model_args(job_config: JobConfig, tokenizer_words: int) -> ModelArgs:
    """A copy of the job's flavour with the vocabulary and context it trains with."""
    return replace(
        flavor_args(job_config.model),
        vocab_size=vocab_size(job_config.model, tokenizer_words),
        max_seq_len=job_config.training.seq_len,
    )
