import re
import shutil
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(
    shutil.which("ruff") is None and not (Path(sys.executable).parent / "ruff").exists(),
    reason="ruff is not installed",
)
def test_ruff_clean():
    ruff = Path(sys.executable).parent / "ruff"
    ruff = str(ruff) if ruff.exists() else "ruff"
    result = subprocess.run([ruff, "check", str(ROOT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


DEPTRY = Path(sys.executable).parent / "deptry"


def deptry(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(DEPTRY), ".", "--no-ansi"], capture_output=True, text=True, cwd=root)


@pytest.mark.skipif(not DEPTRY.exists(), reason="deptry is not installed (./scripts/install.sh --dev)")
def test_every_import_is_declared(tmp_path):
    """deptry reads every import of train.py, torchtitan/ and scripts/ against pyproject.toml: a package
    used at run time must be a runtime dependency, not a dev one or another package's dependency (as
    safetensors was: a fresh runtime install could not train). A copy of the tree with one undeclared
    import fails the same check."""
    result = deptry(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    for name in ("pyproject.toml", "train.py", "torchtitan", "scripts"):
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy
        copy(ROOT / name, tmp_path / name)
    with open(tmp_path / "torchtitan" / "metrics.py", "a") as f:
        f.write("\nimport yaml  # noqa\n")
    result = deptry(tmp_path)
    # pyyaml is installed, as a dependency of datasets: undeclared all the same (DEP003)
    assert result.returncode == 1 and "'yaml' imported but" in result.stderr, result.stderr


def requirement_names(lines: list[str]) -> list[str]:
    names = [re.split(r"[<>=!~;\[ ]", line.strip(), maxsplit=1)[0] for line in lines]
    return [name for name in names if name and not name.startswith(("#", "-"))]


def test_requirements_txt_and_pyproject_declare_the_same_runtime():
    """scripts/install.sh installs requirements.txt; pip install . reads pyproject.toml: the same packages."""
    runtime = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    requirements = (ROOT / "requirements.txt").read_text().splitlines()
    assert sorted(requirement_names(requirements)) == sorted(requirement_names(runtime))
