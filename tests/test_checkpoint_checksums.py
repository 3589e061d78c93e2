"""Every save writes checksums.json, listing every file of the checkpoint (with several ranks, each
rank's own files: test_qwen3_resume.py checks two-rank checkpoints written async and not); a load
checks it first unless checkpoint.verify_checksums is off, and a checkpoint without one loads
unverified. The damaged-checkpoint cases are in test_bad_input.py's table."""

import json
import logging
from pathlib import Path

import pytest
from test_checkpoint import Run, assert_same

from torchtitan.checkpoint.checksums import MANIFEST, file_checksum
from torchtitan.config.options import ConfigError
from torchtitan.logging import logger


def assert_manifest_complete(step_dir: Path, expected: set[str]) -> None:
    """checksums.json lists exactly the checkpoint's other files (`expected`), with their size and CRC32."""
    files = json.loads((step_dir / MANIFEST).read_text())["files"]
    assert {path.name for path in step_dir.iterdir()} - {MANIFEST} == expected == set(files)
    for name, checksum in files.items():
        assert file_checksum(str(step_dir / name)) == checksum, name


def flip_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(data)


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_every_save_lists_every_file(tmp_path, async_mode):
    run = Run(tmp_path, interval=1, async_mode=async_mode)
    run.train(2)
    run.checkpoint.close()
    for step in (1, 2):
        assert_manifest_complete(tmp_path / "checkpoint" / f"step-{step}", {".metadata", "__0_0.distcp"})


def test_verification_can_be_skipped(tmp_path):
    """A flipped bit in tensor data loads without complaint when unchecked: what the checksums prevent."""
    Run(tmp_path, interval=1).train(1)
    flip_bit(tmp_path / "checkpoint" / "step-1" / "__0_0.distcp")
    with pytest.raises(
        ConfigError, match=r"step-1 is damaged: __0_0.distcp does not match its CRC32 checksum"
    ):
        Run(tmp_path).checkpoint.load()
    assert Run(tmp_path, verify_checksums=False).checkpoint.load() == 1


def test_checkpoint_without_checksums_loads_unverified(tmp_path, caplog, monkeypatch):
    """As saved by an earlier version, or converted from another format; also as initial weights."""
    saved = Run(tmp_path, interval=1)
    saved.train(1)
    step_dir = tmp_path / "checkpoint" / "step-1"
    (step_dir / MANIFEST).unlink()
    monkeypatch.setattr(logger, "propagate", False)  # as after init_logger: records reach caplog once
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger.name):
            assert Run(tmp_path).checkpoint.load() == 1
            finetune = Run(tmp_path / "finetune", seed=1, initial_load_path=str(step_dir))
            assert finetune.checkpoint.load() is None
    finally:
        logger.removeHandler(caplog.handler)
    assert_same(finetune.weights(), saved.weights())
    unverified = [r for r in caplog.records if f"has no {MANIFEST}" in r.getMessage()]
    assert len(unverified) == 2 and "loading it unverified" in unverified[0].getMessage()
