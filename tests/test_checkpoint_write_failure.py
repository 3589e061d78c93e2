"""A checkpoint whose write fails (a full disk, a file-size limit, an I/O or permission error), saved
synchronously or in the background, ends the run with exit code 5 and one line naming the folder and
the OS error, leaving no step-N nor step-N.tmp and the earlier checkpoints intact; the next launch
resumes from the last complete one, bit for bit. A failing metrics.jsonl or W&B only warns, once."""

import errno
import logging
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from launch import losses, read_metrics, run_train
from test_checkpoint import Run, folder_names

from torchtitan.checkpoint.checksums import ChecksumWriter
from torchtitan.config.options import JobConfig
from torchtitan.errors import CheckpointWriteError
from torchtitan.logging import logger
from torchtitan.metrics import MetricLogger

JOB = ["--checkpoint.enable_checkpoint", "true", "--checkpoint.interval", "2", "--training.steps", "6"]
LAUNCHER = "torchtitan.reliability.launcher"  # as run_llama_train.sh starts train.py
# In the launcher and so in train.py: above metrics.jsonl and the logs, below the tiny job's 76 MB shard.
FILE_SIZE_LIMIT = 16 << 20


def contents(folder: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(folder)): path.read_bytes()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


def check(result) -> None:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EFBIG, errno.EIO, errno.EACCES])
def test_failed_write_is_one_line_and_keeps_earlier_checkpoints(tmp_path, monkeypatch, code, async_mode):
    run = Run(tmp_path, interval=2, async_mode=async_mode)
    run.train(2)
    run.checkpoint.wait()
    saved = contents(tmp_path / "checkpoint")

    def fail(*args: object) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(ChecksumWriter, "write_data", fail)
    tmp = re.escape(str(tmp_path / "checkpoint" / "step-4.tmp"))
    reason = re.escape(f"{os.strerror(code)} ({errno.errorcode[code]})")
    with pytest.raises(
        CheckpointWriteError, match=rf"^checkpoint: cannot write {tmp}: {reason}; .* from step-2$"
    ):
        run.train(2)  # a synchronous save fails here
        run.checkpoint.close()  # an asynchronous one is reported here at the latest
    assert folder_names(tmp_path) == ["step-2"]
    assert contents(tmp_path / "checkpoint") == saved
    assert Run(tmp_path).checkpoint.load() == 2


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """A run never interrupted: checkpoints at steps 2, 4 and 6, and the losses to compare with."""
    dump = tmp_path_factory.mktemp("straight")
    check(run_train(1, dump, *JOB))
    return dump


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_write_past_a_file_size_limit_then_resume(straight, tmp_path, async_mode):
    """Resumed from step 2, the save of step 4 fails (an async one is reported at the next save, step
    6's); launched again without the limit, the run resumes from step 2 and logs the straight run's
    losses, as the failed run did."""
    ckpt = tmp_path / "checkpoint"
    shutil.copytree(straight / "checkpoint" / "step-2", ckpt / "step-2")
    saved = contents(ckpt)
    mode = ["--checkpoint.async_mode", async_mode]
    failed = run_train(1, tmp_path, *JOB, *mode, launcher=LAUNCHER, file_size_limit=FILE_SIZE_LIMIT)
    out = failed.stdout + failed.stderr
    assert failed.returncode == 5, out[-3000:]
    assert "Traceback" not in out
    errors = [line for line in out.splitlines() if "error:" in line]
    assert len(errors) == 1, out[-3000:]
    assert f"error: checkpoint: cannot write {ckpt}/step-4.tmp: File too large (EFBIG); " in errors[0]
    assert contents(ckpt) == saved

    resumed = run_train(1, tmp_path, *JOB, *mode, launcher=LAUNCHER)
    check(resumed)
    assert "Resumed from step 2" in resumed.stdout
    want = losses(straight)
    assert [m["step"] for m in read_metrics(tmp_path)][-4:] == [3, 4, 5, 6]
    for record in read_metrics(tmp_path):  # the failed run's and the resumed run's
        assert record["loss"] == want[record["step"]], record


class FullDisk:
    """metrics.jsonl on a full disk."""

    def write(self, text: str) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def flush(self) -> None:
        self.write("")

    close = flush


class Unreachable:
    """A W&B run whose server cannot be reached."""

    def log(self, *args: object, **kwargs: object) -> None:
        raise ConnectionError("wandb: network is unreachable")

    finish = log


def test_failing_metrics_warn_once_and_training_goes_on(tmp_path, caplog, monkeypatch):
    cfg = JobConfig()
    cfg.job.dump_folder = str(tmp_path)
    cfg.training.steps = 3
    metrics = MetricLogger(cfg, 1, None, 1.0, torch.device("cpu"), is_logging_rank=True)
    metrics.jsonl.close()
    metrics.jsonl, metrics.wandb = FullDisk(), Unreachable()
    monkeypatch.setattr(logger, "propagate", False)  # as after init_logger: records reach caplog once
    logger.addHandler(caplog.handler)
    try:
        for step in (1, 2, 3):
            metrics.step_done()
            metrics.log(step, 8.0, 1.0, 1e-3, 0)
        metrics.log_validation(3, 8.0, 2981.0, 512, 0.1, "kjv_validation")
        metrics.close()
    finally:
        logger.removeHandler(caplog.handler)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith(
        "Cannot write metrics.jsonl ([Errno 28] No space left on device); training goes on"
    )
    assert warnings[1].startswith("Cannot write W&B (wandb: network is unreachable)")
