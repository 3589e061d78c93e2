"""The default recipe trains its stored curve (scripts/loss_curve.py): every step's loss and gradient
norm, and the validation losses of steps 50 and 100, within 1e-6 of tests/assets/losses/debug_model.json.
A change that moves them stores the new curve (`python scripts/loss_curve.py --update`), and its commit
says why. The run starts when the suite is collected, at the lowest CPU priority (tests/conftest.py)."""

from scripts import loss_curve


def test_the_default_recipe_trains_its_stored_curve(default_recipe_curve):
    run = default_recipe_curve
    assert sorted(run["loss"]) == list(range(1, 101))
    assert sorted(run["validation_loss"]) == [50, 100]
    assert loss_curve.differences(run, loss_curve.stored(), 1e-6) == []


def test_a_moved_value_or_a_missing_step_is_a_difference():
    curve = loss_curve.stored()
    moved = {**curve, "loss": {**curve["loss"], 17: curve["loss"][17] + 2e-6}}
    assert loss_curve.differences(moved, curve, 1e-6) == [
        f"loss at step 17: {moved['loss'][17]!r}, stored {curve['loss'][17]!r}"
    ]
    shorter = {**curve, "validation_loss": {50: curve["validation_loss"][50]}}
    assert loss_curve.differences(shorter, curve, 1e-6) == [
        "validation_loss: logged at steps [50], stored at [50, 100]"
    ]


def test_the_readme_quotes_the_stored_validation_loss():
    """README's Quick start quotes the first command's validation line: the stored curve's step 50, to
    the rounding of the unpinned kernels that command runs (1e-5 apart from the curve's)."""
    import math
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    quoted = re.search(r"validate step 50: loss ([\d.]+)  perplexity ([\d.]+)", readme)
    loss = loss_curve.stored()["validation_loss"][50]
    assert quoted is not None
    assert abs(float(quoted[1]) - loss) <= 1e-4 and abs(float(quoted[2]) - math.exp(loss)) <= 0.02
