"""[float8]: the rules (options, device, torchao), the refusal off a capable GPU before any work, and
which linear layers are converted. torchao is not installed here and no GPU is: the conversion itself
is torchao's, and what decides its input (`float8_linear_fqns`) needs neither."""

import os
import stat
from pathlib import Path

import pytest
import torch
from launch import ROOT, TINY_JOB, run_train_in_process

from torchtitan.config.options import ConfigError, JobConfig
from torchtitan.config.parser import parse_args
from torchtitan.config_rules import check_float8, parallel_dims_of
from torchtitan.errors import TORCHAO_REQUIREMENT
from torchtitan.models import build_model_args
from torchtitan.models.llama import ModelArgs
from torchtitan.models.llama.model import Transformer
from torchtitan.parallelisms.float8 import check_filter_fqns, float8_linear_fqns, fqn_matches
from torchtitan.reliability import preflight

FLOAT8 = ["--float8.enable_float8_linear", "true"]
BLOCK_LINEARS = ["attention.wq", "attention.wk", "attention.wv", "attention.wo"] + [
    f"feed_forward.w{i}" for i in (1, 2, 3)
]
CAPABLE_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def float8_job(*argv: str) -> JobConfig:
    return parse_args([*FLOAT8, *argv])


def meta_model(model_args: ModelArgs) -> Transformer:
    with torch.device("meta"):
        return Transformer.from_model_args(model_args)


@pytest.fixture(scope="module")
def debug_model():
    """The debug model (6 blocks, dim 256, the bundled tokenizer's 2256 words) on the meta device."""
    return meta_model(build_model_args(parse_args([*TINY_JOB, "--model.n_layers", "0"]), 2256))


# Which layers are converted


def test_every_block_linear_is_converted_and_the_output_kept(debug_model):
    fqns = float8_linear_fqns(debug_model, JobConfig().float8)
    assert fqns == [f"layers.{i}.{name}" for i in range(6) for name in BLOCK_LINEARS]
    everything = float8_linear_fqns(debug_model, float8_job("--float8.filter_fqns=").float8)
    assert everything == [*fqns, "output"]  # 2256 x 256: multiples of 16


def test_filter_fqns_match_whole_dotted_parts(debug_model):
    fqns = float8_linear_fqns(debug_model, float8_job("--float8.filter_fqns", "output,wq,layers.1").float8)
    assert "output" not in fqns and not any(f.endswith(".wq") or f.startswith("layers.1.") for f in fqns)
    assert len(fqns) == 5 * 6  # five blocks, six linears each
    assert fqn_matches("layers.1.attention.wq", "attention.wq")
    assert fqn_matches("layers.1.attention.wq", "layers.1")
    assert not fqn_matches("layers.10.attention.wq", "layers.1")
    assert not fqn_matches("layers.1.attention.wqk", "wq")


def test_layers_whose_dims_are_not_multiples_of_16_stay():
    # vocabulary 1000 (not a multiple of 16): the output layer stays even unfiltered
    model = meta_model(ModelArgs(dim=256, n_layers=1, n_heads=16, vocab_size=1000))
    fqns = float8_linear_fqns(model, float8_job("--float8.filter_fqns=").float8)
    assert fqns == [f"layers.0.{name}" for name in BLOCK_LINEARS]


def test_filter_naming_no_module_is_an_error(debug_model):
    check_filter_fqns(debug_model, float8_job("--float8.filter_fqns", "output,attention.wo").float8)
    with pytest.raises(ConfigError) as err:
        check_filter_fqns(debug_model, float8_job("--float8.filter_fqns", "output,ouptut").float8)
    assert str(err.value) == (
        "float8.filter_fqns: 'ouptut' names no module of the model; give a module's name or a dotted "
        "part of it, e.g. one of output, w1, w2, w3, wk, wo, wq, wv"
    )


# The rules


