"""Each script in scripts/, run as a user runs it (a new interpreter, from another folder, no
PYTHONPATH, no GPU visible), answers bad input with exit code 2 and one line on stderr that names the
argument, not argparse's usage block, a traceback or a run of work first."""

import os
import subprocess
import sys

import pytest
from launch import ROOT

CASES = [
    ("chaos.py", ["--trials", "0"], "argument --trials: expected a positive number, got '0'"),
    ("chaos.py", ["--bogus"], "unrecognized arguments: --bogus; see chaos.py --help"),
    ("estimate_memory.py", ["--expert-load", "0.5"], "--expert-load: expected a number >= 1"),
    ("evaluate.py", ["--training.stepz", "3"], "unknown option --training.stepz"),
    ("generate.py", ["--max_new_tokens", "x"], "argument --max_new_tokens: invalid int value: 'x'"),
    ("generate_config_docs.py", ["--chek"], "unrecognized arguments: --chek"),
    ("make_corpus.py", ["--holdout-every", "0"], "argument --holdout-every: expected a positive number"),
    ("parity_matrix.py", ["--only", "nothing"], "no layout matches ['nothing']"),
    ("pretokenize.py", ["--output", "x", "--workers", "0"], "argument --workers: expected a positive number"),
    (
        "profile_train.py",
        [],
        "profile_train.py profiles CUDA kernels and this machine has no CUDA device: run it on a GPU machine",
    ),
    ("train_tokenizer.py", ["--corpus", "missing.jsonl"], "--corpus: no such file missing.jsonl"),
    ("train_tokenizer.py", ["--vocab-size", "100"], "--vocab-size: must exceed the 256 single-byte tokens"),
]


@pytest.mark.parametrize("script, argv, message", CASES, ids=[f"{c[0]} {' '.join(c[1])}" for c in CASES])
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, script, argv, message):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # profile_train.py's refusal, on any machine
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), *argv],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (result.returncode, result.stderr.count("\n")) == (2, 1), result.stderr
    assert result.stderr.startswith("error: ") and message in result.stderr, result.stderr
    assert not list(tmp_path.iterdir())  # nothing written
