"""Loss parity with 1 process of the composed layouts, the CI part of scripts/parity_matrix.py.

Each run composes several techniques so that few launches cover them all (4-process launches and a cold
torch.compile cost most): any one of them going wrong breaks its run's parity. HSDP with gradient
accumulation (test_checkpoint_resume.py: resumed by one process and by TP within 1e-5 of itself), FSDP
inside pipeline stages (test_pipeline.py) and Llama's TP with loss parallel and AC (Qwen3's block plan
extends it: the CP x TP and MoE layouts below, test_pipeline.py's PP x TP) are in other runs. DDP's
accumulation is checked in test_parallelisms.py. Muon (its matrices gathered over FSDP's shards with
gradient accumulation, its experts orthogonalised where EP holds them, its stages apart) joins two runs;
HSDP and TP with Muon: test_checkpoint_resume.py, EP's resume: test_moe_resume.py. The script runs each
technique on its own as well, and DDP and AC every N-th block. The references (conftest.py's
reference_run) are shared with test_train.py, test_pipeline.py, test_chunked_loss.py and
test_context_parallel.py."""

import shutil

import pytest
from launch import TINY_JOB

from scripts.parity_layouts import (
    AC_FULL,
    AC_OP,
    BLOCK_CAUSAL,
    CHUNKED_LOSS,
    DEEPSEEK_V3_MTP,
    FSDP_KNOBS,
    MATRIX,
    MUON,
    QWEN3_CP_CI,
    QWEN3_CP_CI_BLOCK,
    QWEN3_MOE_BOTH,
    QWEN3_MOE_MUON,
    SEQUENCE_AUX,
    Layout,
    cp,
    ep,
    pp,
    tp,
)
from scripts.parity_layouts_qwen3_5 import QWEN3_5_BLOCK, QWEN3_5_LAYOUTS
from scripts.parity_matrix import last_words, launch_output, run_layout

