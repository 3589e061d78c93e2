"""The default recipe trains its stored curve (scripts/loss_curve.py): every step's loss and gradient
norm, and the validation losses of steps 50 and 100, within loss_curve.TOL of
tests/assets/losses/debug_model.json. A change that moves them stores the new curve
(`python scripts/loss_curve.py --update`), and its commit says why. The run starts when the suite is
collected, at the lowest CPU priority (tests/conftest.py).

The curve is trained in float64 (training.float64), so that it holds on any x86-64 machine by
construction. In fp32 it could not: an Intel Xeon was 5e-6 from an AMD EPYC's curve by step 17 (155
values beyond 1e-6) with ATen's AVX2 kernels and MKL's COMPATIBLE,STRICT path pinned on both
(MKL_VERBOSE: `CNR:COMPATIBLE,STRICT` on each), and fp32 rounding alone grows large: an fp32 run was
3e-4 from a float64 run of the same init by step 46. Kernels that add in another order move float64
sums by ~1e-16 relative instead. The init is sampled in fp32, as the recipe samples it, with ATen's AVX2
kernels (the run pins ATEN_CPU_CAPABILITY: fp32 samplers round by SIMD width). Measured on an AMD EPYC
(AVX2, 2 cores), the largest difference of the recipe's loss and gradient norm from the curve run's own
kernels (MKL's own choice, CNR off; ATen AVX2; 2 threads):

| kernels | steps | loss | grad norm |
| --- | --- | --- | --- |
| MKL's COMPATIBLE,STRICT path, its SSE4_2 code (MKL_ENABLE_INSTRUCTIONS), 1 thread | 1-8 | 0 | 8.9e-16 |
| ATen's baseline kernels, MKL's SSE4_2, 1 thread (both inits float64-drawn) | 1-100 | 1.1e-10 | 1.3e-9 |
| ATen's baseline kernels, fp32 init: what the pin prevents (an ulp apart) | 1-8 | 2.3e-8 | 4.6e-7 |

(validation loss at step 50, second row: 1.9e-11). TOL = 1e-7 leaves 76 times the largest of the
first two, while a real change lies far outside it: a loss divided by one token more than it averages
over (2049 instead of 2048: the test below) moves step 1's loss by 4.0e-3 and its gradient norm by
4.2e-4; the attention and feed-forward init std moved from 0.02 to 0.021 moves step 1's loss by
2.6e-5 (docs/debugging.md)."""

import math
import re
from pathlib import Path

import pytest
import torch
from launch import read_metrics, run_train_in_process

from scripts import loss_curve
from torchtitan.config.options import ConfigError
from torchtitan.config.parser import parse_args
from torchtitan.config_rules import check_float64, parallel_dims_of
from torchtitan.objective import objective


def test_the_default_recipe_trains_its_stored_curve(default_recipe_curve):
    run = default_recipe_curve
    assert sorted(run["loss"]) == list(range(1, 101))
    assert sorted(run["validation_loss"]) == [50, 100]
    assert loss_curve.differences(run, loss_curve.stored(), loss_curve.TOL) == []


def test_a_moved_value_or_a_missing_step_is_a_difference():
    curve, tol = loss_curve.stored(), loss_curve.TOL
    moved = {**curve, "loss": {**curve["loss"], 17: curve["loss"][17] + 2 * tol}}
    assert loss_curve.differences(moved, curve, tol) == [
        f"loss at step 17: {moved['loss'][17]!r}, stored {curve['loss'][17]!r}"
    ]
    shorter = {**curve, "validation_loss": {50: curve["validation_loss"][50]}}
    assert loss_curve.differences(shorter, curve, tol) == [
        "validation_loss: logged at steps [50], stored at [50, 100]"
    ]


def test_a_wrongly_normalised_loss_is_a_difference(tmp_path, monkeypatch):
    """Step 1 of the curve's run (in this process) with the loss divided by one token more than it
    averages over: its loss and gradient norm differ from the stored ones by far more than TOL, while the
    right loss of the same forward equals the stored step 1 within TOL."""
    right, cross_entropy_sum = [], objective.cross_entropy_sum

    def wrong_loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        summed = cross_entropy_sum(pred, labels)  # the objective divides it by the step's targets, all
        right.append((summed / labels.numel()).item())
        return summed * labels.numel() / (labels.numel() + 1)

    monkeypatch.setattr(objective, "cross_entropy_sum", wrong_loss)
    one_step = ["--training.steps", "1", "--validation.enable", "false", "--job.dump_folder", str(tmp_path)]
    try:
        assert run_train_in_process(*loss_curve.ARGS, *one_step) == 0
    finally:
        torch.set_default_dtype(torch.float32)  # training.float64 set it for this process
    (logged,) = read_metrics(tmp_path)
    stored = loss_curve.stored()
    assert abs(right[0] - stored["loss"][1]) <= loss_curve.TOL
    assert abs(logged["loss"] - stored["loss"][1]) > 1e-3
    assert abs(logged["grad_norm"] - stored["grad_norm"][1]) > 1e-4


@pytest.mark.parametrize(
    "argv, world_size, here",
    [
        (["--model.name", "qwen3", "--model.flavor", "debugmodel"], 1, "qwen3, world size 1, float32, 0"),
        (["--parallelism.data_parallel_shard_degree", "2"], 2, "llama3, world size 2, float32, 0"),
        (["--training.mixed_precision_param", "bfloat16"], 1, "llama3, world size 1, bfloat16, 0"),
        (["--training.loss_chunk_tokens", "512"], 1, "llama3, world size 1, float32, 512"),
    ],
    ids=["qwen3", "two processes", "bf16", "chunked loss"],
)
def test_float64_runs_where_every_upcast_keeps_it(argv, world_size, here):
    recipe = ["--job.config_file", "train_configs/debug_model.toml", "--training.float64", "true"]
    job = parse_args([*recipe, *argv])
    with pytest.raises(ConfigError) as err:
        check_float64(job, parallel_dims_of(job, world_size))
    assert str(err.value) == (
        "training.float64: runs Llama on one process with mixed_precision_param float32 and "
        f"loss_chunk_tokens 0 (here: {here}); set those, or float64 false"
    )


def test_the_readme_quotes_the_stored_validation_loss():
    """README's Quick start quotes the first command's validation line: the fp32 run of the curve's init
    and data, which fp32's rounding moves from the float64 curve (1.4e-4 at step 50, measured: 5.4421
    against 5.442239): within 5e-4 of the curve's step 50, its perplexity its loss's."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    quoted = re.search(r"validate step 50: loss ([\d.]+)  perplexity ([\d.]+)", readme)
    assert quoted is not None
    assert abs(math.exp(float(quoted[1])) - float(quoted[2])) <= 0.02  # the loss's 4 decimals
    assert abs(float(quoted[1]) - loss_curve.stored()["validation_loss"][50]) <= 5e-4
