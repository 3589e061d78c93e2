"""Loss parity with 1 process of the composed layouts, the CI part of scripts/parity_matrix.py.

Each run composes several techniques so that few launches cover them all (4-process launches and a
cold torch.compile cost most): any one of them going wrong breaks its run's parity; FSDP 2 alone, the
plain data-parallel case, is here too. DDP's accumulation is checked in test_parallelisms.py. The script
runs each technique on its own as well, and DDP and AC every N-th block. The references (conftest.py's
reference_run) are shared with test_train.py, test_pipeline.py and test_chunked_loss.py."""

import pytest

from scripts.parity_matrix import (
    AC_FULL,
    AC_OP,
    COMPILE,
    FSDP_KNOBS,
    QWEN3_UNTIED,
    Layout,
    pp,
    replicate,
    run_layout,
    tp,
)

STEPS = 10  # reference_run's
MICROBATCHES_4 = ("--parallelism.pipeline_parallel_microbatches", "4")
SPLIT_POINTS = ("--parallelism.pipeline_parallel_split_points", "layers.1,layers.3,layers.5")
INTERLEAVED_SPLIT = pp(2, "Interleaved1F1B") + SPLIT_POINTS
TOL = 1e-5
CI_LAYOUTS = [
    Layout("FSDP 2", 2, 2, 4),
    Layout("TP 2 (SP, loss parallel) + GA 2 + AC full", 2, 2, 4, tp(2) + AC_FULL),
    Layout("HSDP 2x2 + GA 2, reshard always, prefetch 2", 4, 1, 8, replicate(2) + FSDP_KNOBS),
    # Qwen3 (its debug recipe's untied flavour): per-head q/k norms under TP, and the shared FSDP x TP
    # + selective AC and compile + selective AC paths, which Llama's debug model took here before (its
    # FSDP x TP + AC and compile runs are test_chunked_loss.py's); tied embeddings: test_parallelisms.py
    # on FSDP x TP, test_qwen3_resume.py on FSDP.
    Layout("Qwen3 untied: FSDP 2 x TP 2 + AC selective op", 4, 2, 4, tp(2) + AC_OP, QWEN3_UNTIED),
    Layout("Qwen3 untied: compile + AC selective op", 1, 4, 4, COMPILE + AC_OP, QWEN3_UNTIED),
    # Pipelines (their code is any family's): 1F1B on 4 micro-batches, Interleaved1F1B split by name.
    Layout("Qwen3 untied: PP 2, 1F1B, 4 micro-batches", 2, 4, 4, pp(2) + MICROBATCHES_4, QWEN3_UNTIED),
    Layout("Qwen3 untied: PP 2, Interleaved1F1B, split points", 2, 4, 4, INTERLEAVED_SPLIT, QWEN3_UNTIED),
]


@pytest.mark.parametrize("layout", CI_LAYOUTS, ids=lambda layout: layout.name)
def test_layout_matches_single_process(layout, reference_run, tmp_path):
    result = run_layout(layout, tmp_path, STEPS, reference_run(layout.global_batch, layout.model))
    assert result.error is None, result.error
    assert result.max_loss_diff <= TOL and result.max_grad_norm_diff <= TOL, result
    assert result.max_validation_diff <= TOL, result
    assert result.step1_loss_diff <= 1e-6, result  # the same init and data: at most float rounding
