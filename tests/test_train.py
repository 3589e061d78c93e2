"""End-to-end runs of train.py under torchrun.

FSDP 2 against 1 process is test_parity.py's "FSDP 2" layout (the losses, gradient norms and validation
losses within 1e-5); an unknown option under torchrun is test_bad_input.py's (in the worker's run()
and through run_llama_train.sh)."""

import pytest
from launch import TINY_JOB, read_metrics, read_records, run_train

from scripts.parity_matrix import run_reference
from torchtitan.config.parser import parse_args
from torchtitan.optimizers.build import lr_multiplier


def check(result):
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    """The tiny job on 1 process with batch 4, without validation: its dump folder."""
    folder = tmp_path_factory.mktemp("plain_run")
    check(run_train(1, folder, "--training.batch_size", "4"))
    return folder


def test_validation_leaves_training_as_it_was(plain_run, reference_run):
    """1 process with batch 4 trains bit for bit like the validated reference run (conftest.py's
    reference_run: validation at steps 5 and 10, falling), which evaluates in the middle of training."""
    plain, validated = read_metrics(plain_run), reference_run(4)
    assert not any("validation_loss" in r for r in read_records(plain_run))
    assert [m["step"] for m in plain] == list(range(1, 11))
    assert [(m["loss"], m["grad_norm"]) for m in plain] == [(m["loss"], m["grad_norm"]) for m in validated]


def test_each_step_logs_the_learning_rate_it_trained_with(plain_run):
    """Step N's `lr` is the rate its update used, read before the scheduler steps: step 1 of a warmup
    logs its first, smallest rate (the next step's was logged before)."""
    job = parse_args(TINY_JOB)
    steps = job.training.steps
    used = [job.optimizer.lr * lr_multiplier(n - 1, steps, job.lr_scheduler) for n in range(1, steps + 1)]
    assert [m["lr"] for m in read_metrics(plain_run)] == pytest.approx(used, rel=1e-12)


def test_two_runs_of_one_command_log_the_same_numbers_bit_for_bit(tmp_path, reference_run):
    """On CPU training is repeatable without `training.deterministic`: the reference run's command again
    gives the same losses, gradient norms and validation losses, bit for bit (docs/debugging.md)."""
    again, first = run_reference(tmp_path, 4, 10), reference_run(4)
    numbers = [[(m["loss"], m["grad_norm"], m["validation_loss"]) for m in run] for run in (again, first)]
    assert numbers[0] == numbers[1]
