"""Saving a run's checkpoints and resuming from them (CheckpointManager).

A checkpoint is written to `step-N.tmp` and renamed to `step-N` once complete, so a folder named
`step-N` is always whole and a crash mid-save never costs the previous checkpoint. Each holds a
`checksums.json` (torchtitan/checkpoint/checksums.py), checked before the checkpoint is loaded, and
the model it holds (`model_record`), checked before train.py, evaluate.py or generate.py loads it."""

import contextlib
import errno
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan.checkpoint.checksums import ChecksumWriter, check_intact
from torchtitan.checkpoint.folder import (
    LEFTOVER_DIR,
    STEP_DIR,
    check_initial_load_path,
    check_load_step,
    checkpoint_folder,
    hf_export_folder,
    is_complete,
    is_hf_folder,
    list_checkpoints,
)
from torchtitan.checkpoint.hf_export import export_hf
from torchtitan.checkpoint.hf_reader import load_hf_weights
from torchtitan.checkpoint.load import check_model_record, load_states
from torchtitan.checkpoint.safe_reader import saved_entries
from torchtitan.checkpoint.state import (
    RECORD,
    ModelState,
    OptimizerState,
    RNGState,
    SchedulerState,
    TrainState,
    merge_model_parts,
    model_record,
)
from torchtitan.config.options import JobConfig
from torchtitan.config.paths import resolve_path
from torchtitan.datasets.hf_export import trained_chat_template
from torchtitan.datasets.tokenizer import build_tokenizer
from torchtitan.errors import CheckpointWriteError, os_error_behind
from torchtitan.logging import logger
from torchtitan.parallelisms.parallelize import DTYPES


