"""End-to-end runs of train.py under torchrun."""

from launch import VALIDATION, read_metrics, run_train, validation_losses


def check(result):
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def test_fsdp2_matches_single_process(tmp_path):
    """FSDP over 2 ranks with batch 2 each trains exactly like 1 process with batch 4, and evaluates
    the same validation loss; validation leaves training bit for bit as it was."""
    check(run_train(1, tmp_path / "one", "--training.batch_size", "4"))
    check(run_train(1, tmp_path / "one_validated", "--training.batch_size", "4", *VALIDATION))
    check(run_train(2, tmp_path / "fsdp", "--training.batch_size", "2", *VALIDATION))
    single, fsdp = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "fsdp")
    validated = read_metrics(tmp_path / "one_validated")
    assert [(m["loss"], m["grad_norm"]) for m in validated] == [(m["loss"], m["grad_norm"]) for m in single]
    reference, sharded = validation_losses(tmp_path / "one_validated"), validation_losses(tmp_path / "fsdp")
    assert sorted(reference) == sorted(sharded) == [5, 10]
    assert reference[10] < reference[5]  # it learns
    for step, loss in reference.items():
        assert abs(loss - sharded[step]) < 1e-5, (step, loss, sharded[step])
    assert [m["step"] for m in single] == list(range(1, 11))
    assert single[0]["loss"] == fsdp[0]["loss"] or abs(single[0]["loss"] - fsdp[0]["loss"]) < 1e-6
    for a, b in zip(single, fsdp, strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-5, (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) < 1e-5, (a, b)
    assert single[-1]["loss"] < single[0]["loss"] - 0.5


def test_bad_config_exits_with_one_line(tmp_path):
    result = run_train(1, tmp_path, "--training.batch_sise", "2")
    assert result.returncode != 0
    assert "error: unknown option --training.batch_sise; did you mean 'training.batch_size'?" in result.stderr