STEPS = 10  # reference_run's
MICROBATCHES_4 = ("--parallelism.pipeline_parallel_microbatches", "4")
TOL = 1e-5
CI_LAYOUTS = [
    # Context parallelism on 256-token sequences of Qwen3 (its per-head q/k norms and half-rotation RoPE
    # on each rank's chunks): under FSDP, with its knobs and gradient accumulation; with TP (Qwen3's
    # block plan extends Llama's: loss parallel, selective AC, the chunked loss and gradient
    # accumulation, FSDP over the cp ranks); inside pipeline stages (their code is any family's: 1F1B on
    # 4 micro-batches). All but CP x FSDP on packed documents attending within themselves (block_causal:
    # documents shorter than a chunk, across chunks and ranks, and through the pipeline's stages). CP 2
    # alone, its bitwise and cross-layout resume: test_context_parallel.py, whose unit tests hold CP 4's
    # dealt pieces to one process's attention (values and gradients); CP 4 end to end:
    # scripts/parity_matrix.py. Tied embeddings: test_parallelisms.py on FSDP x TP, test_qwen3_resume.py.
    Layout(
        "Qwen3 untied, 256 tokens, Muon: CP 2 x FSDP 2 + GA 2, reshard always, prefetch 2",
        4,
        1,
        4,
        cp(2) + FSDP_KNOBS,
        (*QWEN3_CP_CI, *MUON),
    ),
    Layout(
        "Qwen3 untied, 256 tokens, block_causal: CP 2 x TP 2 + GA 2 + AC selective op + chunked loss, "
        "reshard always",
        4,
        2,
        4,
        cp(2) + tp(2) + AC_OP + FSDP_KNOBS + CHUNKED_LOSS,
        QWEN3_CP_CI_BLOCK,
    ),
    Layout(
        "Qwen3 untied, 256 tokens, block_causal: PP 2 x CP 2, 1F1B, 4 micro-batches",
        4,
        4,
        4,
        pp(2) + cp(2) + MICROBATCHES_4,
        QWEN3_CP_CI_BLOCK,
    ),
    # Qwen3-MoE (docs/moe.md), both balancing methods on: expert parallelism with TP 2
    # on attention and its dense first layer (each tp rank routes its own sequence shard), activations
    # recomputed (the all-to-alls too) and the chunked loss; PP x EP: the stages pass the router
    # statistics on for the auxiliary loss and add their layers' sequence-wise balance loss to what they
    # pass on, and take the bias through their first-step shape inference unchanged (one micro-batch:
    # a pipeline's auxiliary loss is each micro-batch's, so with more it equals one process
    # accumulating the same micro-batches, scripts/parity_matrix.py's PP layouts).
    # The first with packed documents attending within themselves (block_causal: FSDP, EP, TP with
    # sequence parallelism, AC, the chunked loss; compile and selective op AC under EP with it:
    # test_chunked_loss.py, which shares its reference). EP 2 on FSDP 4, worst-case routing
    # and one EP 2 x TP 2 step's every gradient: test_parallelisms.py; EP 2 alone: test_moe_resume.py.
    Layout(
        "Qwen3-MoE aux + bias, block_causal: EP 2 x TP 2 + AC full + chunked loss",
        4,
        2,
        4,
        ep(2) + tp(2) + AC_FULL + CHUNKED_LOSS,
        (*QWEN3_MOE_BOTH, *BLOCK_CAUSAL),
    ),
    Layout(
        "Qwen3-MoE aux + sequence-wise + bias, Muon: PP 2 x EP 2, GPipe, 1 micro-batch",
        4,
        2,
        4,
        pp(2, "GPipe") + ep(2) + ("--parallelism.pipeline_parallel_microbatches", "1"),
        (*QWEN3_MOE_MUON, *SEQUENCE_AUX),
    ),
    # DeepSeek-V3's debug flavour (docs/models.md), every balancing method on, packed documents: MLA split
    # by heads under TP, its latents sequence-parallel and the shared RoPE key's gradient summed over the
    # tp ranks; DeepSeekMoE's shared expert, groups and routed scale under EP. FSDP 2, EP 2 alone and the
    # plain-q flavour under TP: scripts/parity_matrix.py; against transformers: test_deepseek_v3.py. With a
    # multi-token prediction depth (docs/objectives.md): its norms and eh_proj sequence-parallel, its MoE
    # block under EP, the shifted tokens' embeddings looked up with the batch's from the vocabulary
    # shards, and under CP each rank's depths given the whole sequence's shifted tokens; its loss
    # (mtp_loss_1) compared too. Its other layouts (PP with two schedules, the chunked loss, compile +
    # AC): scripts/parity_matrix.py; kill -9 on PP 2: test_moe_resume.py.
    Layout("DeepSeek-V3 MTP, block_causal: EP 2 x TP 2", 4, 2, 4, ep(2) + tp(2), DEEPSEEK_V3_MTP),
    # Context parallelism with a mixture of experts (the same reference): MLA gathers its latents over
    # the cp ranks; the experts' FSDP unit spans cp, and the expert counts and the auxiliary loss's
    # statistics are summed over dp x cp (docs/moe.md). CP 2 alone, Qwen3-MoE's CP 2 and CP 2 x TP 2:
    # scripts/parity_matrix.py; MLA's gathers against one process, value and gradient:
    # test_context_parallel.py.
    Layout("DeepSeek-V3 MTP, block_causal: CP 2 x EP 2", 4, 2, 4, cp(2) + ep(2), DEEPSEEK_V3_MTP),
]


@pytest.mark.parametrize("layout", CI_LAYOUTS, ids=lambda layout: layout.name)
def test_layout_matches_single_process(layout, reference_run, tmp_path):
    result = run_layout(layout, tmp_path, STEPS, reference_run(layout.global_batch, layout.model))
    assert result.error is None, f"{result.error}\n{launch_output(tmp_path)}"
    assert result.max_loss_diff <= TOL and result.max_grad_norm_diff <= TOL, result
    assert result.max_validation_diff <= TOL and result.max_moe_diff <= TOL, result
    assert result.step1_loss_diff <= 1e-6, result  # the same init and data: at most float rounding


