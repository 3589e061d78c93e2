"""checkpoint.initial_load_path as a Hugging Face folder (torchtitan/checkpoint/hf_reader.py): train.py
starts from a folder transformers saved, for each family on one process and Qwen3-MoE on FSDP 2, its
step-1 loss that of transformers on the same first batch (DeepSeek-V3's logits: test_deepseek_v3.py); a
folder of another family or shape, without weights or with a damaged file is one line and exit 2. The
sharded reads (each rank its share, the weights bit for bit): test_parallelisms.py."""

import json
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from launch import ROOT, TINY_JOB, losses, run_train, run_train_in_process
from test_convert import random_model

from scripts import convert_hf_to_dcp
from torchtitan.checkpoint.hf_export import export_hf
from torchtitan.checkpoint.hf_reader import load_hf_weights
from torchtitan.checkpoint.load import read_model_weights
from torchtitan.config.options import ConfigError
from torchtitan.config.parser import parse_args
from torchtitan.datasets.build import build_training_data_loader
from torchtitan.datasets.layout import BatchLayout
from torchtitan.datasets.tokenizer import Tokenizer
from torchtitan.models import MODEL_SPECS, build_model_args
from torchtitan.models.qwen3 import qwen3_configs

transformers = pytest.importorskip("transformers")

