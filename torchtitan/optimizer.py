"""Optimizer and learning-rate schedule."""

import math

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from torchtitan.config_manager import ConfigError, LRScheduler, Optimizer


def build_optimizer(model_parts: nn.Module | list[nn.Module], cfg: Optimizer) -> torch.optim.Optimizer:
    """One optimizer over the parameters of the model, or of all the pipeline stages a rank holds."""
    parts = model_parts if isinstance(model_parts, list) else [model_parts]
    kwargs = {
        "lr": cfg.lr,
        "betas": (cfg.beta1, cfg.beta2),
        "eps": cfg.eps,
        "weight_decay": cfg.weight_decay,
        "foreach": cfg.implementation == "foreach",
        "fused": cfg.implementation == "fused",
    }
    optimizer_cls = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}[cfg.name]
    return optimizer_cls([p for part in parts for p in part.parameters()], **kwargs)


def lr_multiplier(step: int, total_steps: int, cfg: LRScheduler) -> float:
    """Warmup, stable, decay (WSD): the factor applied to the peak learning rate before `step`+1.

    `step` counts optimizer steps already taken, so the first step uses a small non-zero rate."""
    warmup = min(cfg.warmup_steps, total_steps)
    decay = total_steps - warmup if cfg.decay_ratio is None else round(total_steps * cfg.decay_ratio)
    stable_end = total_steps - decay
    step += 1
    if step <= warmup:
        return step / (warmup + 1)
    if step <= stable_end:
        return 1.0
    progress = (step - stable_end) / max(decay, 1)
    if cfg.decay_type == "linear":
        shape = 1.0 - progress
    elif cfg.decay_type == "sqrt":
        shape = 1.0 - math.sqrt(progress)
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.lr_min + (1.0 - cfg.lr_min) * shape


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: LRScheduler, total_steps: int) -> LambdaLR:
    if cfg.decay_ratio is not None and cfg.decay_ratio > 1:
        raise ConfigError(f"lr_scheduler.decay_ratio: must be between 0 and 1, got {cfg.decay_ratio}")
    if cfg.decay_ratio is not None and cfg.warmup_steps + round(total_steps * cfg.decay_ratio) > total_steps:
        raise ConfigError(
            "lr_scheduler: warmup_steps + decay_ratio * training.steps exceeds training.steps; "
            "lower warmup_steps or decay_ratio"
        )
    return LambdaLR(optimizer, lambda step: lr_multiplier(step, total_steps, cfg))
