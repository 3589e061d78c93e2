"""Distributed checkpoints (torch.distributed.checkpoint) of everything needed to continue a run.

A checkpoint is written to `step-N.tmp` and renamed to `step-N` once complete, so a folder named
`step-N` is always whole and a crash mid-save never costs the previous checkpoint."""

import os
import re
import shutil
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan.config_manager import ConfigError, JobConfig
from torchtitan.logging import logger

STEP_DIR = re.compile(r"^step-(\d+)$")


class ModelState(Stateful):
    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict)


class OptimizerState(Stateful):
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, optim_state_dict=state_dict)


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


def list_checkpoints(folder: str) -> list[int]:
    """Steps of the complete checkpoints in `folder`, oldest first."""
    if not os.path.isdir(folder):
        return []
    steps = [int(m.group(1)) for name in os.listdir(folder) if (m := STEP_DIR.match(name))]
    return sorted(s for s in steps if os.path.isfile(os.path.join(folder, f"step-{s}", ".metadata")))


class CheckpointManager:
    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: torch.optim.lr_scheduler.LRScheduler,
        dataloader: Stateful,
        train_state: TrainState,
        job_config: JobConfig,
    ) -> None:
        cfg = job_config.checkpoint
        self.enabled = cfg.enable_checkpoint
        self.interval = cfg.interval
        self.folder = os.path.join(job_config.job.dump_folder, cfg.folder)
        self.states = {
            "model": ModelState(model),
            "optimizer": OptimizerState(model, optimizer),
            "lr_scheduler": SchedulerState(lr_scheduler),
            "dataloader": dataloader,
            "train_state": train_state,
        }
        self.is_coordinator = not dist.is_initialized() or dist.get_rank() == 0

    def _barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def load(self) -> int | None:
        """Load the latest complete checkpoint, if any; returns its step."""
        if not self.enabled:
            return None
        steps = list_checkpoints(self.folder)
        if not steps:
            return None
        path = os.path.join(self.folder, f"step-{steps[-1]}")
        logger.info(f"Loading checkpoint {path}")
        try:
            dcp.load(self.states, checkpoint_id=path)
        except Exception as e:
            raise ConfigError(
                f"checkpoint: cannot load {path} ({str(e).strip().splitlines()[-1]}); it may come from a "
                "different model or layout: point job.dump_folder elsewhere or move the folder away"
            ) from e
        return steps[-1]

    def maybe_save(self, step: int, last_step: bool) -> None:
        if self.enabled and (step % self.interval == 0 or last_step):
            self.save(step)

    def save(self, step: int) -> None:
        final = os.path.join(self.folder, f"step-{step}")
        tmp = final + ".tmp"
        if self.is_coordinator:
            if os.path.exists(final):
                raise RuntimeError(f"checkpoint {final} already exists; refusing to overwrite it")
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        self._barrier()
        dcp.save(self.states, checkpoint_id=tmp)
        self._barrier()
        if self.is_coordinator:
            os.rename(tmp, final)
            logger.info(f"Saved checkpoint {final}")
        self._barrier()