TOKENIZER = ROOT / "assets" / "tokenizer" / "kjv_bpe.tiktoken"
FAMILIES = {
    "llama3": [],
    "qwen3": ["--model.name", "qwen3", "--model.flavor", "debugmodel_tied"],  # the head tied: no lm_head
    "qwen3_moe": ["--model.name", "qwen3_moe", "--model.flavor", "debugmodel"],
    "deepseek_v3": ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel"],
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


@pytest.fixture(scope="module")
def hub_of(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """hub_folder(name), made once for this module's tests: they only read it, or damage a copy."""
    made: dict[str, Path] = {}

    def hub(name: str) -> Path:
        if name not in made:
            made[name] = hub_folder(tmp_path_factory.mktemp(name), name)
        return made[name]

    return hub


def transformers_first_loss(hub: Path, name: str) -> float:
    """transformers' loss on train.py's first batch of the job."""
    training = parse_args([*ONE_STEP, *FAMILIES[name]]).training
    tokenizer = Tokenizer(TOKENIZER)
    loader = build_training_data_loader(
        training, tokenizer, BatchLayout(training.batch_size), tokenizer.n_words, pin_memory=False
    )
    batch = next(iter(loader))
    inputs, labels = batch.inputs, batch.labels
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(hub, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf_model(inputs).logits
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten()).item()


@pytest.mark.parametrize("name", FAMILIES)
def test_a_hub_folder_starts_a_run(tmp_path, name, hub_of):
    hub = hub_of(name)
    expected = transformers_first_loss(hub, name)
    argv = [*ONE_STEP, *FAMILIES[name], "--checkpoint.initial_load_path", str(hub)]
    assert run_train_in_process(*argv, "--job.dump_folder", str(tmp_path / "run")) == 0
    assert abs(losses(tmp_path / "run")[1] - expected) <= 1e-5, (losses(tmp_path / "run"), expected)
    if name == "qwen3_moe":  # the experts stacked from the Hub's per-expert files, each rank its half
        half = str(parse_args(argv).training.batch_size // 2)  # per rank: the same global batch
        result = run_train(2, tmp_path / "fsdp", *argv, "--training.batch_size", half)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert abs(losses(tmp_path / "fsdp")[1] - expected) <= 1e-5


def test_a_bad_hub_folder_is_one_line(tmp_path, capsys, hub_of):
    """Another family through train.py (one line, exit 2, before a step); another shape, a folder
    without weights and a damaged file through the loader, each its one-line ConfigError."""
    hub = hub_of("qwen3")
    capsys.readouterr()  # transformers' progress bars while the folder was made
    argv = [*ONE_STEP, "--checkpoint.initial_load_path", str(hub), "--job.dump_folder", str(tmp_path / "run")]
    assert run_train_in_process(*argv) == 2
    err = capsys.readouterr().err  # the data set's first build may show a progress bar before
    line = err.split("error:")[-1]
    assert err.count("error:") == 1 and line.count("\n") == 1, err
    assert "model.name: " in line and "holds a qwen3 model" in line and "not this job's llama3" in line

    job = parse_args(ONE_STEP)
    args = build_model_args(job, Tokenizer(TOKENIZER).n_words)
    model = MODEL_SPECS["llama3"].build(args)
    smaller = hub_folder(tmp_path / "smaller", "llama3", vocab_size=1024)
    with pytest.raises(ConfigError, match=r"model.vocab_size: .* tok_embeddings.weight with 1024 rows"):
        load_hf_weights(model, str(smaller), job.model, args)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text((smaller / "config.json").read_text())
    with pytest.raises(ConfigError, match="has a config.json but no weights"):
        load_hf_weights(model, str(tmp_path / "empty"), job.model, args)
    data = (smaller / "model.safetensors").read_bytes()
    (smaller / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match="is damaged or not a safetensors file"):
        load_hf_weights(model, str(smaller), job.model, args)


def test_a_hub_folder_missing_a_tensor_is_one_line_naming_it(tmp_path, capsys, hub_of):
    """A layer's tensor (train.py, exit 2 before a step) or an expert's (the converter) gone from a folder
    transformers saved: one line naming the tensor and its file, nothing trained or written."""
    from test_convert import drop_tensor

    hub = Path(shutil.copytree(hub_of("llama3"), tmp_path / "llama"))
    drop_tensor(hub, "model.layers.1.mlp.up_proj.weight")
    capsys.readouterr()
    argv = [*ONE_STEP, "--checkpoint.initial_load_path", str(hub), "--job.dump_folder", str(tmp_path / "run")]
    assert run_train_in_process(*argv) == 2
    line = capsys.readouterr().err.split("error:")[-1]
    assert line.count("\n") == 1 and not (tmp_path / "run" / "checkpoint").exists(), line
    assert line.startswith(
        f" checkpoint.initial_load_path: {hub / 'model.safetensors'} has no model.layers.1.mlp.up_proj.weight"
    ), line
    moe = Path(shutil.copytree(hub_of("qwen3_moe"), tmp_path / "moe"))
    drop_tensor(moe, "model.layers.1.mlp.experts.3.down_proj.weight")
    capsys.readouterr()
    assert convert_hf_to_dcp.main([str(moe), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no model.layers.1.mlp.experts.3.down_proj.weight" in err, err
    assert not (tmp_path / "out").exists()


LLAMA31_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


# (family, flavour RoPE-scaled) -> config.json edits of its export and what the refusal says of each.
ROPE_EDITS = {
    ("llama3", False): [  # a Llama 3.1 folder for a Llama 3 flavour, another theta
        (dict(rope_scaling=LLAMA31_SCALING), "rope_type llama3, the flavour default"),
        (dict(rope_theta=10000.0), "rope_theta 10000.0, the flavour 500000.0"),
    ],
    ("llama3", True): [  # each way a Llama 3.1 folder can differ from the 3.1 flavours
        (dict(rope_scaling=None), "rope_type default, the flavour llama3"),
        (dict(rope_scaling={**LLAMA31_SCALING, "factor": 16.0}), "factor 16.0, the flavour 8.0"),
        (
            dict(rope_scaling={**LLAMA31_SCALING, "high_freq_factor": 2}),
            "high_freq_factor 2, the flavour 4.0",
        ),
        (
            dict(rope_scaling={**LLAMA31_SCALING, "original_max_position_embeddings": 4096}),
            "original_max_position_embeddings 4096, the flavour 8192",
        ),
    ],
    ("qwen3", False): [(dict(rope_theta=500000.0), "rope_theta 500000.0, the flavour 1000000.0")],
    ("qwen3_moe", False): [
        (
            dict(
                rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
            ),
            "rope_type yarn, the flavour default",
        ),
    ],
}


@pytest.mark.parametrize("name, scaled", ROPE_EDITS)
def test_a_folder_with_other_rope_is_refused(tmp_path, name, scaled):
    """The export's folder, its config.json's RoPE edited: one line naming the field, the folder's value
    and the flavour's, before any weight is read (DeepSeek-V3's YaRN: test_deepseek_v3.py)."""
    job = parse_args([*ONE_STEP, *FAMILIES[name]])
    args = build_model_args(job, Tokenizer(TOKENIZER).n_words)
    args = replace(args, use_scaled_rope=True) if scaled else args
    dcp.save(
        {"model": random_model(args, name).state_dict()}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True
    )
    export_hf(str(tmp_path / "dcp"), str(tmp_path / "hf"), args, name=name)
    with torch.device("meta"):
        model = MODEL_SPECS[name].build(args)
    config_path = tmp_path / "hf" / "config.json"
    config = json.loads(config_path.read_text())
    MODEL_SPECS[name].hf().check_flavor(config, args, "the export")  # as exported: the flavour's RoPE
    for edit, message in ROPE_EDITS[name, scaled]:
        config_path.write_text(json.dumps({**config, **edit}))
        with pytest.raises(
            ConfigError, match=f"model.flavor: {tmp_path / 'hf'}'s config.json has RoPE {message};"
        ):
            load_hf_weights(model, str(tmp_path / "hf"), job.model, args)


def folder_bytes(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` and its bytes: a refused input must be left byte for byte as it was."""
    return {str(f.relative_to(folder)): f.read_bytes() for f in sorted(folder.rglob("*")) if f.is_file()}


def test_a_larger_hub_folder_is_refused_not_cut(tmp_path):
    """A folder with more layers than the job's flavour: its extra layers are named, not dropped."""
    job = parse_args(ONE_STEP)
    args = build_model_args(job, Tokenizer(TOKENIZER).n_words)
    larger = hub_folder(tmp_path, "llama3", n_layers=args.n_layers + 1)
    before = folder_bytes(larger)
    with pytest.raises(ConfigError, match=rf"model.flavor: .* holds layers\.{args.n_layers}\..* and 8 more"):
        load_hf_weights(MODEL_SPECS["llama3"].build(args), str(larger), job.model, args)
    assert folder_bytes(larger) == before


def test_the_qwen3_vocabulary_loads_trains_and_exports(tmp_path, monkeypatch):
    """A folder shaped as the released Qwen3's vocabulary (151,936 rows over a tokenizer of fewer ids),
    its other sizes tiny: model.vocab_size -1 takes the folder's rows, the first loss is transformers',
    two steps train, and the run's export reads back bit for bit as its last checkpoint."""
    tiny = {"dim": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "head_dim": 16, "hidden_dim": 64}
    monkeypatch.setitem(qwen3_configs, "tiny", replace(qwen3_configs["debugmodel_tied"], **tiny))
    hub = hub_folder(tmp_path, "qwen3", **tiny, vocab_size=151936)
    before = folder_bytes(hub)
    expected = transformers_first_loss(hub, "qwen3")
    run = tmp_path / "run"
    argv = [*ONE_STEP, "--model.name", "qwen3", "--model.flavor", "tiny", "--model.n_layers", "0"]
    argv += ["--training.steps", "2"]
    argv += ["--checkpoint.initial_load_path", str(hub), "--job.dump_folder", str(run)]
    argv += ["--checkpoint.enable_checkpoint", "true", "--checkpoint.last_save_in_hf", "true"]
    assert run_train_in_process(*argv) == 0
    assert abs(losses(run)[1] - expected) <= 1e-5, (losses(run), expected)
    assert json.loads((run / "hf" / "config.json").read_text())["vocab_size"] == 151936
    convert_hf_to_dcp.convert(str(run / "hf"), str(tmp_path / "back"))
    back, saved = (
        read_model_weights(str(tmp_path / "back")),
        read_model_weights(str(run / "checkpoint" / "step-2")),
    )
    assert back.keys() == saved.keys()
    assert all(torch.equal(back[name], saved[name]) for name in saved)
    assert folder_bytes(hub) == before
