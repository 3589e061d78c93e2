"""Qwen3.5's layouts (issue 65) for scripts/parity_matrix.py, made of scripts/parity_layouts.py's pieces
and run after its MATRIX: the debug flavour at its depth, 3 Gated DeltaNet blocks then one of gated
attention, on its own and on packed documents attending within themselves (block_causal). Under CP,
Gated DeltaNet runs each rank's pieces from zero states and chains them (parallelisms/
context_parallel_deltanet.py), its attention layers gather keys and values as every family's. Under TP,
Gated DeltaNet splits by key head (its conv's channels, decay and per-head norm with them); a pipeline
of 4 stages (Interleaved1F1B) holds each kind of block alone. The CI runs FSDP 2 x TP 2 and a PP 2 x
CP 2 resuming it (tests/test_parity.py); the compiled ones are the slow ones (on 2 CPU cores: compile +
AC 267 s, TP 2 + compile 362 s, CP 2 + compile 250 s, the others 6 to 35 s)."""

from scripts.parity_layouts import AC_OP, BLOCK_CAUSAL, COMPILE, HF_TOKENIZER, Layout, cp, deep, ep, pp, tp

QWEN3_5 = deep(("--model.name", "qwen3_5", *HF_TOKENIZER))
QWEN3_5_BLOCK = (*QWEN3_5, *BLOCK_CAUSAL)
# The mixture-of-experts flavour (qwen3_5_moe: a shared expert with its sigmoid gate in every block).
QWEN3_5_MOE = deep(("--model.name", "qwen3_5_moe", *HF_TOKENIZER))

QWEN3_5_LAYOUTS = [
    Layout("Qwen3.5: FSDP 2", 2, 2, 4, model=QWEN3_5),
    Layout("Qwen3.5: TP 2 (SP, loss parallel)", 2, 4, 4, tp(2), QWEN3_5),
    Layout("Qwen3.5: PP 2, 1F1B", 2, 4, 4, pp(2), QWEN3_5),
    Layout("Qwen3.5: PP 2, Interleaved1F1B", 2, 4, 4, pp(2, "Interleaved1F1B"), QWEN3_5),
    Layout("Qwen3.5: compile + AC selective op", 1, 4, 4, COMPILE + AC_OP, QWEN3_5),
    Layout("Qwen3.5, block_causal: FSDP 2 x TP 2 + AC selective op", 4, 2, 4, tp(2) + AC_OP, QWEN3_5_BLOCK),
    Layout("Qwen3.5, block_causal: TP 2 + compile", 2, 4, 4, tp(2) + COMPILE, QWEN3_5_BLOCK),
    Layout("Qwen3.5, block_causal: PP 2, Interleaved1F1B", 2, 4, 4, pp(2, "Interleaved1F1B"), QWEN3_5_BLOCK),
    Layout("Qwen3.5: CP 2", 2, 4, 4, cp(2), QWEN3_5),
    Layout("Qwen3.5, block_causal: CP 2", 2, 4, 4, cp(2), QWEN3_5_BLOCK),
    Layout("Qwen3.5, block_causal: CP 2 x FSDP 2", 4, 2, 4, cp(2), QWEN3_5_BLOCK),
    Layout("Qwen3.5, block_causal: CP 2 x TP 2", 4, 4, 4, cp(2) + tp(2), QWEN3_5_BLOCK),
    Layout(
        "Qwen3.5, block_causal: CP 2 + compile + AC selective op",
        2,
        4,
        4,
        cp(2) + COMPILE + AC_OP,
        QWEN3_5_BLOCK,
    ),
    Layout("Qwen3.5-MoE: EP 2", 2, 2, 4, ep(2), QWEN3_5_MOE),
    Layout("Qwen3.5-MoE: EP 2 x TP 2", 4, 2, 4, ep(2) + tp(2), QWEN3_5_MOE),
    Layout("Qwen3.5-MoE, block_causal: CP 2 x EP 2", 4, 2, 4, cp(2) + ep(2), (*QWEN3_5_MOE, *BLOCK_CAUSAL)),
    Layout("Qwen3.5-MoE, block_causal: PP 2, 1F1B", 2, 4, 4, pp(2), (*QWEN3_5_MOE, *BLOCK_CAUSAL), 2),
]