def _fsync_dir(path: str) -> None:
    """Make a rename in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointManager:
    """Saves everything needed to continue the run exactly, and restores it.

    A checkpoint is written to `step-N.tmp` and renamed to `step-N` once complete (for an async save:
    once the background write has finished), so a `step-N` folder is always whole and a crash mid-save
    leaves the previous checkpoints intact. Leftovers of a crash are removed at start."""

    def __init__(
        self,
        model: nn.Module | list[nn.Module],
        optimizer: torch.optim.Optimizer,
        lr_scheduler: torch.optim.lr_scheduler.LRScheduler,
        dataloader: Stateful,
        train_state: TrainState,
        job_config: JobConfig,
    ) -> None:
        parts = model if isinstance(model, list) else [model]
        if isinstance(model, list):
            model = merge_model_parts(model)
        self.checkpoint_config = job_config.checkpoint
        self.model_config = job_config.model
        self.enabled = self.checkpoint_config.enable_checkpoint
        self.folder = checkpoint_folder(job_config)
        self.states = {
            "model": ModelState(model),
            "optimizer": OptimizerState(model, optimizer),
            "lr_scheduler": SchedulerState(lr_scheduler),
            "dataloader": dataloader,
            "train_state": train_state,
            "rng": RNGState(),
        }
        self.record = model_record(job_config.model, trained_chat_template(job_config.model, job_config.chat))
        # checkpoint.last_save_in_hf: the model's arguments and where its export goes.
        self.model_args = getattr(parts[0], "model_args", None)
        self.hf_folder = hf_export_folder(job_config)
        self.is_coordinator = not dist.is_initialized() or dist.get_rank() == 0
        self._pending: tuple[int, Future] | None = None  # an async save not yet committed
        self._purger: threading.Thread | None = None
        self._stager: DefaultStager | None = None
        if self.enabled and self.checkpoint_config.async_mode != "disabled":
            self._setup_async(pinned=self.checkpoint_config.async_mode == "async_with_pinned_mem")

    def _setup_async(self, pinned: bool) -> None:
        """Staging copies the state into CPU memory before `async_save` returns, so the next optimizer
        step may change the parameters; another process (a thread when there is no process group)
        writes the copy."""
        if pinned and not torch.cuda.is_available():
            logger.warning("checkpoint.async_mode: without CUDA, async_with_pinned_mem is plain async")
            pinned = False
        self._process_group = None
        self._writer = AsyncCheckpointerType.THREAD
        if dist.is_initialized():
            # Async DCP coordinates over a CPU (gloo) group, also when training uses NCCL.
            self._process_group = dist.new_group(backend="gloo")
            self._writer = AsyncCheckpointerType.PROCESS
        self._stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=pinned,
                use_shared_memory=self._writer == AsyncCheckpointerType.PROCESS,
                use_async_staging=False,
                use_non_blocking_copy=pinned,
            )
        )

    def _path(self, step: int) -> str:
        return os.path.join(self.folder, f"step-{step}")

    def load(self) -> int | None:
        """Restore the run from its own checkpoint (checkpoint.load_step, else the latest complete one);
        without one, take the model weights from checkpoint.initial_load_path if it is set.

        Returns the step of the run's checkpoint, or None when the run starts from step 0."""
        step = None
        if self.enabled:
            self._remove_leftovers()
            step = self._step_to_load(list_checkpoints(self.folder))
        if step is not None:
            parts = [part for part in self.states if part not in self.checkpoint_config.exclude_from_loading]
            if "model" in parts:
                check_model_record(self._path(step), self.model_config)
            load_states(self.states, self._path(step), parts)
            return step
        if self.checkpoint_config.initial_load_path is not None:
            check_initial_load_path(self.checkpoint_config)
            path = self.checkpoint_config.initial_load_path
            if is_hf_folder(path):
                reader = load_hf_weights(self.states["model"].model, path, self.model_config, self.model_args)
                logger.info(f"Loaded {path} (Hugging Face): this rank read {reader.bytes_read:,} bytes of it")
                return None
            if self.checkpoint_config.verify_checksums:
                check_intact(
                    self.checkpoint_config.initial_load_path,
                    "point checkpoint.initial_load_path at an intact checkpoint",
                )
            check_model_record(self.checkpoint_config.initial_load_path, self.model_config)
            load_states(self.states, self.checkpoint_config.initial_load_path, ["model"])
        return None

    def _remove_leftovers(self) -> None:
        if not self.is_coordinator or not os.path.isdir(self.folder):
            return
        for name in sorted(os.listdir(self.folder)):
            path = os.path.join(self.folder, name)
            if LEFTOVER_DIR.match(name):
                logger.warning(f"Removing {path}: left by a save or deletion that was cut short")
                shutil.rmtree(path, ignore_errors=True)
            elif STEP_DIR.match(name) and not is_complete(path):
                logger.warning(f"Ignoring {path}: it has no .metadata, so it is incomplete")

    def _step_to_load(self, steps: list[int]) -> int | None:
        """checkpoint.load_step, else the latest checkpoint a run can continue from; each one looked at
        is checked against its checksums first, before anything reads it."""
        if self.checkpoint_config.load_step != -1:
            check_load_step(self.checkpoint_config, self.folder)
            self._check_intact(self.checkpoint_config.load_step)
            return self.checkpoint_config.load_step
        for step in reversed(steps):
            self._check_intact(step)
            if "train_state.step" in saved_entries(self._path(step)):
                return step
            logger.info(f"Not resuming from {self._path(step)}: it holds model weights only")
        return None

    def _check_intact(self, step: int) -> None:
        if self.checkpoint_config.verify_checksums:
            check_intact(self._path(step))

    def maybe_save(
        self, step: int, last_step: bool, force: bool = False, before_save: Callable[[], None] | None = None
    ) -> None:
        """Save every checkpoint.interval steps, at the last step and when `force`d (a preemption: the
        full state, to resume from), calling `before_save` first (it may raise to refuse the state);
        commit a finished async save."""
        if not self.enabled:
            return
        if self._pending is not None and self._pending[1].done() and self._pending[1].exception() is None:
            self.wait()  # a failed one is reported by the next save or close(), on every rank at that step
        if step % self.checkpoint_config.interval == 0 or last_step or force:
            if before_save is not None:
                before_save()
            self.save(step, last_step)

    def save(self, step: int, last_step: bool = False) -> None:
        """Write `step-N`. The last step's save is synchronous and, with checkpoint.model_weights_only,
        holds the model weights only, in checkpoint.export_dtype."""
        self.wait()
        tmp = self._path(step) + ".tmp"
        state: dict[str, Any] = {**self.states, RECORD: self.record}
        if last_step and self.checkpoint_config.model_weights_only:
            dtype = DTYPES[self.checkpoint_config.export_dtype]
            model = {k: v.to(dtype) for k, v in self.states["model"].state_dict().items()}
            state = {"model": model, RECORD: self.record}
        if self._stager is None or last_step:
            with self._write_errors_reported(step):
                dcp.save(state, checkpoint_id=tmp, storage_writer=ChecksumWriter(tmp))
                self._commit(step)
            if last_step and self.checkpoint_config.last_save_in_hf and self.is_coordinator:
                self._export_hf(step)
            return
        start = time.perf_counter()
        with self._write_errors_reported(step):
            future = dcp.async_save(
                state,
                checkpoint_id=tmp,
                storage_writer=ChecksumWriter(tmp),
                process_group=self._process_group,
                async_checkpointer_type=self._writer,
                async_stager=self._stager,
            )
        self._pending = (step, future)
        staged = time.perf_counter() - start
        logger.info(f"Staged checkpoint step {step} in {staged:.2f}s; writing it in the background")

    def _export_hf(self, step: int) -> None:
        """checkpoint.last_save_in_hf: `step-N` as a Hugging Face folder in {dump_folder}/hf, replacing the
        run's earlier export (the preflight refused a file there and a routing bias being trained)."""
        export_hf(
            self._path(step),
            self.hf_folder,
            self.model_args,
            name=self.model_config.name,
            tokenizer=build_tokenizer(resolve_path(self.model_config.tokenizer_path)),
            overwrite=True,
            option="checkpoint.last_save_in_hf",
            bias_option="checkpoint.last_save_in_hf",
        )
        logger.info(f"Exported {self._path(step)} for Hugging Face transformers to {self.hf_folder}")

    def wait(self) -> None:
        """Wait for the async save in flight, if any, and commit it."""
        if self._pending is not None:
            step, future = self._pending
            self._pending = None
            with self._write_errors_reported(step):
                future.result()
                self._commit(step)

    @contextlib.contextmanager
    def _write_errors_reported(self, step: int) -> Iterator[None]:
        """A save that fails with an OSError (a full disk, a file-size limit, an I/O error, a permission)
        ends the run in one line (CheckpointWriteError, exit code 5): its `step-N.tmp` is removed, the
        earlier checkpoints are untouched, and the next launch resumes from the last complete one."""
        try:
            yield
        except BaseException as e:  # DCP's CheckpointException is one
            os_error = os_error_behind(e)
            if os_error is None:
                raise
            tmp = self._path(step) + ".tmp"
            if self.is_coordinator:
                shutil.rmtree(tmp, ignore_errors=True)
            reason = os_error.strerror or str(os_error)
            code = errno.errorcode.get(os_error.errno or 0, "")
            steps = list_checkpoints(self.folder)
            resume = f"step-{steps[-1]}" if steps else "the start"
            raise CheckpointWriteError(
                f"checkpoint: cannot write {tmp}: {reason} ({code}); it is removed and the earlier "
                f"checkpoints are intact: free space or fix {self.folder}, then launch again to resume "
                f"from {resume}"
            ) from e

    def _commit(self, step: int) -> None:
        """Rename the complete `step-N.tmp` to `step-N` (the coordinator's save returns once every rank's
        data and the metadata are written), then purge checkpoints beyond checkpoint.keep_latest_k."""
        if not self.is_coordinator:
            return
        final = self._path(step)
        if os.path.exists(final):  # saved again after rewinding with checkpoint.load_step
            os.rename(final, final + ".old")
        os.rename(final + ".tmp", final)
        _fsync_dir(self.folder)
        shutil.rmtree(final + ".old", ignore_errors=True)
        logger.info(f"Saved checkpoint {final}")
        if self.checkpoint_config.keep_latest_k > 0:
            self._purge(keep=step)

    def _purge(self, keep: int) -> None:
        if self._purger is not None:
            self._purger.join()
        old = [s for s in list_checkpoints(self.folder)[: -self.checkpoint_config.keep_latest_k] if s != keep]
        if old:
            self._purger = threading.Thread(target=self._delete, args=(old,), daemon=True)
            self._purger.start()

    def _delete(self, steps: list[int]) -> None:
        """Rename before deleting, so a folder half deleted by a crash is never taken for a checkpoint."""
        for step in steps:
            doomed = self._path(step) + ".purging"
            os.rename(self._path(step), doomed)
            shutil.rmtree(doomed)
            logger.info(f"Deleted checkpoint {self._path(step)} (checkpoint.keep_latest_k)")

    def close(self) -> None:
        """Finish the async save in flight and the deletions; call once training is over."""
        self.wait()
        if self._purger is not None:
            self._purger.join()
        if self._stager is not None:
            self._stager.close()
