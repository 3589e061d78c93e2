"""Every path the scripts take: a path of the wrong kind (a folder for a file or the reverse, a dangling
symlink, a FIFO, a file that is not UTF-8) is one `error:` line naming the argument and the path as
given, exit code 2, and nothing written; paths with spaces and non-ASCII characters work, for the
scripts and for train.py. (train.py's wrong paths are in test_bad_input.py's table.)"""

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from launch import ROOT, TINY_JOB, run_train_in_process
from test_bad_input import WRONG_PATHS, folder_hashes
from test_evaluate import load_evaluate
from test_tools import load_script

from scripts import convert_dcp_to_hf, convert_dcp_to_torch, convert_hf_to_dcp
from torchtitan.config.parser import parse_args

SCRIPTS = {
    "convert_dcp_to_hf": convert_dcp_to_hf.main,
    "convert_hf_to_dcp": convert_hf_to_dcp.main,
    "convert_dcp_to_torch": convert_dcp_to_torch.main,
    "plot_metrics": load_script("plot_metrics").main,
    "generate": load_script("generate").main,
    "estimate_memory": load_script("estimate_memory").main,
    "evaluate": load_evaluate().main,
}
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
TOKENIZER = ROOT / "assets" / "tokenizer" / "kjv_bpe.tiktoken"


def make_inputs(tmp: Path) -> None:
    """Good inputs the bad path stands beside: a checkpoint, an HF folder, a run's metrics."""
    dcp.save({"model": {"norm.weight": torch.ones(2)}}, checkpoint_id=str(tmp / "ckpt"), no_dist=True)
    (tmp / "hf").mkdir()
    (tmp / "hf" / "config.json").write_text(
        '{"hidden_size": 2, "num_hidden_layers": 1, "num_attention_heads": 1}'
    )
    (tmp / "hf" / "model.safetensors").write_bytes(b"x")
    (tmp / "run").mkdir()
    (tmp / "run" / "metrics.jsonl").write_text('{"step": 1, "loss": 8.0}\n')


@dataclass
class ScriptCase:
    script: str
    argument: str  # as the error names it
    kinds: list[str]
    argv: object  # argv(tmp, bad) -> the script's arguments, `bad` standing for the wrong path


JOB = ["--job.config_file", str(ROOT / "train_configs" / "debug_model.toml")]
TABLE = [
    ScriptCase("convert_dcp_to_torch", "checkpoint", ["file", "dangling symlink", "fifo"],
               lambda tmp, bad: [bad, str(tmp / "out.pt")]),
    ScriptCase("convert_dcp_to_torch", "output", ["folder", "dangling symlink", "fifo"],
               lambda tmp, bad: [str(tmp / "ckpt"), bad]),
    ScriptCase("convert_dcp_to_hf", "checkpoint", ["file", "dangling symlink", "fifo"],
               lambda tmp, bad: [bad, str(tmp / "out")]),
    ScriptCase("convert_dcp_to_hf", "output", ["file", "dangling symlink", "fifo"],
               lambda tmp, bad: [str(tmp / "ckpt"), bad]),
    ScriptCase("convert_hf_to_dcp", "hf_folder", ["file", "dangling symlink", "fifo"],
               lambda tmp, bad: [bad, str(tmp / "out")]),
    ScriptCase("convert_hf_to_dcp", "output", ["file", "dangling symlink", "fifo"],
               lambda tmp, bad: [str(tmp / "hf"), bad]),
    ScriptCase("plot_metrics", "RUN_DIR", ["dangling symlink", "fifo", "not UTF-8"],
               lambda tmp, bad: [bad, "-o", str(tmp / "plot.png")]),
    ScriptCase("plot_metrics", "RUN_B", ["dangling symlink", "fifo", "not UTF-8"],
               lambda tmp, bad: ["--compare", str(tmp / "run"), bad]),
    ScriptCase("plot_metrics", "--output", ["folder", "dangling symlink", "fifo"],
               lambda tmp, bad: [str(tmp / "run"), "-o", bad]),
    ScriptCase("generate", "model.tokenizer_path", ["folder", "dangling symlink", "fifo", "not UTF-8"],
               lambda tmp, bad: [*JOB, "--model.tokenizer_path", bad]),
    ScriptCase("generate", "job.dump_folder", ["file", "dangling symlink", "fifo"],
               lambda tmp, bad: [*JOB, "--job.dump_folder", bad]),
    ScriptCase("generate", "checkpoint.initial_load_path", ["file", "dangling symlink", "fifo"],
               lambda tmp, bad: [*JOB, "--job.dump_folder", str(tmp), "--checkpoint.initial_load_path", bad]),
    ScriptCase("generate", "job.config_file", ["folder", "dangling symlink", "fifo", "not UTF-8"],
               lambda tmp, bad: ["--job.config_file", bad]),
    ScriptCase("evaluate", "model.tokenizer_path", ["folder", "dangling symlink", "fifo", "not UTF-8"],
               lambda tmp, bad: [*JOB, "--job.dump_folder", str(tmp), "--model.tokenizer_path", bad]),
    ScriptCase("evaluate", "validation.dataset_path", ["dangling symlink", "fifo", "not UTF-8"],
               lambda tmp, bad: [*JOB, "--job.dump_folder", str(tmp), "--validation.enable", "true",
                                 "--validation.dataset_path", bad]),
    ScriptCase("evaluate", "checkpoint.initial_load_path", ["file", "dangling symlink", "fifo"],
               lambda tmp, bad: [*JOB, "--job.dump_folder", str(tmp), "--checkpoint.initial_load_path", bad]),
    ScriptCase("estimate_memory", "job.config_file", ["folder", "dangling symlink", "fifo", "not UTF-8"],
               lambda tmp, bad: ["--job.config_file", bad]),
]  # fmt: skip
CASES = [(case, kind) for case in TABLE for kind in case.kinds]


