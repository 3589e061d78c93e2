"""Distributed checkpoints (torch.distributed.checkpoint) of everything needed to continue a run.

A checkpoint is written to `step-N.tmp` and renamed to `step-N` once complete, so a folder named
`step-N` is always whole and a crash mid-save never costs the previous checkpoint. Each holds a
`checksums.json` (torchtitan/checkpoint_checksums.py), checked before the checkpoint is loaded, and
the model it holds (`model_record`), checked before train.py, evaluate.py or generate.py loads it."""

import contextlib
import errno
import hashlib
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
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan.checkpoint_checksums import ChecksumWriter, check_intact
from torchtitan.checkpoint_folder import (
    LEFTOVER_DIR,
    STEP_DIR,
    check_initial_load_path,
    check_load_step,
    checkpoint_folder,
    is_complete,
    list_checkpoints,
)
from torchtitan.config.options import ConfigError, JobConfig, ModelConfig
from torchtitan.config.paths import resolve_path, shown
from torchtitan.errors import CheckpointWriteError, os_error_behind
from torchtitan.logging import logger
from torchtitan.parallelisms.parallelize_llama import DTYPES
from torchtitan.safe_dcp import SafeLoadPlanner, SafeReader, read_checkpoint, saved_entries


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


def read_model_weights(path: str) -> dict[str, torch.Tensor]:
    """The whole model's weights in a checkpoint, as plain CPU tensors (read in this one process)."""
    weights = {key.removeprefix("model."): value for key, value in read_checkpoint(path, "model.").items()}
    if not weights:
        raise ValueError(f"{path} holds no model weights")
    return weights


def _flat_keys(state: dict[str, Any], prefix: str) -> list[str]:
    """The keys DCP flattens a nested state dict to ('dataloader.dataset_state.x')."""
    keys = []
    for key, value in state.items():
        name = f"{prefix}.{key}"
        keys += _flat_keys(value, name) if isinstance(value, dict) else [name]
    return keys


def load_states(states: dict[str, Stateful], path: str, parts: list[str]) -> None:
    """Load `parts` (keys of `states`) from the checkpoint at `path`, through the safe reader; what does
    not fit this run (shapes, missing parts, another data layout) is a one-line ConfigError."""
    saved = saved_entries(path)
    if "model" in parts:
        _check_model_shapes(states["model"], path, saved)
    if "rng" in parts:
        rng = states["rng"].state_dict()
        if not {f"rng.{rank}.{name}" for rank, states in rng.items() for name in states} <= saved.keys():
            logger.info(f"{path} has no RNG state for this rank and device: keeping the seeded ones")
            parts.remove("rng")
    missing = [part for part in parts if not any(key.startswith(part + ".") for key in saved)]
    if missing:
        raise ConfigError(
            f"checkpoint: {path} has no {', '.join(missing)} state (a model_weights_only export?); "
            "start from it with checkpoint.initial_load_path, or set checkpoint.exclude_from_loading"
        )
    if "dataloader" in parts:
        _check_dataloader_keys(states["dataloader"], path, saved)
    logger.info(f"Loading {', '.join(parts)} from {path}")
    try:
        dcp.load(
            {part: states[part] for part in parts},
            storage_reader=SafeReader(path),  # runs no code from the files (torchtitan/safe_dcp.py)
            planner=SafeLoadPlanner(),
        )
    except ConfigError:  # a part's own one line (a mixture's changed sources)
        raise
    except (Exception, dcp.CheckpointException) as e:  # DCP's is a BaseException
        raise ConfigError(
            f"checkpoint: cannot load {path} ({str(e).strip().splitlines()[-1]}); it may come from a "
            "different model or layout: point job.dump_folder elsewhere or move the folder away"
        ) from e


def _check_dataloader_keys(dataloader: Stateful, path: str, saved: dict[str, Any]) -> None:
    """DCP asks for the keys of this run's data loader state; the data streams are keyed by the global
    batch size, so another global batch size (or an older loader) leaves keys missing: say so in one
    line rather than DCP's 'missing key'."""
    missing = [key for key in _flat_keys(dataloader.state_dict(), "dataloader") if key not in saved]
    if missing:
        raise ConfigError(
            f"checkpoint: {path} has no {missing[0]}: its data loader state was saved for another "
            "global batch size or by an older data loader (or from text data for pre-tokenized data, or the "
            "reverse), and the text data streams depend on the global batch size; keep the saved global "
            "batch size, or start the data afresh with --checkpoint.exclude_from_loading dataloader"
        )


