"""What a checkpoint holds of a run: the Stateful parts DCP saves and restores (model, optimizer, LR
schedule, step, RNG; the data loader is its own), and the record of the model it holds."""

import hashlib
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan.config.options import ModelConfig
from torchtitan.config.paths import resolve_path


def merge_model_parts(model_parts: list[nn.Module]) -> nn.Module:
    """One module over the pipeline stages a rank holds, with the FQNs of the whole model: the
    parts' children under their own names, ModuleDicts (the `layers`) merged. DCP's state-dict
    functions take a single module, and a single one must own all the optimizer's parameters."""
    if len(model_parts) == 1:
        return model_parts[0]
    merged = nn.Module()
    for part in model_parts:
        for name, child in part.named_children():
            if isinstance(child, nn.ModuleDict):
                if name not in merged._modules:
                    merged.add_module(name, nn.ModuleDict())
                merged.get_submodule(name).update(child)
            elif name in merged._modules:
                raise ValueError(f"two model parts hold {name!r}")
            else:
                merged.add_module(name, child)
    return merged


class ModelState(Stateful):
    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict)


class OptimizerState(Stateful):
    """Flattened ('state.<fqn>.exp_avg', 'param_groups.<fqn>.lr'): keyed by parameter FQN only, so
    pipeline ranks, which hold different parameters, do not collide on 'param_groups.0'."""

    options = StateDictOptions(flatten_optimizer_state_dict=True)

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer, options=self.options)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(
            self.model, self.optimizer, optim_state_dict=state_dict, options=self.options
        )


class SchedulerState(Stateful):
    """Only the step count: the schedule itself comes from the config."""

    def __init__(self, scheduler: torch.optim.lr_scheduler.LambdaLR) -> None:
        self.scheduler = scheduler

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": torch.tensor(self.scheduler.last_epoch, dtype=torch.int64)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        s = self.scheduler
        s.last_epoch = int(state_dict["last_epoch"])
        s._last_lr = [base * fn(s.last_epoch) for base, fn in zip(s.base_lrs, s.lr_lambdas)]
        for group, lr in zip(s.optimizer.param_groups, s._last_lr):
            group["lr"] = lr


class TrainState(Stateful):
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step, dtype=torch.int64)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])


class RNGState(Stateful):
    """This rank's random generators: torch's CPU one and, on CUDA, the current device's.

    Saved under a per-rank key, as ranks may draw different numbers (e.g. dropout on different data)."""

    def __init__(self) -> None:
        self.key = f"rank_{dist.get_rank() if dist.is_initialized() else 0}"

    def state_dict(self) -> dict[str, Any]:
        states = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            states["cuda"] = torch.cuda.get_rng_state()
        return {self.key: states}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        states = state_dict[self.key]
        torch.set_rng_state(states["cpu"])
        if "cuda" in states:
            torch.cuda.set_rng_state(states["cuda"])


RECORD = "model_record"  # the state-dict key of a checkpoint's model record


def tokenizer_sha256(tokenizer_path: str) -> str:
    """The SHA-256 of a model.tokenizer_path's file (a Hugging Face folder's tokenizer.json)."""
    tokenizer = resolve_path(tokenizer_path)
    if os.path.isdir(tokenizer):  # a Hugging Face tokenizer folder
        tokenizer = os.path.join(tokenizer, "tokenizer.json")
    with open(tokenizer, "rb") as f:  # a few MB at most
        return hashlib.sha256(f.read()).hexdigest()


def model_record(model_config: ModelConfig, chat_template: str | None = None) -> dict[str, str]:
    """What every checkpoint records of the model it holds: the weights of models of the same shapes
    (llama2's and llama3's debug models, llama3's 8B and 3.1_8B) would load into one another silently,
    and so would a model into a run with another tokenizer of the same vocabulary size. A chat run's
    `chat_template` too (its source), which the model learnt to answer in: its export carries it."""
    record = {
        "name": model_config.name,
        "flavor": model_config.flavor,
        "tokenizer_sha256": tokenizer_sha256(model_config.tokenizer_path),
        "tokenizer_path": model_config.tokenizer_path,  # as the job gave it: what an export copies
    }
    return record if chat_template is None else {**record, "chat_template": chat_template}
