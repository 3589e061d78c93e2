"""Fuzzing the configuration front door: generated TOML files and command lines given to parse_args
and the preflight's check_job end in a one-line ConfigError (or --help's SystemExit(0)), never a
traceback or a hang; through `python -m torchtitan.reliability.preflight`, in exit code 0 or 2."""

import json
import math
import os
import subprocess
import sys
from datetime import date, datetime, time, timedelta

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from launch import ROOT

from torchtitan.config.options import ConfigError
from torchtitan.config.parser import _base_type, _option_table, parse_args
from torchtitan.reliability.preflight import check_job

OPTIONS = _option_table()
PATH_OPTIONS = {
    "job.dump_folder", "model.tokenizer_path", "training.dataset_path", "validation.dataset_path",
    "checkpoint.initial_load_path", "checkpoint.folder", "job.config_file",
}  # fmt: skip
FUZZ = settings(
    max_examples=1000,
    deadline=timedelta(seconds=5),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """Files and folders of every kind to point path options at, in a working folder of their own
    (a garbage relative path is tried there, and the dump folder's write test writes there)."""
    tmp = tmp_path_factory.mktemp("fuzz")
    (tmp / "tok.tiktoken").write_bytes((ROOT / "assets" / "tokenizer" / "kjv_bpe.tiktoken").read_bytes())
    (tmp / "data").mkdir()
    (tmp / "data" / "train.jsonl").write_text('{"text": "In the beginning"}\n')
    (tmp / "empty").mkdir()
    (tmp / "latin1.txt").write_bytes("Genèse".encode("latin-1"))
    os.mkfifo(tmp / "fifo")
    (tmp / "dangling").symlink_to(tmp / "gone")
    cwd = os.getcwd()
    os.chdir(tmp)
    yield [str(tmp / name) for name in ("tok.tiktoken", "data", "data/train.jsonl", "empty", "latin1.txt",
                                        "fifo", "dangling", "nowhere")]  # fmt: skip
    os.chdir(cwd)


def valid_value(key: str) -> st.SearchStrategy:
    """Values an option takes (to get past it to the deeper checks), and some just out of range."""
    _, _, tp, meta = OPTIONS[key]
    base, _ = _base_type(tp)
    if meta["choices"]:
        choice = st.sampled_from(meta["choices"])
        return st.lists(choice, max_size=3) if base is list or str(base).startswith("list") else choice
    return {
        bool: st.booleans(),
        int: st.integers(-2, 70),
        float: st.floats(-1.0, 2.0),
        str: st.sampled_from(["op", "1", "2", "debugmodel", "8B", "layers.1", "x"]),
    }.get(base, st.lists(st.sampled_from(["layers.1", "layers.3", "layers.x"]), max_size=3))


SCALARS = st.one_of(
    st.booleans(),
    st.integers(),
    st.integers(min_value=2**62, max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.datetimes(),
    st.dates(),
    st.times(),
)
ANY_VALUE = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


def toml_key(key: str) -> str:
    return json.dumps(key, ensure_ascii=False)


def toml_value(value) -> str:
    """TOML text for a value (strings as JSON's, which TOML's basic strings read the same)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (datetime, date, time)):
        return value.isoformat()
    if isinstance(value, list):
        return "[" + ", ".join(map(toml_value, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    return json.dumps(value, ensure_ascii=False)


@st.composite
def toml_documents(draw, paths: list[str]) -> str:
    """Sections of real options (mostly valid values, path options at real files of every kind) and
    garbage: unknown sections and keys, values of any TOML type, a section that is not a table."""
    lines = []
    keys = draw(st.lists(st.sampled_from(sorted(OPTIONS)), max_size=8, unique=True))
    by_section: dict[str, list[str]] = {}
    for key in keys:
        section, name = key.split(".", 1)
        if key in PATH_OPTIONS:
            value = draw(st.sampled_from(paths) | st.text(max_size=12).map(lambda t: "g" + t))
        else:
            value = (
                draw(valid_value(key) | ANY_VALUE) if draw(st.integers(0, 4)) == 0 else draw(valid_value(key))
            )
        by_section.setdefault(section, []).append(f"{toml_key(name)} = {toml_value(value)}")
    if draw(st.integers(0, 3)) == 0:
        by_section.setdefault(
            draw(st.sampled_from(sorted(by_section) or ["training"]) | st.text(max_size=8)), []
        ).append(f"{toml_key(draw(st.text(max_size=8)))} = {toml_value(draw(ANY_VALUE))}")
    for section, body in by_section.items():
        lines += [f"[{toml_key(section)}]", *body]
    if draw(st.integers(0, 9)) == 0:
        lines.insert(0, f"{toml_key(draw(st.text(max_size=8)))} = {toml_value(draw(ANY_VALUE))}")
    return "\n".join(lines) + "\n"


def command_lines(paths: list[str]) -> st.SearchStrategy:
    """--section.key VALUE, --section.key=VALUE, stray tokens, missing values, repeated options."""
    option = st.sampled_from(sorted(OPTIONS)).map(lambda key: f"--{key}")
    value = (
        st.sampled_from(paths)
        | st.text(max_size=12)
        | st.integers().map(str)
        | st.sampled_from(
            ["true", "no", "none", "nan", "-inf", "1e999", "-1", "٣", "²", "layers.1,layers.2", "op"]
        )
    )
    token = st.one_of(
        st.tuples(option, value).map(list),
        st.tuples(option, value).map(lambda p: [f"{p[0]}={p[1]}"]),
        option.map(lambda o: [o]),
        st.text(max_size=10).map(lambda t: [t]),
        st.sampled_from([["--help"], ["--"], ["-x"], ["--training"], ["--nope.key", "1"]]),
    )
    return st.lists(token, max_size=6).map(lambda parts: [t for part in parts for t in part])


def front_door(argv: list[str], world_size: int) -> None:
    """parse_args then check_job: a one-line ConfigError, or --help's SystemExit(0), or nothing."""
    try:
        check_job(parse_args(argv), world_size)
    except ConfigError as e:
        assert "\n" not in str(e), str(e)
    except SystemExit as e:
        assert e.code == 0 and any(a in ("-h", "--help") for a in argv)


@FUZZ
@given(data=st.data(), world_size=st.integers(1, 64))
def test_generated_toml_files(paths, data, world_size, capsys):
    text = data.draw(toml_documents(paths) | st.binary(max_size=60).map(lambda b: b.decode("latin-1")))
    with open("job.toml", "w", encoding="utf-8", errors="surrogateescape") as f:
        f.write(text)
    front_door(["--job.config_file", "job.toml"], world_size)


@FUZZ
@given(data=st.data(), world_size=st.integers(1, 64))
def test_generated_command_lines(paths, data, world_size, capsys):
    front_door(data.draw(command_lines(paths)), world_size)


@settings(max_examples=5, deadline=None)
@given(data=st.data(), world_size=st.integers(1, 64))
def test_preflight_exits_0_or_2(paths, data, world_size):
    argv = ["--nproc", str(world_size), *data.draw(command_lines(paths))]
    assume(not any("\0" in arg for arg in argv))  # a command line cannot hold a NUL
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-m", "torchtitan.reliability.preflight", *argv], env=env,
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode in (0, 2), result.stderr
    assert "Traceback" not in result.stderr