def _check_model_shapes(model_state: Stateful, path: str, saved: dict[str, Any]) -> None:
    """Compare the parameters of the whole model (pipeline stages hold different ones, so gather
    them) with the checkpoint's, so that a mismatch is one clear line, the same on every rank."""
    shapes = {f"model.{fqn}": tuple(t.shape) for fqn, t in model_state.state_dict().items()}
    if dist.is_initialized():
        gathered: list[dict] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(gathered, shapes)
        shapes = {key: shape for rank_shapes in gathered for key, shape in rank_shapes.items()}
    hint = "was it saved with another model.flavor or tokenizer?"
    for key, shape in shapes.items():
        entry = saved.get(key)
        if not isinstance(entry, TensorStorageMetadata):
            raise ConfigError(f"checkpoint: {path} has no parameter {key[6:]}; {hint}")
        if tuple(entry.size) != shape:
            raise ConfigError(
                f"checkpoint: {path} holds {key[6:]} with shape {tuple(entry.size)} but the model's "
                f"is {shape}; {hint}"
            )
    extra = [key for key in saved if key.startswith("model.") and key not in shapes]
    if extra:
        raise ConfigError(f"checkpoint: {path} holds {extra[0][6:]}, which the model lacks; {hint}")


RECORD = "model_record"  # the state-dict key of a checkpoint's model record


def model_record(model_config: ModelConfig) -> dict[str, str]:
    """What every checkpoint records of the model it holds: the weights of models of the same shapes
    (llama2's and llama3's debug models, llama3's 8B and 3.1_8B) would load into one another silently,
    and so would a model into a run with another tokenizer of the same vocabulary size."""
    tokenizer = resolve_path(model_config.tokenizer_path)
    if os.path.isdir(tokenizer):  # a Hugging Face tokenizer folder
        tokenizer = os.path.join(tokenizer, "tokenizer.json")
    with open(tokenizer, "rb") as f:  # a few MB at most
        tokenizer_sha256 = hashlib.sha256(f.read()).hexdigest()
    return {"name": model_config.name, "flavor": model_config.flavor, "tokenizer_sha256": tokenizer_sha256}


def check_model_record(path: str, model_config: ModelConfig) -> None:
    """Raise a one-line ConfigError if the checkpoint at `path` holds another model (name, flavour or
    tokenizer) than `model_config`'s. What a checkpoint does not record (saved by an earlier version,
    converted from Hugging Face) is unknown and passes."""
    if not any(key.startswith(RECORD + ".") for key in saved_entries(path)):
        return
    saved = {key.removeprefix(RECORD + "."): v for key, v in read_checkpoint(path, RECORD + ".").items()}
    ours = model_record(model_config)
    if (saved["name"], saved["flavor"]) != (ours["name"], ours["flavor"]):
        option = "model.name" if saved["name"] != ours["name"] else "model.flavor"
        raise ConfigError(
            f"{option}: {path} holds a {saved['name']} {saved['flavor']} model, not this job's "
            f"{ours['name']} {ours['flavor']}; set --model.name {saved['name']} --model.flavor "
            f"{saved['flavor']}, or load a checkpoint of this model"
        )
    if saved["tokenizer_sha256"] != ours["tokenizer_sha256"]:
        raise ConfigError(
            f"model.tokenizer_path: {path} was trained with another tokenizer than "
            f"{shown(model_config.tokenizer_path)} (their SHA-256 differ); set model.tokenizer_path to the "
            "checkpoint's tokenizer"
        )


def load_model_weights(model_parts: list[nn.Module], path: str, verify: bool = True) -> None:
    """The model weights of the checkpoint at `path` into this rank's parts, whatever the layout;
    `verify`: against its checksums first."""
    if verify:
        check_intact(path)
    load_states({"model": ModelState(merge_model_parts(model_parts))}, path, ["model"])


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
        self.record = model_record(job_config.model)
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
