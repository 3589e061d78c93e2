"""The layouts scripts/parity_matrix.py trains against one process, and what they are made of: the options
each technique adds (activation checkpointing, compile, the chunked loss, each parallel degree), the
models' options (Llama 3's debug model by default, Qwen3 tied and untied, Qwen3-MoE, DeepSeek-V3, long
sequences, packed documents, Muon) and MATRIX, every layout the script runs. The tests compose their CI
runs of the same pieces (tests/test_parity.py and others)."""

import math
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # tests/launch.py
from launch import VALIDATION  # noqa: E402

AC_FULL = ("--activation_checkpoint.mode", "full")
AC_OP = ("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op")
AC_EVERY_2 = ("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2")
COMPILE = ("--training.compile", "true")
CHUNKED_LOSS = ("--training.loss_chunk_tokens", "48")  # divides neither 64- nor 128-token micro-batches
TP_DEGREE = "--parallelism.tensor_parallel_degree"
PP_DEGREE = "--parallelism.pipeline_parallel_degree"
CP_DEGREE = "--parallelism.context_parallel_degree"
VALIDATION_BATCH = 4  # sequences per global validation batch, the same in every layout


@dataclass(frozen=True)
class Layout:
    name: str
    nproc: int
    batch_size: int  # per data-parallel rank and micro-batch
    global_batch: int  # sequences per step; the reference runs them as one batch on one process
    args: tuple[str, ...] = ()
    # The model's options (and the sequence length), shared with the reference (default: Llama 3's).
    model: tuple[str, ...] = ()
    # The reference's micro-batch, in sequences (0: the whole global batch). A mixture of experts'
    # auxiliary loss is a micro-batch's (not linear in its tokens): a pipeline's is compared with one
    # process accumulating the same micro-batches.
    reference_microbatch: int = 0
    # Whether it validates (steps 5 and 10): V schedules cannot evaluate (torch's schedule.eval), so
    # their layouts compare the training losses and gradient norms only.
    validate: bool = True

    @property
    def reference(self) -> tuple[int, tuple[str, ...], int]:
        return self.global_batch, self.model, self.reference_microbatch

    @property
    def dp_degree(self) -> int:
        args = list(self.args)
        degrees = [
            int(args[args.index(option) + 1])
            for option in (TP_DEGREE, PP_DEGREE, CP_DEGREE)
            if option in args
        ]
        return self.nproc // math.prod(degrees)

    def argv(self, steps: int) -> list[str]:
        return [
            "--training.steps",
            str(steps),
            "--training.batch_size",
            str(self.batch_size),
            "--training.global_batch_size",
            str(self.global_batch),
            *(
                (*VALIDATION, "--validation.batch_size", str(VALIDATION_BATCH // self.dp_degree))
                if self.validate
                else ("--validation.enable", "false")
            ),
            *self.model,
            *self.args,
        ]


def pp(n: int, schedule: str = "1F1B") -> tuple[str, ...]:
    return (PP_DEGREE, str(n), "--parallelism.pipeline_parallel_schedule", schedule)


def ep(n: int) -> tuple[str, ...]:
    return ("--parallelism.expert_parallel_degree", str(n))


def cp(n: int) -> tuple[str, ...]:
    return (CP_DEGREE, str(n))


def replicate(n: int) -> tuple[str, ...]:
    return ("--parallelism.data_parallel_replicate_degree", str(n))


def tp(n: int, loss_parallel: bool = True) -> tuple[str, ...]:
    return (
        TP_DEGREE,
        str(n),
        "--parallelism.enable_loss_parallel",
        str(loss_parallel).lower(),
    )


FSDP_KNOBS = (
    "--parallelism.fsdp_reshard_after_forward",
    "always",
    "--parallelism.fsdp_forward_prefetch",
    "2",
    "--parallelism.fsdp_backward_prefetch",
    "2",
)
# The blocks gathered whole in fp32 (one FSDP unit and one compiled graph each), autocast rounding.
FP32_GATHER = ("--parallelism.fsdp_gather_dtype", "float32")

# Qwen3's debug flavours on the bundled tokenizer.json: embeddings tied to the output layer (as in 0.6B
# to 4B) and untied (8B and up; pipeline stages cannot share a tied table).
QWEN3 = ("--model.name", "qwen3", "--model.tokenizer_path", "assets/tokenizer/kjv_bpe_hf")
QWEN3_UNTIED = (*QWEN3, "--model.flavor", "debugmodel")
QWEN3_TIED = (*QWEN3, "--model.flavor", "debugmodel_tied")
# Qwen3-MoE's debug flavour (8 experts, top 2, a dense first layer), its experts balanced by the auxiliary
# loss (the default) or by DeepSeek-V3's routing bias alone.
# Context parallelism splits sequences: long enough ones (512 tokens) that each rank's chunks span
# many positions. The reference runs the same length.
LONG = ("--training.seq_len", "512")
QWEN3_LONG = (*QWEN3_UNTIED, *LONG)
# CI's context-parallel runs (tests/): 256 tokens, still 8 chunks of 32 at CP 4, at half the time.
QWEN3_CP_CI = (*QWEN3_UNTIED, "--training.seq_len", "256")


def deep(model: tuple[str, ...]) -> tuple[str, ...]:
    """`model` at its flavour's depth, for the multi-stage schedules' 4 stages at PP 2 (tests/launch.py's
    tiny job has 2 blocks: the mixtures of experts' debug flavours then hold a dense and a sparse one)."""
    return (*model, "--model.n_layers", "0")


HF_TOKENIZER = ("--model.tokenizer_path", "assets/tokenizer/kjv_bpe_hf")
QWEN3_MOE = ("--model.name", "qwen3_moe", *HF_TOKENIZER)
QWEN3_MOE_BIAS = (*QWEN3_MOE, "--moe.aux_loss_weight", "0", "--moe.bias_update_rate", "0.01")
QWEN3_MOE_BOTH = (*QWEN3_MOE, "--moe.bias_update_rate", "0.01")
# Packed documents attending within themselves (model.attn_mask_type, docs/attention.md), on documents
# short enough (the verses of the bundled validation split, ~35 tokens) that every window holds some.
BLOCK_CAUSAL = (
    "--model.attn_mask_type",
    "block_causal",
    "--training.dataset_path",
    "tests/assets/verses.jsonl",
)
# Chat data (docs/datasets.md): the bundled conversations, each a document of its own (positions), trained
# on the assistant's turns only: the loss is the mean over the global batch's trained tokens, which every
# layout must count alike (dp, cp shards, pipeline micro-batches), validated on the set's validation split
# (the mean over its trained tokens). 256 tokens: CP 2's chunks hold several.
CHAT = (
    *QWEN3_UNTIED,
    "--model.attn_mask_type",
    "block_causal",
    "--chat.enable",
    "true",
    "--training.dataset",
    "kjv_chat",
    "--training.seq_len",
    "256",
    "--validation.dataset",
    "kjv_chat",
)
# Muon for the blocks' matrices (docs/optimizers.md), its Newton-Schulz in fp32 (exact, and fast on CPUs).
MUON = ("--optimizer.name", "Muon", "--optimizer.muon_ns_dtype", "float32")
QWEN3_MOE_MUON = (*QWEN3_MOE_BOTH, *MUON)
LLAMA_BLOCK = (*LONG, *BLOCK_CAUSAL)
QWEN3_BLOCK = (*QWEN3_LONG, *BLOCK_CAUSAL)
QWEN3_CP_CI_BLOCK = (*QWEN3_CP_CI, *BLOCK_CAUSAL)
QWEN3_MOE_BLOCK = (*QWEN3_MOE, *BLOCK_CAUSAL)
QWEN3_MOE_BLOCK_BOTH = (*QWEN3_MOE_BOTH, *BLOCK_CAUSAL)
# DeepSeek-V3's sequence-wise balance loss (docs/moe.md), weighted 100 x DeepSeek's alpha so that a wrong
# reduction of it shows in the losses.
SEQUENCE_AUX = ("--moe.sequence_aux_loss_weight", "0.01")
# DeepSeek-V3's debug flavour (MLA with a q LoRA and YaRN, sigmoid routing in 2 groups, a shared expert,
# a dense first block then a sparse one), every balancing method on (the batch-wise auxiliary loss,
# DeepSeek-V3's routing bias and its sequence-wise loss), on packed documents attending within themselves.
DEEPSEEK_V3 = (
    "--model.name",
    "deepseek_v3",
    "--model.tokenizer_path",
    "assets/tokenizer/kjv_bpe_hf",
    "--moe.bias_update_rate",
    "0.01",
    *SEQUENCE_AUX,
    *BLOCK_CAUSAL,
)
DEEPSEEK_V3_PLAIN_Q = (*DEEPSEEK_V3, "--model.flavor", "debugmodel_plain_q")
# DeepSeek-V3's own balancing (the bias and the sequence-wise loss), and Qwen3-MoE's with the sequence-wise
# loss alone: neither depends on how a batch is split into micro-batches, so each layout below is compared
# with one process on the whole batch.
DEEPSEEK_V3_OWN = (*DEEPSEEK_V3, "--moe.aux_loss_weight", "0")
QWEN3_MOE_SEQUENCE = (*QWEN3_MOE, "--moe.aux_loss_weight", "0", *SEQUENCE_AUX)
# DeepSeek-V3 with one multi-token prediction depth (docs/objectives.md): its loss per depth (mtp_loss_1) is
# compared too; the depth's block is a mixture of experts.
DEEPSEEK_V3_MTP = (*DEEPSEEK_V3, "--model.mtp_layers", "1")
# 4 layers, 2 dense then 2 sparse: the multi-stage schedules' 4 stages at PP 2 (one layer each; a rank
# holds a dense and a sparse stage).
DEEPSEEK_V3_4_LAYERS = deep((*DEEPSEEK_V3, "--model.flavor", "debugmodel_4_layers"))
# Balanced by the routing bias alone (as DeepSeek-V3 was): under PP x EP a micro-batch's auxiliary loss
# pools the data-parallel ranks' rows of it, which no one process's micro-batches group alike.
DEEPSEEK_V3_4_LAYERS_BIAS = (*DEEPSEEK_V3_4_LAYERS, "--moe.aux_loss_weight", "0")


# The 4-layer flavour with one depth, for the multi-stage schedules (the depth on the last stage).
DEEPSEEK_V3_MTP_4_LAYERS = (*DEEPSEEK_V3_4_LAYERS, "--model.mtp_layers", "1")


def mtp(
    name: str, nproc: int, batch: int, args: tuple = (), model: tuple = DEEPSEEK_V3_MTP, micro: int = 0
) -> Layout:
    """A DeepSeek-V3 layout with one MTP depth on a global batch of 4 (V schedules without validation)."""
    validate = not any(schedule in args for schedule in ("ZBVZeroBubble", "DualPipeV"))
    return Layout(f"DeepSeek-V3 MTP: {name}", nproc, batch, 4, args, model, micro, validate)


def deepseek_v3_pp(schedule: str, extra: tuple[str, ...] = ()) -> Layout:
    """DeepSeek-V3 on PP 2 with `schedule`, against one process accumulating the same micro-batches (a
    micro-batch's auxiliary loss): the 2-block debug model's 2 stages of 2 micro-batches for GPipe and
    1F1B, the 4-layer one's 4 stages of 1 for the others (V schedules without validation)."""
    single = schedule in ("GPipe", "1F1B")
    name = "DeepSeek-V3" if single else "DeepSeek-V3 4 layers"
    suffix = " + compile" if COMPILE[0] in extra else ""
    return Layout(
        f"{name}, block_causal: PP 2, {schedule}{suffix}",
        2,
        4,
        4,
        pp(2, schedule) + extra,
        DEEPSEEK_V3 if single else DEEPSEEK_V3_4_LAYERS,
        reference_microbatch=2 if single else 1,
        validate=schedule not in ("ZBVZeroBubble", "DualPipeV"),
    )


MATRIX = [
    Layout("FSDP 2", 2, 2, 4),
    Layout("DDP 2", 2, 2, 4, replicate(2)),
    Layout("HSDP 2x2", 4, 1, 4, replicate(2)),
    Layout("TP 2 (SP, loss parallel)", 2, 4, 4, tp(2)),
    Layout("TP 2 (SP, gathered logits)", 2, 4, 4, tp(2, loss_parallel=False)),
    Layout("FSDP 2 x TP 2", 4, 2, 4, tp(2)),
    Layout("DDP 2 x TP 2", 4, 2, 4, replicate(2) + tp(2)),
    Layout("GA 2 x batch 2 (1 process)", 1, 2, 4),
    Layout("FSDP 2 + GA 2", 2, 1, 4),
    Layout("HSDP 2x2 + GA 2", 4, 1, 8, replicate(2)),
    Layout("FSDP 2, reshard always, prefetch 2", 2, 2, 4, FSDP_KNOBS),
    Layout("FSDP 2, reshard never", 2, 2, 4, ("--parallelism.fsdp_reshard_after_forward", "never")),
    Layout("FSDP 2, gathered in fp32 + compile", 2, 2, 4, FP32_GATHER + COMPILE),
    Layout("HSDP 2x2, gathered in fp32", 4, 1, 4, replicate(2) + FP32_GATHER),
    Layout("AC full", 1, 4, 4, AC_FULL),
    Layout("AC selective op", 1, 4, 4, AC_OP),
    Layout("AC selective every 2nd block", 1, 4, 4, AC_EVERY_2),
    Layout("FSDP 2 x TP 2 + AC selective op", 4, 2, 4, tp(2) + AC_OP),
    Layout("compile", 1, 4, 4, COMPILE),
    Layout("compile + AC selective op", 1, 4, 4, COMPILE + AC_OP),
    Layout("chunked loss (1 process)", 1, 4, 4, CHUNKED_LOSS),
    Layout("DDP 2 + chunked loss", 2, 2, 4, replicate(2) + CHUNKED_LOSS),
    Layout("TP 2 (SP, loss parallel) + chunked loss", 2, 4, 4, tp(2) + CHUNKED_LOSS),
    Layout("FSDP 2 + GA 2 + chunked loss, reshard always", 2, 1, 4, FSDP_KNOBS + CHUNKED_LOSS),
    Layout("compile + AC selective op + chunked loss", 1, 4, 4, COMPILE + AC_OP + CHUNKED_LOSS),
    # Tied under TP: test_parallelisms.py checks a step's gradients; over 10 steps Adam amplifies the
    # rounding of the table's two summed gradients past 1e-5 in the gradient norm (docs/models.md).
    Layout("Qwen3 tied: FSDP 2", 2, 2, 4, model=QWEN3_TIED),
    Layout("Qwen3 tied: HSDP 2x2", 4, 1, 4, replicate(2), QWEN3_TIED),
    Layout("Qwen3 untied: TP 2 (SP, loss parallel)", 2, 4, 4, tp(2), QWEN3_UNTIED),
    Layout("Qwen3 untied: FSDP 2 x TP 2 + AC selective op", 4, 2, 4, tp(2) + AC_OP, QWEN3_UNTIED),
    Layout("Qwen3 untied: TP 2 + chunked loss + GA 2", 2, 2, 4, tp(2) + CHUNKED_LOSS, QWEN3_UNTIED),
    Layout("Qwen3 untied: PP 2, 1F1B", 2, 4, 4, pp(2), QWEN3_UNTIED),
    Layout("Qwen3 untied: PP 2, Interleaved1F1B", 2, 4, 4, pp(2, "Interleaved1F1B"), deep(QWEN3_UNTIED)),
    Layout("Qwen3 untied: compile + AC selective op", 1, 4, 4, COMPILE + AC_OP, QWEN3_UNTIED),
    Layout("Qwen3-MoE: FSDP 2", 2, 2, 4, model=QWEN3_MOE),
    Layout("Qwen3-MoE: HSDP 2x2", 4, 1, 4, replicate(2), QWEN3_MOE),
    Layout("Qwen3-MoE: FSDP 2 + AC full", 2, 2, 4, AC_FULL, QWEN3_MOE),
    Layout("Qwen3-MoE: compile + AC selective op", 1, 4, 4, COMPILE + AC_OP, QWEN3_MOE),
    Layout("Qwen3-MoE: FSDP 2 + chunked loss", 2, 2, 4, CHUNKED_LOSS, QWEN3_MOE),
    Layout("Qwen3-MoE: FSDP 2, gathered in fp32 + compile", 2, 2, 4, FP32_GATHER + COMPILE, QWEN3_MOE),
    Layout("Qwen3-MoE bias: FSDP 2", 2, 2, 4, model=QWEN3_MOE_BIAS),
    Layout("Qwen3-MoE bias: FSDP 2 + GA 2 + AC full", 2, 1, 4, AC_FULL, QWEN3_MOE_BIAS),
    Layout("Qwen3-MoE bias: PP 2, 1F1B", 2, 4, 4, pp(2), QWEN3_MOE_BIAS),
    Layout("Qwen3-MoE bias: PP 2, Interleaved1F1B", 2, 4, 4, pp(2, "Interleaved1F1B"), deep(QWEN3_MOE_BIAS)),
    Layout("Qwen3-MoE: EP 2", 2, 2, 4, ep(2), QWEN3_MOE),
    Layout("Qwen3-MoE: EP 2 on FSDP 4", 4, 1, 4, ep(2), QWEN3_MOE),
    Layout("Qwen3-MoE: EP 2, HSDP 2x2", 4, 1, 4, ep(2) + replicate(2), QWEN3_MOE),
    Layout("Qwen3-MoE: EP 2 + AC full + chunked loss", 2, 2, 4, ep(2) + AC_FULL + CHUNKED_LOSS, QWEN3_MOE),
    Layout("Qwen3-MoE: EP 2 + AC every 2nd block", 2, 2, 4, ep(2) + AC_EVERY_2, QWEN3_MOE),
    Layout("Qwen3-MoE: EP 2 + compile", 2, 2, 4, ep(2) + COMPILE, QWEN3_MOE),
    Layout("Qwen3-MoE bias: EP 2", 2, 2, 4, ep(2), QWEN3_MOE_BIAS),
    Layout("Qwen3-MoE bias: EP 2 + GA 2", 2, 1, 4, ep(2), QWEN3_MOE_BIAS),
    Layout("Qwen3-MoE bias: PP 2 x EP 2", 4, 2, 4, pp(2) + ep(2), QWEN3_MOE_BIAS),
    Layout("Qwen3-MoE: PP 2, 1F1B", 2, 4, 4, pp(2), QWEN3_MOE, reference_microbatch=2),
    Layout("Qwen3-MoE: PP 2, Interleaved1F1B", 2, 4, 4, pp(2, "Interleaved1F1B"), deep(QWEN3_MOE), 1),
    Layout(
        "Qwen3-MoE aux + bias: PP 2 x EP 2, GPipe, 1 micro-batch",
        4,
        2,
        4,
        pp(2, "GPipe") + ep(2) + ("--parallelism.pipeline_parallel_microbatches", "1"),
        QWEN3_MOE_BOTH,
    ),
    Layout("Qwen3-MoE: EP 2 x TP 2", 4, 2, 4, ep(2) + tp(2), QWEN3_MOE),
    Layout("Qwen3-MoE bias: EP 2 x TP 2", 4, 2, 4, ep(2) + tp(2), QWEN3_MOE_BIAS),
    Layout("Qwen3-MoE: FSDP 2 x TP 2", 4, 2, 4, tp(2), QWEN3_MOE),
    Layout("Qwen3-MoE: FSDP 2 x TP 2 + AC selective op", 4, 2, 4, tp(2) + AC_OP, QWEN3_MOE),
    Layout("Qwen3-MoE: EP 2 + AC selective op", 2, 2, 4, ep(2) + AC_OP, QWEN3_MOE),
    Layout("Qwen3-MoE: EP 2 + compile + AC selective op", 2, 2, 4, ep(2) + COMPILE + AC_OP, QWEN3_MOE),
    Layout(
        "Qwen3-MoE: EP 2 x TP 2 + AC full + chunked loss",
        4,
        2,
        4,
        ep(2) + tp(2) + AC_FULL + CHUNKED_LOSS,
        QWEN3_MOE,
    ),
    Layout("Llama, 512 tokens: CP 2", 2, 4, 4, cp(2), LONG),
    Layout("Llama, 512 tokens: CP 4", 4, 4, 4, cp(4), LONG),
    Layout("Llama, 512 tokens: CP 2 x FSDP 2", 4, 2, 4, cp(2), LONG),
    Layout("Llama, 512 tokens: CP 2 x TP 2", 4, 4, 4, cp(2) + tp(2), LONG),
    Layout("Llama, 512 tokens: PP 2 x CP 2", 4, 4, 4, pp(2) + cp(2), LONG),
    Layout("Qwen3 untied, 512 tokens: CP 2", 2, 4, 4, cp(2), QWEN3_LONG),
    Layout("Qwen3 untied, 512 tokens: CP 4", 4, 4, 4, cp(4), QWEN3_LONG),
    Layout("Qwen3 untied, 512 tokens: CP 2 x FSDP 2", 4, 2, 4, cp(2), QWEN3_LONG),
    Layout("Qwen3 untied, 512 tokens: HSDP 2 x CP 2", 4, 2, 4, cp(2) + replicate(2), QWEN3_LONG),
    Layout("Qwen3 untied, 512 tokens: CP 2 + GA 2 + AC full", 2, 2, 4, cp(2) + AC_FULL, QWEN3_LONG),
    Layout(
        "Qwen3 untied, 512 tokens: CP 2 + compile + AC selective op",
        2,
        4,
        4,
        cp(2) + COMPILE + AC_OP,
        QWEN3_LONG,
    ),
    Layout("Qwen3 untied, 512 tokens: CP 2 + chunked loss", 2, 4, 4, cp(2) + CHUNKED_LOSS, QWEN3_LONG),
    Layout(
        "Qwen3 untied, 512 tokens: CP 2 x TP 2 + GA 2 + AC selective op + chunked loss, reshard always",
        4,
        2,
        4,
        cp(2) + tp(2) + AC_OP + FSDP_KNOBS + CHUNKED_LOSS,
        QWEN3_LONG,
    ),
    Layout(
        "Qwen3 untied, 512 tokens: PP 2 x CP 2, 1F1B, 4 micro-batches",
        4,
        4,
        4,
        pp(2) + cp(2) + ("--parallelism.pipeline_parallel_microbatches", "4"),
        QWEN3_LONG,
    ),
    # Packed documents attending within themselves (block_causal), ~35-token documents in 512 tokens.
    Layout("Llama, 512 tokens, block_causal: FSDP 2", 2, 2, 4, model=LLAMA_BLOCK),
    Layout("Llama, 512 tokens, block_causal: TP 2", 2, 4, 4, tp(2), LLAMA_BLOCK),
    Layout("Llama, 512 tokens, block_causal: CP 2", 2, 4, 4, cp(2), LLAMA_BLOCK),
    Layout("Llama, 512 tokens, block_causal: CP 4", 4, 4, 4, cp(4), LLAMA_BLOCK),
    Layout("Llama, 512 tokens, block_causal: CP 2 x TP 2", 4, 4, 4, cp(2) + tp(2), LLAMA_BLOCK),
    Layout("Llama, 512 tokens, block_causal: PP 2, 1F1B", 2, 4, 4, pp(2), LLAMA_BLOCK),
    Layout("Llama, 512 tokens, block_causal: compile + AC op", 1, 4, 4, COMPILE + AC_OP, LLAMA_BLOCK),
    Layout("Qwen3 untied, 512 tokens, block_causal: CP 2 x FSDP 2", 4, 2, 4, cp(2), QWEN3_BLOCK),
    Layout("Qwen3 untied, 512 tokens, block_causal: PP 2 x CP 2, 1F1B", 4, 4, 4, pp(2) + cp(2), QWEN3_BLOCK),
    Layout("Qwen3-MoE, block_causal: EP 2", 2, 2, 4, ep(2), QWEN3_MOE_BLOCK),
    Layout("Qwen3-MoE, block_causal: PP 2, 1F1B", 2, 4, 4, pp(2), QWEN3_MOE_BLOCK, reference_microbatch=2),
    Layout("DeepSeek-V3, block_causal: FSDP 2", 2, 2, 4, model=DEEPSEEK_V3),
    Layout("DeepSeek-V3, block_causal: EP 2", 2, 2, 4, ep(2), DEEPSEEK_V3),
    Layout("DeepSeek-V3, block_causal: FSDP 2 x TP 2", 4, 2, 4, tp(2), DEEPSEEK_V3),
    Layout("DeepSeek-V3, block_causal: EP 2 x TP 2", 4, 2, 4, ep(2) + tp(2), DEEPSEEK_V3),
    Layout("DeepSeek-V3 plain q, block_causal: FSDP 2 x TP 2", 4, 2, 4, tp(2), DEEPSEEK_V3_PLAIN_Q),
    # Every pipeline schedule; the dense and the sparse layers in one pipeline.
    *(
        deepseek_v3_pp(schedule)
        for schedule in (
            "GPipe",
            "1F1B",
            "Interleaved1F1B",
            "LoopedBFS",
            "InterleavedZeroBubble",
            "ZBVZeroBubble",
            "DualPipeV",
        )
    ),
    deepseek_v3_pp("Interleaved1F1B", COMPILE),  # torchtitan's #2124: it did not compile there
    Layout(
        "DeepSeek-V3 4 layers bias, block_causal: PP 2 x EP 2, Interleaved1F1B, 2 micro-batches",
        4,
        2,
        4,
        pp(2, "Interleaved1F1B") + ep(2) + ("--parallelism.pipeline_parallel_microbatches", "2"),
        DEEPSEEK_V3_4_LAYERS_BIAS,
    ),
    Layout(
        "DeepSeek-V3 4 layers bias, block_causal: PP 2 x EP 2, DualPipeV",
        4,
        4,
        8,
        pp(2, "DualPipeV") + ep(2),
        DEEPSEEK_V3_4_LAYERS_BIAS,
        validate=False,
    ),
    Layout("DeepSeek-V3, block_causal: HSDP 2x2 + AC full", 4, 1, 4, replicate(2) + AC_FULL, DEEPSEEK_V3),
    Layout("DeepSeek-V3, block_causal: compile + AC selective op", 1, 4, 4, COMPILE + AC_OP, DEEPSEEK_V3),
    # Context parallelism with a mixture of experts: the cp ranks route their own tokens (expert counts,
    # the auxiliary loss's statistics and the gradients over dp x cp); MLA gathers its latents.
    Layout("DeepSeek-V3, block_causal: CP 2", 2, 4, 4, cp(2), DEEPSEEK_V3),
    Layout("DeepSeek-V3, block_causal: CP 2 x EP 2", 4, 2, 4, cp(2) + ep(2), DEEPSEEK_V3),
    Layout("Qwen3-MoE: CP 2", 2, 4, 4, cp(2), QWEN3_MOE),
    Layout("Qwen3-MoE aux + bias, block_causal: CP 2 x TP 2", 4, 4, 4, cp(2) + tp(2), QWEN3_MOE_BLOCK_BOTH),
    Layout("DeepSeek-V3 plain q, block_causal: CP 2", 2, 4, 4, cp(2), DEEPSEEK_V3_PLAIN_Q),
    Layout(
        "DeepSeek-V3, block_causal: CP 2 + compile + AC selective op",
        2,
        4,
        4,
        cp(2) + COMPILE + AC_OP,
        DEEPSEEK_V3,
    ),
    Layout("Qwen3-MoE bias: PP 2 x CP 2, 1F1B", 4, 4, 4, pp(2) + cp(2), QWEN3_MOE_BIAS),
    Layout(
        "DeepSeek-V3 bias + sequence-wise, block_causal: FSDP 2 + GA 2 + AC full",
        2,
        1,
        4,
        AC_FULL,
        DEEPSEEK_V3_OWN,
    ),
    Layout("DeepSeek-V3 bias + sequence-wise, block_causal: EP 2 + GA 2", 2, 1, 4, ep(2), DEEPSEEK_V3_OWN),
    Layout(
        "Qwen3-MoE sequence-wise: PP 2, InterleavedZeroBubble",
        2,
        4,
        4,
        pp(2, "InterleavedZeroBubble"),
        deep(QWEN3_MOE_SEQUENCE),
    ),
    Layout(
        "Qwen3-MoE aux + sequence-wise: PP 2, Interleaved1F1B",
        2,
        4,
        4,
        pp(2, "Interleaved1F1B"),
        deep((*QWEN3_MOE, *SEQUENCE_AUX)),
        reference_microbatch=1,
    ),
    mtp("FSDP 2", 2, 2),
    mtp("EP 2", 2, 2, ep(2)),
    mtp("FSDP 2 x TP 2", 4, 2, tp(2)),
    mtp("EP 2 x TP 2", 4, 2, ep(2) + tp(2)),
    mtp("FSDP 2 + chunked loss", 2, 2, CHUNKED_LOSS),
    mtp("GA 2 x batch 2 (1 process)", 1, 2, micro=2),
    mtp("PP 2, 1F1B", 2, 4, pp(2), micro=2),
    mtp("PP 2, GPipe", 2, 4, pp(2, "GPipe"), micro=2),
    mtp("PP 2, 1F1B + chunked loss", 2, 4, pp(2) + CHUNKED_LOSS, micro=2),
    mtp("compile + AC selective op", 1, 4, COMPILE + AC_OP),
    mtp("HSDP 2x2 + AC full", 4, 1, replicate(2) + AC_FULL),
    mtp("DDP 2", 2, 2, replicate(2)),
    *(
        mtp(f"PP 2, {schedule}, 4 layers", 2, 4, pp(2, schedule), DEEPSEEK_V3_MTP_4_LAYERS, micro=1)
        for schedule in ("Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
    ),
    mtp("CP 2", 2, 4, cp(2)),
    mtp("CP 2 x EP 2", 4, 2, cp(2) + ep(2)),
    mtp("PP 2 x CP 2, 1F1B", 4, 4, pp(2) + cp(2), micro=2),
    # Chat data: the trained tokens counted over dp, once per row under CP and TP, over a pipeline's step.
    Layout("Chat: FSDP 2", 2, 2, 4, model=CHAT),
    Layout("Chat: FSDP 2 + GA 2 + chunked loss", 2, 1, 4, CHUNKED_LOSS, CHAT),
    Layout("Chat: TP 2 (SP, loss parallel)", 2, 4, 4, tp(2), CHAT),
    Layout("Chat: TP 2 (SP, gathered logits) + chunked loss", 2, 4, 4, tp(2, False) + CHUNKED_LOSS, CHAT),
    Layout("Chat: CP 2", 2, 4, 4, cp(2), CHAT),
    Layout("Chat: CP 2 x FSDP 2 + GA 2", 4, 1, 4, cp(2), CHAT),
    Layout("Chat: PP 2, 1F1B", 2, 4, 4, pp(2), CHAT),
    Layout(
        "Chat: PP 2, Interleaved1F1B + chunked loss",
        2,
        4,
        4,
        pp(2, "Interleaved1F1B") + CHUNKED_LOSS,
        deep(CHAT),
    ),
    Layout(
        "Chat: PP 2 x FSDP 2",
        4,
        2,
        4,
        pp(2) + ("--parallelism.pipeline_parallel_microbatches", "2"),
        CHAT,
    ),
    Layout(
        "Chat: PP 2 x CP 2, 4 micro-batches",
        4,
        4,
        4,
        pp(2) + cp(2) + ("--parallelism.pipeline_parallel_microbatches", "4"),
        CHAT,
    ),
    Layout("Chat: CP 2 x TP 2 + GA 2 + AC selective op", 4, 2, 4, cp(2) + tp(2) + AC_OP, CHAT),
    # Muon: each rank gathers the matrices it holds a shard or slice of (docs/optimizers.md).
    Layout("Muon: FSDP 2", 2, 2, 4, model=MUON),
    Layout("Muon: TP 2", 2, 4, 4, tp(2), MUON),
    Layout("Muon: FSDP 2 x TP 2 + GA 2", 4, 1, 4, tp(2), MUON),
    Layout("Muon: HSDP 2x2", 4, 1, 4, replicate(2), MUON),
    Layout("Muon: PP 2, 1F1B", 2, 4, 4, pp(2), MUON),
    Layout("Muon: GA 2 x batch 2 (1 process)", 1, 2, 4, model=MUON),
    Layout("Qwen3-MoE Muon: EP 2", 2, 2, 4, ep(2), QWEN3_MOE_MUON),
    Layout("Qwen3-MoE Muon: EP 2 on FSDP 4", 4, 1, 4, ep(2), QWEN3_MOE_MUON),
]