# Qwen3.5 (issue 65), packed documents attending within themselves: Gated DeltaNet split by key head
# under TP (the conv's channels, the decay and the per-head norm with them), its state and conv window
# restarting at each document, its gated attention as Qwen3's, with FSDP and selective AC; a
# pipeline of one block a stage (3 Gated DeltaNet stages and an attention one) over 2 context-parallel
# ranks (Gated DeltaNet's pieces from zero states, their states chained and conv halos gathered over
# cp, through the pipeline's micro-batches), which resumes the TP run's checkpoint of step 5 (resharded
# across layouts: model, optimizer, data stream) and continues it. FSDP 2, TP 2, PP 2 1F1B, CP 2 (x
# FSDP 2, x TP 2) on their own and compile + AC (a cold compile of the chunked delta rule, ~4 minutes
# on 2 cores): scripts/parity_matrix.py; CP's pieces against one process, values and gradients:
# test_qwen3_5.py.
QWEN3_5_SAVE_5 = ("--checkpoint.enable_checkpoint", "true", "--checkpoint.interval", "5")
QWEN3_5_TP = Layout(
    "Qwen3.5, block_causal: FSDP 2 x TP 2 + AC selective op",
    4,
    2,
    4,
    tp(2) + AC_OP + QWEN3_5_SAVE_5,
    QWEN3_5_BLOCK,
)
QWEN3_5_PP = Layout(
    "Qwen3.5, block_causal: PP 2 x CP 2, Interleaved1F1B, from step 5",
    4,
    4,
    4,
    pp(2, "Interleaved1F1B") + cp(2) + QWEN3_5_SAVE_5,
    QWEN3_5_BLOCK,
)


def test_qwen3_5_matches_single_process_and_resumes_across_layouts(reference_run, tmp_path):
    reference = reference_run(4, QWEN3_5_BLOCK)
    result = run_layout(QWEN3_5_TP, tmp_path / "tp", STEPS, reference)
    assert result.error is None, f"{result.error}\n{launch_output(tmp_path / 'tp')}"
    assert result.max_loss_diff <= TOL and result.max_grad_norm_diff <= TOL, result
    assert result.max_validation_diff <= TOL and result.step1_loss_diff <= 1e-6, result
    shutil.copytree(tmp_path / "tp" / "checkpoint" / "step-5", tmp_path / "pp" / "checkpoint" / "step-5")
    later = [metrics for metrics in reference if metrics["step"] > 5]  # it logs steps 6 to 10 only
    result = run_layout(QWEN3_5_PP, tmp_path / "pp", STEPS, later)
    assert result.error is None, f"{result.error}\n{launch_output(tmp_path / 'pp')}"
    assert result.max_loss_diff <= TOL and result.max_grad_norm_diff <= TOL, result
    assert result.max_validation_diff <= TOL, result


def test_a_failed_launch_is_named_by_its_root_cause():
    """The one line a failed layout reports: the worker's error from torchrun's summary, not the
    agent's exception before it; the last line printed where the summary has none."""
    summary = [
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        "=" * 60,
        "Failures:",
        "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html",
        "Root Cause (first observed failure):",
        "  traceback : error: parallelism: the world size 2 is not divisible by 3",
        "=" * 60,
    ]
    assert last_words("\n".join(summary)) == "error: parallelism: the world size 2 is not divisible by 3"
    assert (
        last_words("Traceback (most recent call last):\nRuntimeError: timed out\n\n")
        == "RuntimeError: timed out"
    )


def test_every_layout_passes_the_preflight(tmp_path):
    """Every layout of scripts/parity_matrix.py (and CI's) is one the rules accept on its process count,
    with the tests' job (2 blocks): a schedule of two stages per rank needs its model at full depth."""
    from torchtitan.config.options import ConfigError
    from torchtitan.config.parser import parse_args
    from torchtitan.reliability.preflight import check_job

    refused = []
    for layout in [*MATRIX, *QWEN3_5_LAYOUTS, *CI_LAYOUTS, QWEN3_5_TP, QWEN3_5_PP]:
        try:
            check_job(
                parse_args([*TINY_JOB, "--job.dump_folder", str(tmp_path), *layout.argv(STEPS)]), layout.nproc
            )
        except ConfigError as e:
            refused.append(f"{layout.name}: {e}")
    assert refused == []
