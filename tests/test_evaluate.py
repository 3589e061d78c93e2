"""scripts/evaluate.py: a checkpoint's held-out loss, on one process and on two, equals the loss
transformers' own LlamaForCausalLM (and Qwen3ForCausalLM) computes on the same windows."""

import importlib.util
import re

import pytest
import torch
import torch.distributed.checkpoint as dcp
from launch import ROOT, TINY_JOB, launch_env, run_forked
from test_convert import random_model

from scripts import convert_dcp_to_hf, convert_hf_to_dcp
from torchtitan.config.parser import parse_args
from torchtitan.datasets.build import DataSource, build_dataset
from torchtitan.datasets.layout import BatchLayout
from torchtitan.datasets.loader import DataLoader
from torchtitan.datasets.tokenizer import Tokenizer
from torchtitan.models import build_model_args

SCRIPT = ROOT / "scripts" / "evaluate.py"
JOB = [*TINY_JOB, "--validation.steps", "2", "--validation.batch_size", "2"]


def load_evaluate():
    spec = importlib.util.spec_from_file_location("evaluate", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def printed_loss(out: str) -> float:
    return float(re.search(r": loss (\S+)  perplexity", out).group(1))


def transformers_loss(hf_folder, tokenizer) -> float:
    """The mean of transformers' loss over the first two validation batches (2 windows of 65 tokens)."""
    transformers = pytest.importorskip("transformers")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_folder, dtype=torch.float32).eval()
    source = DataSource("kjv_validation", split="validation")
    loader = DataLoader(build_dataset(source, tokenizer, 64, BatchLayout(2), infinite=False), 2)
    losses = []
    with torch.no_grad():
        for batch, _ in zip(loader, range(2)):
            # transformers shifts the labels itself
            window = torch.cat([batch.inputs, batch.labels[:, -1:]], dim=1)
            losses.append(hf_model(input_ids=window, labels=window).loss)
    return torch.stack(losses).mean().item()


def test_evaluate_a_converted_model_equals_transformers(tmp_path, capsys):
    tokenizer = Tokenizer(ROOT / "assets" / "tokenizer" / "kjv_bpe.tiktoken")
    args = build_model_args(parse_args(JOB), tokenizer.n_words)
    dcp.save({"model": random_model(args).state_dict()}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    convert_dcp_to_hf.convert(str(tmp_path / "dcp"), str(tmp_path / "hf"), args)
    convert_hf_to_dcp.convert(str(tmp_path / "hf"), str(tmp_path / "from_hf"))
    expected = transformers_loss(tmp_path / "hf", tokenizer)

    job = [*JOB, "--job.dump_folder", str(tmp_path / "run"), "--checkpoint.initial_load_path"]
    assert load_evaluate().main([*job, str(tmp_path / "from_hf")]) == 0
    out = capsys.readouterr().out
    assert "(256 tokens," in out
    assert abs(printed_loss(out) - expected) < 1e-5, (out, expected)

    # Two processes (FSDP), the weights resharded on load: the same windows, the same loss.
    torchrun = ["--nproc_per_node=2", "--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0"]
    argv = [*torchrun, str(SCRIPT), *job, str(tmp_path / "from_hf"), "--validation.batch_size", "1"]
    result = run_forked("module", "torch.distributed.run", argv, launch_env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert abs(printed_loss(result.stdout) - expected) < 1e-5, (result.stdout, expected)


def test_evaluate_a_converted_qwen3_equals_transformers(tmp_path, capsys):
    """The debug Qwen3 (q/k norms, head_dim 32 != dim / n_heads, tied embeddings) through HF and back,
    and from the HF folder itself."""
    tokenizer = Tokenizer(ROOT / "assets" / "tokenizer" / "kjv_bpe.tiktoken")
    qwen3_job = [*JOB, "--model.name", "qwen3", "--model.flavor", "debugmodel_tied"]
    args = build_model_args(parse_args(qwen3_job), tokenizer.n_words)
    model = random_model(args, "qwen3")
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    convert_dcp_to_hf.convert(str(tmp_path / "dcp"), str(tmp_path / "hf"), args, name="qwen3")
    convert_hf_to_dcp.convert(str(tmp_path / "hf"), str(tmp_path / "from_hf"))
    expected = transformers_loss(tmp_path / "hf", tokenizer)

    job = [*qwen3_job, "--job.dump_folder", str(tmp_path / "run")]
    assert load_evaluate().main([*job, "--checkpoint.initial_load_path", str(tmp_path / "from_hf")]) == 0
    out = capsys.readouterr().out
    assert "(256 tokens," in out
    assert abs(printed_loss(out) - expected) < 1e-5, (out, expected)
    # The Hugging Face folder itself as checkpoint.initial_load_path: read as train.py reads it.
    assert load_evaluate().main([*job, "--checkpoint.initial_load_path", str(tmp_path / "hf")]) == 0
    assert printed_loss(capsys.readouterr().out) == printed_loss(out)


def test_evaluate_without_a_checkpoint_is_one_line(tmp_path, capsys):
    assert load_evaluate().main([*JOB, "--job.dump_folder", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: job.dump_folder: no checkpoint in") and err.count("\n") == 1, err


def test_evaluate_shows_progress_on_stderr(tmp_path, capsys, monkeypatch):
    """What is evaluated at the start, then a line per PROGRESS_SECONDS (0 here: one per batch after
    the first); stdout keeps the result line only."""
    tokenizer = Tokenizer(ROOT / "assets" / "tokenizer" / "kjv_bpe.tiktoken")
    args = build_model_args(parse_args(JOB), tokenizer.n_words)
    dcp.save({"model": random_model(args).state_dict()}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    evaluate = load_evaluate()
    monkeypatch.setattr(evaluate, "PROGRESS_SECONDS", 0.0)
    job = [*JOB, "--job.dump_folder", str(tmp_path / "run"), "--checkpoint.initial_load_path"]
    assert evaluate.main([*job, str(tmp_path / "dcp")]) == 0
    captured = capsys.readouterr()
    start = f"Evaluating {tmp_path / 'dcp'} on kjv_validation: 2 batches of 128 tokens\n"
    # After `datasets`' progress bar, when it builds its cache.
    assert f"{start}  1 batches (128 tokens) in " in captured.err, captured.err
    assert captured.out.count("\n") == 1 and printed_loss(captured.out) > 0, captured.out