@pytest.mark.parametrize(
    "argv, world_size, facts, message",
    [
        (
            ["--float8.recipe_name", "rowwise", "--float8.enable_fsdp_float8_all_gather", "true"],
            2,
            {},
            "float8.enable_fsdp_float8_all_gather: torchao all-gathers float8 weights with the tensorwise "
            "recipe only, and float8.recipe_name is rowwise; set one of them differently",
        ),
        (
            ["--float8.precompute_float8_dynamic_scale_for_fsdp", "true"],
            2,
            {},
            "float8.precompute_float8_dynamic_scale_for_fsdp: precomputes the scales of float8 all-gathers, "
            "and float8.enable_fsdp_float8_all_gather is false; set it to false too",
        ),
        (
            ["--float8.enable_fsdp_float8_all_gather", "true"],
            1,
            {},
            "float8.enable_fsdp_float8_all_gather: needs FSDP (a data_parallel_shard_degree or "
            "context_parallel_degree above 1, here 1 and 1); set it to false",
        ),
        (
            [],
            1,
            {"device_type": "cpu"},
            "float8.enable_float8_linear: float8 matmuls need a CUDA GPU of compute capability 8.9 or newer "
            "(H100, H200, L4, L40S), and this run is on cpu; set it to false",
        ),
        (
            [],
            1,
            {"device_type": "cuda", "cuda_capability": (8, 0)},
            "float8.enable_float8_linear: float8 matmuls need a CUDA GPU of compute capability 8.9 or newer "
            "(H100, H200, L4, L40S), and this one is 8.0; set it to false",
        ),
        (
            [],
            1,
            {"device_type": "cuda", "cuda_capability": (9, 0), "torchao_installed": False},
            f"float8.enable_float8_linear: needs torchao, and torchao is not installed; install it with "
            f"`pip install {TORCHAO_REQUIREMENT}` (scripts/install.sh does on a GPU machine) or set it to "
            "false",
        ),
    ],
    ids=["rowwise all-gather", "precompute alone", "all-gather without FSDP", "cpu", "A100", "no torchao"],
)
def test_rules(argv, world_size, facts, message):
    job = float8_job(*argv)
    with pytest.raises(ConfigError) as err:
        check_float8(job, parallel_dims_of(job, world_size), **facts)
    assert str(err.value) == message


def test_what_is_allowed():
    tensorwise = float8_job(
        "--float8.enable_fsdp_float8_all_gather", "true", "--float8.precompute_float8_dynamic_scale_for_fsdp",
        "true", "--parallelism.tensor_parallel_degree", "2",
    )  # fmt: skip
    rowwise_tp = float8_job("--float8.recipe_name", "rowwise", "--parallelism.tensor_parallel_degree", "2")
    for job in (tensorwise, rowwise_tp):
        check_float8(job, parallel_dims_of(job, 4), "cuda", (9, 0), torchao_installed=True)
    check_float8(float8_job(), parallel_dims_of(float8_job(), 1), "cuda", (8, 9), torchao_installed=True)
    off = parse_args(["--float8.precompute_float8_dynamic_scale_for_fsdp", "true"])
    check_float8(off, parallel_dims_of(off, 1), "cpu", torchao_installed=False)  # float8 off: no rule


def test_torchao_requirement_is_the_one_installed():
    assert TORCHAO_REQUIREMENT in (ROOT / "requirements-gpu.txt").read_text().splitlines()
    assert f'float8 = ["{TORCHAO_REQUIREMENT}"]' in (ROOT / "pyproject.toml").read_text()
    assert "requirements-gpu.txt" in (ROOT / "scripts" / "install.sh").read_text()


# What the preflight sees without torch


def fake_nvidia_smi(folder: Path, output: str) -> None:
    script = folder / "nvidia-smi"
    script.write_text(f"#!/bin/sh\nprintf '{output}'\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)


def test_gpu_facts_without_torch(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(preflight, "GPU_DRIVER_PATHS", (str(tmp_path / "no-driver"),))
    assert preflight.gpu_facts() == ("cpu", None)  # no nvidia-smi, no driver
    monkeypatch.setattr(preflight, "GPU_DRIVER_PATHS", (str(tmp_path),))
    assert preflight.gpu_facts() == (None, None)  # a driver but no nvidia-smi: train.py decides
    fake_nvidia_smi(tmp_path, "9.0\\n8.0\\n")
    assert preflight.gpu_facts() == ("cuda", (8, 0))  # the lowest of the GPUs
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert preflight.gpu_facts() == ("cpu", None)


def test_preflight_refuses_an_older_gpu(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    fake_nvidia_smi(tmp_path, "8.0\\n")
    code = preflight.main([*TINY_JOB, "--job.dump_folder", str(tmp_path / "dump"), *FLOAT8])
    assert code == 2
    assert capsys.readouterr().err.endswith("and this one is 8.0; set it to false\n")


# Off a capable GPU: one line, exit code 2, before any work


@pytest.mark.skipif(CAPABLE_GPU, reason="this machine can train in float8")
def test_off_gpu_refusal_before_any_work(tmp_path, capsys):
    """Through the preflight (what run_llama_train.sh runs before any worker) and through train.py's
    own entry: one line naming the option, exit code 2, nothing written."""
    dump = tmp_path / "dump"
    argv = [*TINY_JOB, "--job.dump_folder", str(dump), *FLOAT8]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    capability = ".".join(map(str, torch.cuda.get_device_capability())) if device == "cuda" else None
    expected = (
        "error: float8.enable_float8_linear: float8 matmuls need a CUDA GPU of compute capability 8.9 or "
        "newer (H100, H200, L4, L40S), and "
        + (f"this one is {capability}" if capability else f"this run is on {device}")
        + "; set it to false"
    )
    assert preflight.main(argv) == 2
    assert capsys.readouterr().err == expected + "\n"
    assert not dump.exists()
    assert run_train_in_process(*argv) == 2
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [expected], err
    assert err.endswith(expected + "\n") and "Traceback" not in err
    assert not dump.exists()
