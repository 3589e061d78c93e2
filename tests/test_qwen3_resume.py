"""Qwen3 (tied embeddings, the bundled tokenizer.json) resumes as Llama does: saved by FSDP 4 and
resumed by context parallelism 2 (FSDP over its 2 ranks, each holding half of every sequence) within
1e-5 of the run that never stopped, saving asynchronously (background processes) with complete checksum
manifests. A SIGKILL of every rank during an asynchronous run and its
bitwise relaunch: test_moe_resume.py (on EP 2). Its parity with one process on every layout is in
test_parity.py (and scripts/parity_matrix.py)."""

import shutil

from launch import losses, run_train
from test_checkpoint_checksums import assert_manifest_complete

from scripts.parity_layouts import QWEN3_TIED, cp

STEPS = ["--training.steps", "8", "--checkpoint.enable_checkpoint", "true", "--validation.enable", "false"]
ASYNC = ["--checkpoint.async_mode", "async", "--checkpoint.interval", "2"]


def check(result):
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def copy_step_4(source, dump_folder):
    shutil.copytree(source / "checkpoint" / "step-4", dump_folder / "checkpoint" / "step-4")


def test_qwen3_resumes_across_layouts_with_async_checkpoints(tmp_path):
    fsdp4, cp2 = tmp_path / "fsdp4", tmp_path / "cp2"
    check(
        run_train(4, fsdp4, *QWEN3_TIED, *STEPS, "--training.batch_size", "1", "--checkpoint.interval", "4")
    )
    straight = losses(fsdp4)
    assert sorted(straight) == list(range(1, 9))

    copy_step_4(fsdp4, cp2)
    result = run_train(2, cp2, *QWEN3_TIED, *STEPS, "--training.batch_size", "4", *cp(2), *ASYNC)
    check(result)
    assert "Resumed from step 4" in result.stdout
    resumed = losses(cp2)
    assert sorted(resumed) == [5, 6, 7, 8]
    for step, loss in resumed.items():
        assert abs(loss - straight[step]) < 1e-5, (step, loss, straight[step])
    # Step 6 written by the ranks' background processes, step 8 (the last) synchronously: each rank
    # checksums its own files, and the coordinator's manifest holds the other rank's too.
    for step in (6, 8):
        step_dir = cp2 / "checkpoint" / f"step-{step}"
        assert_manifest_complete(step_dir, {".metadata", "__0_0.distcp", "__1_0.distcp"})
