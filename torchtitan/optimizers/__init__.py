"""Optimizers and the learning-rate schedule (docs/optimizers.md): `build.py` builds a job's optimizer
(AdamW, Adam or Muon, from `[optimizer]`) and its warmup-stable-decay schedule; `muon.py` is Muon for
the blocks' matrices with AdamW for the rest, in one optimizer, on every layout. Callers import what
they use from the package."""

from torchtitan.optimizers.build import build_lr_scheduler, build_optimizer
from torchtitan.optimizers.muon import Muon

__all__ = ["Muon", "build_lr_scheduler", "build_optimizer"]
