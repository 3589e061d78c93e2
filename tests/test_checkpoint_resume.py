"""End-to-end resume under torchrun: a run stopped at step 4 and resumed trains exactly like one that
never stopped, on the same layout (bit for bit) and on another one (within 1e-5)."""

import shutil

from launch import losses, run_train

from scripts.parity_layouts import BLOCK_CAUSAL, MUON

STEPS = ["--training.steps", "8", "--checkpoint.enable_checkpoint", "true", "--checkpoint.interval", "4"]

# Bitwise resume on FSDP 2: test_reliability.py; pipeline parallelism: test_pipeline.py (ZBV, two model
# parts on a rank); CP 2 from an async checkpoint (and its checksum manifests): test_qwen3_resume.py;
# one process resuming another layout's checkpoint: test_moe_resume.py, test_pipeline.py,
# test_context_parallel.py.


def check(result):
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def resume_from_step(source, dump_folder, nproc, batch, *overrides, step=4):
    """Start a run in `dump_folder` holding only `source`'s checkpoint of `step`; its losses."""
    shutil.copytree(source / "checkpoint" / f"step-{step}", dump_folder / "checkpoint" / f"step-{step}")
    result = run_train(nproc, dump_folder, *STEPS, "--training.batch_size", str(batch), *overrides)
    check(result)
    assert "Loading model, optimizer, lr_scheduler, dataloader, train_state" in result.stdout
    assert f"Resumed from step {step}" in result.stdout
    resumed = losses(dump_folder)
    assert sorted(resumed) == list(range(step + 1, 9))
    return resumed


def straight_run(dump_folder, nproc, batch, *overrides):
    """8 steps, saving at steps 4 and 8; its losses."""
    check(run_train(nproc, dump_folder, *STEPS, "--training.batch_size", str(batch), *overrides))
    straight = losses(dump_folder)
    assert sorted(straight) == list(range(1, 9))
    return straight


# The checkpoint is HSDP 2 x 2's, with gradient accumulation (2 micro-batches of 4 sequences: replicas
# all-reduce after the last only), trained with Muon (docs/optimizers.md: its momentum resharded) on
# packed documents attending within themselves (block_causal). A checkpoint saved by FSDP 4 is resumed
# by CP 2 (FSDP over 2 ranks) in test_qwen3_resume.py (checkpointing and resharding are the model
# families' shared code).
MUON_8 = ["--training.global_batch_size", "8", *MUON, *BLOCK_CAUSAL]
HSDP2X2 = ["--parallelism.data_parallel_replicate_degree", "2", *MUON_8]
TP2 = ["--parallelism.tensor_parallel_degree", "2", *MUON_8, "--checkpoint.interval", "2"]


def test_resume_is_bitwise_and_on_other_layouts(tmp_path):
    """Saved by HSDP over 2 x 2 ranks (batch 1 each, 2 micro-batches a step). Resumed by HSDP 2 x 2:
    the losses are those of the run that never stopped, bit for bit. Resumed by TP 2 (2 micro-batches
    of 4), and TP 2's checkpoint of step 6 by FSDP 2 (2 micro-batches of 2 per rank): the optimizer
    state (Muon's momentum, AdamW's moments) is resharded each time and the data stream goes on, so
    the losses continue them within 1e-5: HSDP with accumulation trains as TP and FSDP (and so one
    process) do. TP 2 resumes its own checkpoint of step 6 bit for bit, passing over a save cut short,
    a copy without metadata and a half-deleted checkpoint."""
    straight = straight_run(tmp_path / "hsdp2x2", 4, 1, *HSDP2X2)
    resumed = resume_from_step(tmp_path / "hsdp2x2", tmp_path / "resumed", 4, 1, *HSDP2X2)
    for step, loss in resumed.items():
        assert loss == straight[step], (step, loss, straight[step])
    on_tp2 = resume_from_step(tmp_path / "hsdp2x2", tmp_path / "tp2", 2, 4, *TP2)
    on_fsdp2 = resume_from_step(tmp_path / "tp2", tmp_path / "fsdp2", 2, 2, *MUON_8, step=6)
    for name, resumed in (("tp2", on_tp2), ("fsdp2", on_fsdp2)):
        for step, loss in resumed.items():
            assert abs(loss - straight[step]) < 1e-5, (name, step, loss, straight[step])

    tp2_again = tmp_path / "tp2_again"
    ckpt = tp2_again / "checkpoint"
    for damaged in ("step-7.tmp", "step-7", "step-7.purging"):
        shutil.copytree(tmp_path / "tp2" / "checkpoint" / "step-8", ckpt / damaged)
    (ckpt / "step-7" / ".metadata").unlink()
    again = resume_from_step(tmp_path / "tp2", tp2_again, 2, 4, *TP2, step=6)
    assert again == {step: on_tp2[step] for step in (7, 8)}
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-6", "step-7", "step-8"]
