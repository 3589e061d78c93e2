"""Qwen3 (tied embeddings, the bundled tokenizer.json) resumes as Llama does: saved by FSDP 4 and
resumed by FSDP 2 within 1e-5 of the run that never stopped, and killed with SIGKILL (every rank) and
relaunched on the same layout bit for bit, from a checkpoint written by background processes (async).
Its parity with one process on every layout is in test_parity.py (and scripts/parity_matrix.py)."""

import shutil
import signal
import time

from launch import losses, run_train
from test_checkpoint_checksums import assert_manifest_complete

from scripts import chaos
from scripts.parity_matrix import QWEN3_TIED

STEPS = ["--training.steps", "8", "--checkpoint.enable_checkpoint", "true", "--validation.enable", "false"]
ASYNC = ["--checkpoint.async_mode", "async", "--checkpoint.interval", "2"]


def check(result):
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def copy_step_4(source, dump_folder):
    shutil.copytree(source / "checkpoint" / "step-4", dump_folder / "checkpoint" / "step-4")


def test_qwen3_resumes_across_layouts_and_after_sigkill(tmp_path):
    fsdp4, fsdp2, killed = tmp_path / "fsdp4", tmp_path / "fsdp2", tmp_path / "killed"
    check(
        run_train(4, fsdp4, *QWEN3_TIED, *STEPS, "--training.batch_size", "1", "--checkpoint.interval", "4")
    )
    straight = losses(fsdp4)
    assert sorted(straight) == list(range(1, 9))

    copy_step_4(fsdp4, fsdp2)
    result = run_train(2, fsdp2, *QWEN3_TIED, *STEPS, "--training.batch_size", "2", *ASYNC)
    check(result)
    assert "Resumed from step 4" in result.stdout
    resumed = losses(fsdp2)
    assert sorted(resumed) == [5, 6, 7, 8]
    for step, loss in resumed.items():
        assert abs(loss - straight[step]) < 1e-5, (step, loss, straight[step])
    # Step 6 written by the ranks' background processes, step 8 (the last) synchronously: each rank
    # checksums its own files, and the coordinator's manifest holds the other rank's too.
    for step in (6, 8):
        step_dir = fsdp2 / "checkpoint" / f"step-{step}"
        assert_manifest_complete(step_dir, {".metadata", "__0_0.distcp", "__1_0.distcp"})

    # The same FSDP 2 run from the same step-4 state, every rank killed once step 6 is saved (chaos.JOB:
    # batch 2, a checkpoint every 2 steps), then launched again: the losses are fsdp2's, bit for bit.
    copy_step_4(fsdp4, killed)
    job = chaos.Job(2, killed, *chaos.JOB, *QWEN3_TIED, "--validation.enable", "false", *ASYNC)
    deadline = time.monotonic() + 300
    while "step-6" not in chaos.complete_checkpoints(killed):
        assert job.running() and time.monotonic() < deadline, job.output(0)[-3000:]
        time.sleep(0.01)
    job.signal([0, 1], signal.SIGKILL)
    assert job.wait(30) == [-signal.SIGKILL] * 2
    relaunch = chaos.run_to_end(2, killed, *QWEN3_TIED, "--validation.enable", "false", *ASYNC)
    assert "Resumed from step 6" in relaunch.output(0)
    logged = chaos.losses(killed)  # both launches'
    assert sorted({step for step, _ in logged}) == [5, 6, 7, 8]
    assert [loss for _, loss in logged] == [resumed[step] for step, _ in logged]
