"""Context parallelism (parallelisms/context_parallel.py): how a sequence is split, each chunk's
attention (CPU's and CUDA's forms), and CP 2 end to end: the losses, gradient norms and validation losses
of one process over 10 steps at 256 tokens, a SIGKILL of both ranks relaunched bit for bit, and its
checkpoint resumed by one process within 1e-5. The other layouts (CP 4, CP x FSDP, CP x TP, PP x CP):
test_parity.py; a checkpoint of FSDP resumed by CP 2: test_qwen3_resume.py; every layout:
scripts/parity_matrix.py."""

import shutil

import pytest
import torch
from launch import TINY_JOB, losses, run_train
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from scripts import chaos
from scripts.parity_matrix import QWEN3_CP_CI, Layout, cp, run_layout
from torchtitan.parallelisms.context_parallel import (
    chunked_causal_attention,
    load_balanced_positions,
    lower_right_bias,
)


@pytest.mark.parametrize("cp_degree", [1, 2, 4])
def test_ranks_hold_every_position_once_with_equal_attention_work(cp_degree):
    seq_len = 64
    held = [load_balanced_positions(seq_len, cp_degree, rank).tolist() for rank in range(cp_degree)]
    assert sorted(p for positions in held for p in positions) == list(range(seq_len))
    # A causal query at position p attends to p + 1 keys.
    work = {sum(p + 1 for p in positions) for positions in held}
    assert len(work) == 1, work


@pytest.mark.parametrize("chunk, ends", [(8, [8, 32]), (8, [16, 24]), (5, [40]), (4, [4, 8, 12])])
def test_chunks_attend_to_every_earlier_key(chunk, ends):
    """Chunk i holds positions ends[i] - chunk .. ends[i] - 1: on CPU each attends by two fused attentions
    merged by log-sum-exp (no mask kept), equal in value and gradient to SDPA over the keys up to its end
    with the lower-right causal mask, chunk by chunk."""
    generator = torch.Generator().manual_seed(0)
    seq_len = max(ends)
    q = torch.randn(2, 4, chunk * len(ends), 16, generator=generator, requires_grad=True)
    k, v = (torch.randn(2, 4, seq_len, 16, generator=generator, requires_grad=True) for _ in range(2))

    def masked_sdpa(q, k, v, ends):
        outputs = [
            torch.nn.functional.scaled_dot_product_attention(
                q[:, :, i * chunk : (i + 1) * chunk],
                k[:, :, :end],
                v[:, :, :end],
                attn_mask=torch.ones(chunk, end, dtype=torch.bool).tril(end - chunk),
            )
            for i, end in enumerate(ends)
        ]
        return torch.cat(outputs, dim=2).transpose(1, 2)

    results = []
    for attention in (chunked_causal_attention, masked_sdpa):
        out = attention(q, k, v, ends)
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        (out * weights).sum().backward()
        results.append([out.detach(), q.grad, k.grad, v.grad])
        q.grad = k.grad = v.grad = None
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, atol=2e-6, rtol=0)


def test_chunks_attend_in_autocasts_dtype():
    """Mixed precision: fp32 queries and keys (Qwen3's q/k norms keep fp32) with bf16 values attend in
    bf16, as SDPA does under autocast."""
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, 16, 8, generator=generator) for _ in range(2))
    v = torch.randn(1, 2, 16, 8, generator=generator).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = chunked_causal_attention(q, k, v, [8, 16])
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    assert out.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(out, want, atol=1e-2, rtol=0)


def test_the_cuda_bias_is_that_mask_and_is_made_under_selective_checkpointing():
    """CUDA's lower-right causal bias (fused kernels), made inside selective AC's dispatch mode."""
    with create_selective_checkpoint_contexts(lambda *args, **kwargs: CheckpointPolicy.PREFER_RECOMPUTE)[0]:
        bias = lower_right_bias(4, 12)
    expected = torch.ones(4, 12, dtype=torch.bool).tril(8)
    assert torch.equal(bias._materialize(torch.device("cpu")), expected)


CHECKPOINTS = ("--checkpoint.enable_checkpoint", "true", "--checkpoint.interval", "2")
CP2 = Layout("Qwen3 untied, 256 tokens: CP 2", 2, 4, 4, cp(2) + CHECKPOINTS, QWEN3_CP_CI)


def test_cp2_matches_one_process_and_resumes_exactly(tmp_path, reference_run):
    straight, killed, one = (tmp_path / name for name in ("straight", "killed", "one"))
    result = run_layout(CP2, straight, 10, reference_run(CP2.global_batch, CP2.model))
    assert result.error is None, result.error
    assert result.max_loss_diff <= 1e-5 and result.max_grad_norm_diff <= 1e-5, result
    assert result.max_validation_diff <= 1e-5 and result.step1_loss_diff <= 1e-6, result
    straight_losses = losses(straight)

    # Killed with SIGKILL (both ranks) once step 6 is saved, relaunched: the same losses, bit for bit.
    shutil.copytree(straight / "checkpoint" / "step-4", killed / "checkpoint" / "step-4")
    argv = [*TINY_JOB, *CP2.argv(10)]
    chaos.kill_once_saved(chaos.Job(2, killed, *argv), killed, 6)
    relaunch = chaos.Job(2, killed, *argv)
    assert relaunch.wait(300) == [0, 0], relaunch.output(0)[-3000:]
    assert "Resumed from step 6" in relaunch.output(0)
    logged = chaos.losses(killed)  # both launches'
    assert sorted({step for step, _ in logged}) == list(range(5, 11))
    assert [loss for _, loss in logged] == [straight_losses[step] for step, _ in logged]

    # CP 2's step 6 resumed by one process (the whole sequences, batch 4).
    shutil.copytree(straight / "checkpoint" / "step-6", one / "checkpoint" / "step-6")
    single = Layout("one process", 1, 4, 4, CHECKPOINTS, QWEN3_CP_CI)
    result = run_train(1, one, *single.argv(10))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Resumed from step 6" in result.stdout
    resumed = losses(one)
    assert sorted(resumed) == [7, 8, 9, 10]
    for step, loss in resumed.items():
        assert abs(loss - straight_losses[step]) < 1e-5, (step, loss, straight_losses[step])
