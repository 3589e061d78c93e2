"""Loss parity with 1 process of the composed layouts, the CI part of scripts/parity_matrix.py.

Each run composes several techniques so that few launches cover them all (4-process launches and a
cold torch.compile cost most): any one of them going wrong breaks its run's parity. FSDP 2 alone is
test_train.py's; DDP's accumulation is checked in test_parallelisms.py. The script runs each technique
on its own as well, and DDP and AC every N-th block."""

import pytest

from scripts.parity_matrix import (
    AC_FULL,
    AC_OP,
    COMPILE,
    FSDP_KNOBS,
    Layout,
    replicate,
    run_layout,
    run_reference,
    tp,
)

STEPS = 10
TOL = 1e-5
CI_LAYOUTS = [
    Layout("TP 2 (SP, loss parallel) + GA 2 + AC full", 2, 2, 4, tp(2) + AC_FULL),
    Layout("FSDP 2 x TP 2 + AC selective op", 4, 2, 4, tp(2) + AC_OP),
    Layout("HSDP 2x2 + GA 2, reshard always, prefetch 2", 4, 1, 8, replicate(2) + FSDP_KNOBS),
    Layout("compile + AC selective op", 1, 4, 4, COMPILE + AC_OP),
]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The 1-process run of each global batch size, made on first use."""
    folder, runs = tmp_path_factory.mktemp("references"), {}

    def get(global_batch: int) -> list[dict]:
        if global_batch not in runs:
            runs[global_batch] = run_reference(folder / str(global_batch), global_batch, STEPS)
            assert runs[global_batch][-1]["loss"] < runs[global_batch][0]["loss"] - 0.5  # it trains
        return runs[global_batch]

    return get


@pytest.mark.parametrize("layout", CI_LAYOUTS, ids=lambda layout: layout.name)
def test_layout_matches_single_process(layout, references, tmp_path):
    result = run_layout(layout, tmp_path, STEPS, references(layout.global_batch))
    assert result.error is None, result.error
    assert result.max_loss_diff <= TOL and result.max_grad_norm_diff <= TOL, result
    assert result.max_validation_diff <= TOL, result
    assert result.step1_loss_diff <= 1e-6, result  # the same init and data: at most float rounding
