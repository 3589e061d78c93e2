"""What keeps a weeks-long run from losing work in the loop: preemption signals and non-finite steps.
The exit codes these lead to are listed in torchtitan/errors.py and the README."""

import math
import signal
from types import FrameType

import torch
import torch.distributed as dist

from torchtitan.errors import EXIT_PREEMPTED, NonFiniteError
from torchtitan.logging import logger

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """SIGTERM or SIGUSR1 (SLURM sends either before a job is killed) asks the run to stop at the end of
    a step, save a checkpoint and exit with EXIT_PREEMPTED.

    A signal may reach some ranks only, or at different moments, and every rank must stop at the same
    step (the save is collective). So each step, `agreed()` all-reduces a one-element flag over all
    ranks; to keep the host from waiting on the device, the result is read one step later. A signal
    therefore stops the run at the end of the step after the one it arrived in, at the latest.

    Until it is made (start-up: building the model and the data loader, loading a checkpoint), a
    signal stops the job at once, with nothing to save (entry.StoppedEarly)."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)
        self._flag: torch.Tensor | None = None
        self._result: torch.Tensor | None = None
        self._ready: torch.cuda.Event | None = None
        self._pending = False

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name

    def agreed(self, device: torch.device) -> bool:
        """Whether all ranks stop after this step. Every rank calls it once at the end of every step."""
        if not dist.is_initialized():
            return self.signal_name is not None
        stop = False
        if self._pending:
            if self._ready is not None:
                self._ready.synchronize()
            stop = bool(self._result.item())
        if self._flag is None:
            self._flag = torch.zeros(1, dtype=torch.int32, device=device)
            self._result = torch.zeros(1, dtype=torch.int32, pin_memory=device.type == "cuda")
        # fill_ with a Python number launches a kernel: no host-device sync, unlike building a tensor.
        self._flag.fill_(int(self.signal_name is not None))
        dist.all_reduce(self._flag, op=dist.ReduceOp.MAX)
        self._result.copy_(self._flag, non_blocking=True)
        if device.type == "cuda":
            self._ready = torch.cuda.Event()
            self._ready.record()
        self._pending = True
        return stop

    def finish(self, step: int, saved: bool) -> int:
        """Log why the run stops early, wait for the other ranks (so none is killed by the launcher
        while another still commits the checkpoint) and return EXIT_PREEMPTED."""
        what = self.signal_name or "a signal on another rank"
        if saved:
            logger.warning(
                f"Stopped by {what} after step {step}; saved checkpoint step-{step}: launch the "
                "same job again to resume"
            )
        else:
            logger.warning(
                f"Stopped by {what} after step {step}; checkpoint.enable_checkpoint is off, so "
                "nothing was saved"
            )
        if dist.is_initialized():
            dist.barrier()
        return EXIT_PREEMPTED


class NonFiniteGuard:
    """Non-finite steps. By default the run stops with NonFiniteError naming the first step whose
    gradient norm was NaN or Inf, before any checkpoint could hold its state; with `skip`
    (training.skip_nonfinite_steps) such a step is dropped instead: no optimizer step, counted.

    The gradient norm is the same on every rank (it is reduced over the whole model), so all ranks
    decide alike, and it is non-finite whenever the loss is NaN. Skipping must read it before the
    optimizer step: one host-device sync per step. Stopping need not: the first bad step is noted on
    the device, and `check` reads it where the loop syncs anyway (logging steps) and before every
    save, so the default keeps the hot loop free of syncs."""

    def __init__(self, skip: bool) -> None:
        self.skip = skip
        self.skipped = 0
        self._first_bad: torch.Tensor | None = None  # on the device: first bad step since `check`, or 0

    def step_ok(self, step: int, grad_norm: torch.Tensor) -> bool:
        """Whether the optimizer may step (always, unless skipping)."""
        finite = torch.isfinite(grad_norm)
        if not self.skip:
            bad = torch.where(finite, 0, step)
            self._first_bad = (
                bad if self._first_bad is None else torch.where(self._first_bad > 0, self._first_bad, bad)
            )
            return True
        if finite.item():
            return True
        self.skipped += 1
        logger.warning(
            f"Step {step}: gradient norm {grad_norm.item()}; skipped (no optimizer step), "
            f"{self.skipped} skipped so far"
        )
        return False

    def check(self, step: int, loss: float | None = None) -> None:
        """Stop (raise) if a step so far had a non-finite gradient norm, or `loss` is not finite.
        Call it at logging steps and before every save."""
        if self.skip:
            return
        first_bad = int(self._first_bad.item()) if self._first_bad is not None else 0
        self._first_bad = None
        if first_bad:
            raise NonFiniteError(
                f"step {first_bad}: the gradient norm is not finite; stopped at step {step} without saving "
                "(the checkpoints are from before it). Lower optimizer.lr, or set "
                "training.skip_nonfinite_steps to skip such steps"
            )
        if loss is not None and not math.isfinite(loss):
            raise NonFiniteError(
                f"step {step}: the loss is {loss}; stopped without saving. Lower optimizer.lr, or set "
                "training.skip_nonfinite_steps to skip steps whose gradient norm is not finite"
            )
