"""A job's optimizer (AdamW, Adam, or Muon with AdamW for the rest: muon.py) and its learning-rate
schedule."""

import math

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from torchtitan.config.options import LRSchedulerConfig, OptimizerConfig
from torchtitan.optimizers.muon import Muon, is_muon_parameter


def build_optimizer(
    model_parts: nn.Module | list[nn.Module], optimizer_config: OptimizerConfig
) -> torch.optim.Optimizer:
    """One optimizer over the parameters of the model, or of all the pipeline stages a rank holds."""
    parts = model_parts if isinstance(model_parts, list) else [model_parts]
    kwargs = {
        "lr": optimizer_config.lr,
        "betas": (optimizer_config.beta1, optimizer_config.beta2),
        "eps": optimizer_config.eps,
        "weight_decay": optimizer_config.weight_decay,
        "foreach": optimizer_config.implementation == "foreach",
        "fused": optimizer_config.implementation == "fused",
    }
    if optimizer_config.name != "Muon":
        optimizer_cls = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}[optimizer_config.name]
        return optimizer_cls([p for part in parts for p in part.parameters()], **kwargs)
    named = [(name, p) for part in parts for name, p in part.named_parameters()]
    return Muon(
        [p for name, p in named if is_muon_parameter(name, p)],
        [p for name, p in named if not is_muon_parameter(name, p)],
        muon_lr=optimizer_config.lr if optimizer_config.muon_lr is None else optimizer_config.muon_lr,
        momentum=optimizer_config.muon_momentum,
        nesterov=optimizer_config.muon_nesterov,
        muon_weight_decay=(
            optimizer_config.weight_decay
            if optimizer_config.muon_weight_decay is None
            else optimizer_config.muon_weight_decay
        ),
        scale=optimizer_config.muon_scale,
        ns_steps=optimizer_config.muon_ns_steps,
        ns_dtype=getattr(torch, optimizer_config.muon_ns_dtype),
        **kwargs,
    )


def lr_multiplier(step: int, total_steps: int, lr_scheduler_config: LRSchedulerConfig) -> float:
    """Warmup, stable, decay (WSD): the factor applied to the peak learning rate before `step`+1.

    `step` counts optimizer steps already taken, so the first step uses a small non-zero rate."""
    schedule = lr_scheduler_config
    warmup = min(schedule.warmup_steps, total_steps)
    decay = (
        total_steps - warmup if schedule.decay_ratio is None else round(total_steps * schedule.decay_ratio)
    )
    stable_end = total_steps - decay
    step += 1
    if step <= warmup:
        return step / (warmup + 1)
    if step <= stable_end:
        return 1.0
    progress = (step - stable_end) / max(decay, 1)
    if schedule.decay_type == "linear":
        shape = 1.0 - progress
    elif schedule.decay_type == "sqrt":
        shape = 1.0 - math.sqrt(progress)
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return schedule.lr_min + (1.0 - schedule.lr_min) * shape


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, lr_scheduler_config: LRSchedulerConfig, total_steps: int
) -> LambdaLR:
    """The schedule's arguments are checked by torchtitan.config_rules.check_lr_schedule."""
    return LambdaLR(optimizer, lambda step: lr_multiplier(step, total_steps, lr_scheduler_config))
