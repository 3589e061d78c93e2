"""Which rows of the global batch a data-parallel rank makes, and where in an optimizer step it stands.

An optimizer step takes S = grad_accum_steps x batch_size x dp_world_size rows (the global batch). Every
loader (text, pre-tokenized, mixture) makes global row j the same way whatever the layout, and gives
micro-batch m of rank r rows ``m * D * b + r * b + [0, b)`` (D ranks, per-rank batch b): 1 rank x batch 4,
2 x 2, 4 x 1 and 1 x 2 x 2 micro-batches therefore read the same global batches.
"""

from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields

import torch

from torchtitan.logging import logger

IGNORE_INDEX = -100  # a label without a target (chat prompts, padding): F.cross_entropy's ignore_index


@dataclass
class Batch:
    """A micro-batch of a rank's rows: `inputs` (rows, seq_len) token ids; `labels` the next tokens,
    IGNORE_INDEX where there is no target (chat data's untrained tokens, padding); `positions` each
    token's position in its conversation (chat data, whose documents are its conversations), None for
    packed text, whose documents the model finds from the tokens."""

    inputs: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor | None = None

    def parts(self) -> tuple[torch.Tensor | None, ...]:
        return tuple(getattr(self, f.name) for f in fields(self))

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "Batch":
        """The batch with `fn` applied to each of its tensors (a slice of rows, a copy to the device)."""
        return Batch(*(None if t is None else fn(t) for t in self.parts()))

    def pin_memory(self) -> "Batch":
        """In page-locked memory (torch's DataLoader calls this with pin_memory)."""
        return self.map(torch.Tensor.pin_memory)

    @classmethod
    def of_windows(cls, windows: torch.Tensor) -> "Batch":
        """Packed text's batch from its (rows, seq_len + 1) windows: each token predicts the next."""
        return cls(windows[:, :-1], windows[:, 1:])


def micro_batch_rows(
    batch_size: int, dp_world_size: int, dp_rank: int, grad_accum_steps: int
) -> list[list[int]]:
    """The global rows of each of a rank's micro-batches in an optimizer step: micro-batch m of rank r holds
    rows ``m * D * b + r * b + [0, b)`` (D ranks, per-rank batch b), whatever the loader."""
    per_pass = batch_size * dp_world_size
    first = dp_rank * batch_size
    return [[m * per_pass + first + i for i in range(batch_size)] for m in range(grad_accum_steps)]


@dataclass(frozen=True)
class BatchLayout:
    """One data-parallel rank's place in the global batch."""

    batch_size: int  # per rank and micro-batch
    dp_world_size: int = 1
    dp_rank: int = 0
    grad_accum_steps: int = 1

    @property
    def global_batch(self) -> int:
        """Rows per optimizer step, over all ranks and micro-batches."""
        return self.grad_accum_steps * self.batch_size * self.dp_world_size

    def micro_batch_rows(self) -> list[list[int]]:
        return micro_batch_rows(self.batch_size, self.dp_world_size, self.dp_rank, self.grad_accum_steps)

    def rows(self) -> list[int]:
        """This rank's rows of a step, micro-batch after micro-batch."""
        return [row for rows in self.micro_batch_rows() for row in rows]


def worker_share(micro_rows: list[list[int]], worker: int, num_workers: int) -> list[list[int]]:
    """Rows ``worker, worker + num_workers, ...`` of each micro-batch: a data loading worker's (loader.py)."""
    return [rows[worker::num_workers] for rows in micro_rows]


def warn_relooped(what: str, epoch: int) -> None:
    """A dataset ran out and starts again: the model sees its data once more."""
    logger.warning(f"{what} is being re-looped: starting epoch {epoch}")


class StepCursor:
    """The micro-batch of the current optimizer step a rank makes next, for loaders whose position is
    counted in steps (pre-tokenized, mixture). A state taken between two micro-batches of a step resumes
    at the next one, with the same global batch size only."""

    def __init__(self, layout: BatchLayout):
        self.global_batch = layout.global_batch
        self.micro_rows = layout.micro_batch_rows()
        self.micro = 0  # micro-batches of the current step already made

    def rest_of_step(
        self, make: Callable[[list[int]], Batch], step_done: Callable[[], None]
    ) -> Iterator[Batch]:
        """The step's micro-batches left, `make` giving a micro-batch from its rows; `step_done` counts
        the step before its last micro-batch is handed out, so that the state taken after a step
        includes it."""
        for m in range(self.micro, len(self.micro_rows)):
            batch = make(self.micro_rows[m])
            self.micro = m + 1
            if self.micro == len(self.micro_rows):
                step_done()
                self.micro = 0
            yield batch

    def keep_share(self, worker: int, num_workers: int) -> None:
        self.micro_rows = worker_share(self.micro_rows, worker, num_workers)

    def load(self, micro: int, global_batch: int) -> None:
        if micro and global_batch != self.global_batch:
            raise ValueError(
                f"The data loader state was taken in the middle of an optimizer step of {global_batch} "
                f"sequences; resume it with that global batch size (this run's is {self.global_batch})"
            )
        self.micro = micro
