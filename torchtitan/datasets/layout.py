"""Which rows of the global batch a data-parallel rank makes, and where in an optimizer step it stands.

An optimizer step takes S = grad_accum_steps x batch_size x dp_world_size rows (the global batch). Every
loader (text, pre-tokenized, mixture) makes global row j the same way whatever the layout, and gives
micro-batch m of rank r rows ``m * D * b + r * b + [0, b)`` (D ranks, per-rank batch b): 1 rank x batch 4,
2 x 2, 4 x 1 and 1 x 2 x 2 micro-batches therefore read the same global batches.
"""

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from torchtitan.logging import logger

# (input ids, labels), and for chat data each token's position in its conversation (chat_data.py).
Batch = tuple[torch.Tensor, ...]
IGNORE_INDEX = -100  # a label without loss (chat data's): F.cross_entropy's default ignore_index


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
        self, make: Callable[[list[int]], torch.Tensor], step_done: Callable[[], None]
    ) -> Iterator[Batch]:
        """``(input_ids, labels)`` of the step's micro-batches left, `make` giving a micro-batch's windows
        from its rows; `step_done` counts the step before its last micro-batch is handed out, so that the
        state taken after a step includes it."""
        for m in range(self.micro, len(self.micro_rows)):
            batch = make(self.micro_rows[m])
            self.micro = m + 1
            if self.micro == len(self.micro_rows):
                step_done()
                self.micro = 0
            # Text windows of seq_len + 1 tokens; chat rows (a mixture's) stack ids, labels and positions.
            yield (batch[:, :-1], batch[:, 1:]) if batch.ndim == 2 else tuple(batch.unbind(1))

    def keep_share(self, worker: int, num_workers: int) -> None:
        self.micro_rows = worker_share(self.micro_rows, worker, num_workers)

    def load(self, micro: int, global_batch: int) -> None:
        if micro and global_batch != self.global_batch:
            raise ValueError(
                f"The data loader state was taken in the middle of an optimizer step of {global_batch} "
                f"sequences; resume it with that global batch size (this run's is {self.global_batch})"
            )
        self.micro = micro
