"""checkpoint.initial_load_path as a Hugging Face folder (torchtitan/checkpoint/hf_reader.py): train.py
starts from a folder transformers saved, for each family on one process and Qwen3-MoE on FSDP 2, its
step-1 loss that of transformers on the same first batch; a folder of another family or shape, without
weights or with a damaged file is one line and exit 2. The sharded reads (each rank its share, the
weights bit for bit): test_parallelisms.py."""

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from launch import ROOT, TINY_JOB, losses, run_train, run_train_in_process
from test_convert import random_model

from torchtitan.checkpoint.hf_export import export_hf
from torchtitan.checkpoint.hf_reader import load_hf_weights
from torchtitan.config.options import ConfigError
from torchtitan.config.parser import parse_args
from torchtitan.datasets.build import build_training_data_loader
from torchtitan.datasets.layout import BatchLayout
from torchtitan.datasets.tokenizer import Tokenizer
from torchtitan.models import MODEL_SPECS, build_model_args

transformers = pytest.importorskip("transformers")

TOKENIZER = ROOT / "assets" / "tokenizer" / "kjv_bpe.tiktoken"
FAMILIES = {
    "llama3": [],
    "qwen3": ["--model.name", "qwen3", "--model.flavor", "debugmodel_tied"],  # the head tied: no lm_head
    "qwen3_moe": ["--model.name", "qwen3_moe", "--model.flavor", "debugmodel"],
}
ONE_STEP = [*TINY_JOB, "--training.steps", "1"]


def hub_folder(folder: Path, name: str, **changes: int) -> Path:
    """A random model of the job's family and flavour (with `changes` to its arguments), as
    transformers' save_pretrained writes it."""
    tokenizer = Tokenizer(TOKENIZER)
    args = build_model_args(parse_args([*ONE_STEP, *FAMILIES[name]]), tokenizer.n_words)
    for key, value in changes.items():
        setattr(args, key, value)
    state = {"model": random_model(args, name).state_dict()}
    dcp.save(state, checkpoint_id=str(folder / "dcp"), no_dist=True)
    export_hf(str(folder / "dcp"), str(folder / "ours"), args, name=name)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder / "ours", dtype=torch.float32)
    hf_model.save_pretrained(folder / "hub")
    return folder / "hub"


def transformers_first_loss(hub: Path, name: str) -> float:
    """transformers' loss on train.py's first batch of the job."""
    training = parse_args([*ONE_STEP, *FAMILIES[name]]).training
    tokenizer = Tokenizer(TOKENIZER)
    loader = build_training_data_loader(
        training, tokenizer, BatchLayout(training.batch_size), tokenizer.n_words, pin_memory=False
    )
    inputs, labels = next(iter(loader))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(hub, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf_model(inputs).logits
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten()).item()


@pytest.mark.parametrize("name", FAMILIES)
def test_a_hub_folder_starts_a_run(tmp_path, name):
    hub = hub_folder(tmp_path, name)
    expected = transformers_first_loss(hub, name)
    argv = [*ONE_STEP, *FAMILIES[name], "--checkpoint.initial_load_path", str(hub)]
    assert run_train_in_process(*argv, "--job.dump_folder", str(tmp_path / "run")) == 0
    assert abs(losses(tmp_path / "run")[1] - expected) <= 1e-5, (losses(tmp_path / "run"), expected)
    if name == "qwen3_moe":  # the experts stacked from the Hub's per-expert files, each rank its half
        half = str(parse_args(argv).training.batch_size // 2)  # per rank: the same global batch
        result = run_train(2, tmp_path / "fsdp", *argv, "--training.batch_size", half)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert abs(losses(tmp_path / "fsdp")[1] - expected) <= 1e-5


def test_a_bad_hub_folder_is_one_line(tmp_path, capsys):
    """Another family through train.py (one line, exit 2, before a step); another shape, a folder
    without weights and a damaged file through the loader, each its one-line ConfigError."""
    hub = hub_folder(tmp_path, "qwen3")
    capsys.readouterr()  # transformers' progress bars while the folder was made
    argv = [*ONE_STEP, "--checkpoint.initial_load_path", str(hub), "--job.dump_folder", str(tmp_path / "run")]
    assert run_train_in_process(*argv) == 2
    err = capsys.readouterr().err  # the data set's first build may show a progress bar before
    line = err.split("error:")[-1]
    assert err.count("error:") == 1 and line.count("\n") == 1, err
    assert "model.name: " in line and "holds a qwen3 model" in line and "not this job's llama3" in line

    job = parse_args(ONE_STEP)
    model = MODEL_SPECS["llama3"].build(build_model_args(job, Tokenizer(TOKENIZER).n_words))
    smaller = hub_folder(tmp_path / "smaller", "llama3", vocab_size=1024)
    with pytest.raises(ConfigError, match=r"model.flavor: .* tok_embeddings.weight with shape \(1024, 256\)"):
        load_hf_weights(model, str(smaller), job.model)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text((smaller / "config.json").read_text())
    with pytest.raises(ConfigError, match="has a config.json but no weights"):
        load_hf_weights(model, str(tmp_path / "empty"), job.model)
    data = (smaller / "model.safetensors").read_bytes()
    (smaller / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match="is damaged or not a safetensors file"):
        load_hf_weights(model, str(smaller), job.model)