def exit_code(script: str, argv: list[str]) -> int:
    try:
        return SCRIPTS[script](argv)
    except SystemExit as e:
        return e.code


def listing(folder: Path) -> tuple[list[str], dict[str, str]]:
    return sorted(str(p) for p in folder.rglob("*")), folder_hashes(folder)


@pytest.mark.parametrize("case, kind", CASES, ids=[f"{c.script} {c.argument} {k}" for c, k in CASES])
def test_wrong_path_is_one_line_and_writes_nothing(case, kind, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TITAN_DEBUG", raising=False)
    make_inputs(tmp_path)
    bad = tmp_path / "wrong path é.txt"  # .txt: a data file, read as text
    WRONG_PATHS[kind][0](bad)
    before = listing(tmp_path)
    code = exit_code(case.script, case.argv(tmp_path, str(bad)))
    err = capsys.readouterr().err
    assert code == 2, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and err.endswith(errors[0] + "\n"), err
    assert f"{case.argument}: {bad} {WRONG_PATHS[kind][1].format(tmp=tmp_path)}" in errors[0]
    assert "Traceback" not in err
    assert listing(tmp_path) == before


def test_titan_debug_shows_the_traceback(tmp_path):
    script = [sys.executable, str(ROOT / "scripts" / "plot_metrics.py"), str(tmp_path / "nowhere")]
    plain = subprocess.run(script, capture_output=True, text=True)
    assert plain.returncode == 2 and plain.stderr.startswith("error: RUN_DIR: no such file")
    assert "Traceback" not in plain.stderr
    debug = subprocess.run(script, capture_output=True, text=True, env={**os.environ, "TITAN_DEBUG": "1"})
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "ConfigError: RUN_DIR" in debug.stderr


@pytest.fixture
def odd(tmp_path) -> Path:
    """A folder whose name has spaces and non-ASCII characters."""
    folder = tmp_path / "my runs é 日本"
    folder.mkdir()
    return folder


def test_scripts_take_paths_with_spaces_and_unicode(odd, capsys):
    make_inputs(odd)
    assert exit_code("convert_dcp_to_torch", [str(odd / "ckpt"), str(odd / "out put.pt")]) == 0
    assert torch.load(odd / "out put.pt", weights_only=True)["model"]["norm.weight"].tolist() == [1.0, 1.0]
    assert exit_code("plot_metrics", ["--compare", str(odd / "run"), str(odd / "run")]) == 0
    toml = odd / "jöb file.toml"
    toml.write_text((ROOT / "train_configs" / "debug_model.toml").read_text())
    assert parse_args(["--job.config_file", str(toml)]).job.config_file == str(toml)


def test_train_takes_paths_with_spaces_and_unicode(odd, capsys):
    (odd / "tök en.tiktoken").write_bytes(TOKENIZER.read_bytes())
    lines = (ROOT / "assets" / "corpus" / "kjv" / "train.jsonl").read_text().splitlines()[:400]
    (odd / "dätä set.jsonl").write_text("\n".join(lines) + "\n")
    (odd / "jöb.toml").write_text((ROOT / "train_configs" / "debug_model.toml").read_text())
    code = run_train_in_process(
        *TINY_JOB,
        "--job.config_file", str(odd / "jöb.toml"),
        "--model.tokenizer_path", str(odd / "tök en.tiktoken"),
        "--training.dataset_path", str(odd / "dätä set.jsonl"),
        "--job.dump_folder", str(odd / "dump ü"),
        "--training.steps", "1",
        "--training.batch_size", "2",
    )  # fmt: skip
    assert code == 0
    assert json.loads((odd / "dump ü" / "metrics.jsonl").read_text().splitlines()[0])["step"] == 1
    assert f"Data for training: {odd / 'dätä set.jsonl'}\n" in capsys.readouterr().out  # not kjv
