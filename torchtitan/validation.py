"""The held-out loss during training (`[validation]`) and of a checkpoint (scripts/evaluate.py).

Every evaluation reads the same windows from the start of the validation data, laid out like the
training data (global batch k holds the same windows whatever the layout), runs forward only, and
reports the mean cross entropy over every target evaluated, the objective's normalisation
(torchtitan/objective/objective.py): their summed loss over every rank over their count. For chat data
(`[chat]`, validation.steps batches of the validation split's conversations) the targets are the
tokens trained on (chat.loss_on). Training is left
as it was: the model's mode is restored, no random numbers are drawn, the training data loader is
not touched, and the metric logger leaves the time out of the training throughput."""

import functools
import itertools
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from torchtitan.config.options import ConfigError, JobConfig
from torchtitan.config_rules import check_chat_validation, validation_batch_size
from torchtitan.datasets.build import DataSource, build_dataset
from torchtitan.datasets.chat_data import build_chat_dataset
from torchtitan.datasets.layout import BatchLayout
from torchtitan.datasets.loader import DataLoader
from torchtitan.datasets.tokenizer import AnyTokenizer
from torchtitan.errors import bad_input
from torchtitan.logging import logger
from torchtitan.models import vocab_size
from torchtitan.parallelisms.distributed import dist_min
from torchtitan.parallelisms.parallel_dims import Meshes
from torchtitan.train_step import TrainStep


@dataclass
class ValidationResult:
    loss: float
    tokens: int
    seconds: float

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss) if self.loss < 700 else math.inf


class Validator:
    """Evaluates the model that `train_step` runs on the job's validation data."""

    def __init__(
        self,
        job_config: JobConfig,
        train_step: TrainStep,
        tokenizer: AnyTokenizer,
        meshes: Meshes,
    ) -> None:
        validation = job_config.validation
        self.freq = validation.freq
        self.total_steps = job_config.training.steps
        self.steps = validation.steps
        self.train_step = train_step
        self.meshes = meshes
        dp_degree, dp_rank = meshes.dp_degree_and_rank
        batch_size = validation_batch_size(job_config, dp_degree)
        self.tokens_per_batch = batch_size * dp_degree * job_config.training.seq_len
        option = "validation.dataset_path" if validation.dataset_path else "validation.dataset"
        # Chat data: the loss is the mean over the trained tokens of the batches evaluated.
        self.chat = job_config.chat.enable
        check_chat_validation(job_config)
        with bad_input(option):
            source = DataSource(validation.dataset, validation.dataset_path, split="validation")
            layout = BatchLayout(batch_size, dp_degree, dp_rank)
            dataset = (
                build_chat_dataset(
                    job_config.chat,
                    validation.dataset,
                    validation.dataset_path,
                    tokenizer,
                    job_config.training.seq_len,
                    layout,
                    split="validation",
                    section="validation",
                )
                if self.chat
                else build_dataset(
                    source,
                    tokenizer,
                    job_config.training.seq_len,
                    layout,
                    vocab_size(job_config, tokenizer.n_words),
                    infinite=False,
                    # Where a pass ends is counted once, each rank tokenizing its own streams only.
                    min_over_ranks=functools.partial(dist_min, mesh=meshes.dp),
                )
            )
            self.data = source.label()  # what the scores are of, named in every result's log line
            self.loader = DataLoader(dataset, batch_size)
            self.start = self.loader.state_dict()
            if next(iter(self.loader), None) is None:
                raise ConfigError(
                    f"{option}: {validation.dataset_path or validation.dataset} holds fewer tokens than one "
                    f"global validation batch ({batch_size} x {dp_degree} sequences of "
                    f"{job_config.training.seq_len + 1} tokens); lower validation.global_batch_size (or "
                    "batch_size) or use more data"
                )
        if not self.chat:  # chat data logs its own line (chat_data.py)
            logger.info(f"Data for validation: {self.data}")

    def should_validate(self, step: int) -> bool:
        """Every validation.freq steps and at the last step."""
        return step % self.freq == 0 or step == self.total_steps

    def validate(self, on_batch: Callable[[int], None] | None = None) -> ValidationResult:
        """The loss over the validation data; `on_batch(n)` is called once n batches are done (their
        forward issued), for a script's progress."""
        start = time.perf_counter()
        self.loader.load_state_dict(self.start)
        batches = iter(self.loader)
        if self.steps != -1:
            batches = itertools.islice(batches, self.steps)
        if on_batch is not None:
            batches = _reported(batches, on_batch)
        # The sum over the targets of every rank's batches (and shares), over their count.
        loss_sum, targets, count = self.train_step.evaluate(batches)
        loss = self.train_step.objective.mean_over_ranks(loss_sum, targets)
        return ValidationResult(loss, count * self.tokens_per_batch, time.perf_counter() - start)


def _reported(batches: Iterator, on_batch: Callable[[int], None]) -> Iterator:
    for done, batch in enumerate(batches, 1):
        yield batch
        on_batch(done)
