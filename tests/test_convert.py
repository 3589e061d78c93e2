"""Checkpoint conversion: DCP -> one torch.save file, and DCP <-> Hugging Face Llama and Qwen3 (checked
against transformers' own LlamaForCausalLM and Qwen3ForCausalLM)."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from launch import ROOT
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from scripts import convert_dcp_to_hf, convert_dcp_to_torch, convert_hf_to_dcp
from torchtitan.checkpoint.checksums import ChecksumWriter
from torchtitan.checkpoint.load import read_model_weights
from torchtitan.checkpoint.state import RECORD, tokenizer_sha256
from torchtitan.config.options import ConfigError
from torchtitan.models import MODEL_SPECS
from torchtitan.models.llama import ModelArgs
from torchtitan.models.llama.hf_convert import halves_to_interleaved, interleaved_to_halves
from torchtitan.models.qwen3 import Qwen3ModelArgs
from torchtitan.models.qwen3_moe import qwen3_moe_configs

# GQA (8 query heads sharing 2 kv heads) and Llama 3.1's scaled RoPE, with low frequencies that it scales.
TINY_GQA = ModelArgs(
    dim=64, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=96, multiple_of=32, rope_theta=500000,
    use_scaled_rope=True, max_seq_len=32,
)  # fmt: skip


def random_model(args: ModelArgs | Qwen3ModelArgs, name: str = "llama3") -> torch.nn.Module:
    """The model of family `name` (a model.name) with random values everywhere, norm weights included,
    so that no two parameters are alike."""
    torch.manual_seed(0)
    model = MODEL_SPECS[name].build(args)
    model.init_weights(seed=0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1 if p.ndim > 1 else 1.0)
    return model


def test_rope_permutation_is_inverted():
    w = torch.arange(24 * 5.0).view(24, 5)
    permuted = interleaved_to_halves(w, n_heads=3)
    # Head 0 holds rows 0..7: its RoPE pairs (0, 1), (2, 3), ... become halves (0, 2, 4, 6 | 1, 3, 5, 7).
    assert permuted[:8, 0].tolist() == [0.0, 10.0, 20.0, 30.0, 5.0, 15.0, 25.0, 35.0]
    assert torch.equal(halves_to_interleaved(permuted, n_heads=3), w)


def test_dcp_to_hf_matches_transformers_and_round_trips(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = random_model(TINY_GQA)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    convert_dcp_to_hf.convert(str(tmp_path / "dcp"), str(tmp_path / "hf"), TINY_GQA)

    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["num_key_value_heads"], config["intermediate_size"], config["vocab_size"]) == (2, 192, 96)
    assert config["rope_theta"] == 500000 and config["rope_scaling"]["rope_type"] == "llama3"
    hf_model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    tokens = torch.randint(0, TINY_GQA.vocab_size, (2, TINY_GQA.max_seq_len))
    with torch.no_grad():
        ours, theirs = model(tokens), hf_model(tokens).logits
    assert (ours - theirs).abs().max() < 1e-5

    # The same weights with plain RoPE give other logits: the check above can see a wrong config.
    config["rope_scaling"] = None
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    plain = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        assert (plain(tokens).logits - ours).abs().max() > 1e-3

    convert_hf_to_dcp.convert(str(tmp_path / "hf"), str(tmp_path / "back"))
    back = read_model_weights(str(tmp_path / "back"))
    assert back.keys() == model.state_dict().keys()
    for name, w in model.state_dict().items():
        assert torch.equal(back[name], w), name


def test_dcp_to_hf_command_line(tmp_path, capsys):
    """The model.name, flavour and tokenizer from the checkpoint's record (the debug flavour), cast to
    bfloat16; another family given is refused before anything else, naming the recorded one, and
    another tokenizer by its hash."""
    args = ModelArgs(dim=256, n_layers=6, n_heads=16, rope_theta=500000, vocab_size=40)
    tokenizer = str(ROOT / "assets" / "tokenizer" / "kjv_bpe.tiktoken")
    record = {"name": "llama3", "flavor": "debugmodel", "tokenizer_path": tokenizer}
    record["tokenizer_sha256"] = tokenizer_sha256(tokenizer)
    state = {"model": random_model(args).state_dict(), RECORD: record}
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert convert_dcp_to_hf.main([str(tmp_path / "dcp"), str(tmp_path / "hf"), "--dtype", "bfloat16"]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["num_hidden_layers"] == 6
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    capsys.readouterr()
    hf_tokenizer = str(ROOT / "assets" / "tokenizer" / "kjv_bpe_hf")
    argv = [str(tmp_path / "dcp"), str(tmp_path / "x"), "--tokenizer", hf_tokenizer]
    assert convert_dcp_to_hf.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--tokenizer: " in err and "(their SHA-256 differ)" in err

    # A Qwen3-MoE checkpoint (its routing biases non-zero) exported as Qwen3: the family is named first.
    record = {**record, "name": "qwen3_moe"}
    moe = MODEL_SPECS["qwen3_moe"].build(replace(qwen3_moe_configs["debugmodel"], vocab_size=40))
    moe.init_weights(0)
    weights = {k: v.fill_(1.0) if k.endswith("expert_bias") else v for k, v in moe.state_dict().items()}
    dcp.save({"model": weights, RECORD: record}, checkpoint_id=str(tmp_path / "moe"), no_dist=True)
    assert convert_dcp_to_hf.main([str(tmp_path / "moe"), str(tmp_path / "x"), "--name", "qwen3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--name: " in err and "holds a qwen3_moe debugmodel model" in err, err
    assert "--drop-expert-bias" not in err and not (tmp_path / "x").exists()

    # Without a record (converted from Hugging Face, saved by an earlier version): --name, --flavor and
    # --tokenizer.
    dcp.save({"model": random_model(args).state_dict()}, checkpoint_id=str(tmp_path / "bare"), no_dist=True)
    assert convert_dcp_to_hf.main([str(tmp_path / "bare"), str(tmp_path / "x")]) == 2
    assert "--tokenizer: " in capsys.readouterr().err
    with pytest.raises(SystemExit):
        argv = [str(tmp_path / "bare"), str(tmp_path / "x"), "--flavor", "nosuch", "--tokenizer", tokenizer]
        convert_dcp_to_hf.main(argv)
    assert "has no flavor 'nosuch'" in capsys.readouterr().err


def tiny_qwen3(tied: bool) -> Qwen3ModelArgs:
    """GQA (4 query heads on 2 kv heads) with a head size of 32, not dim / n_heads (16)."""
    return Qwen3ModelArgs(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, hidden_dim=96, vocab_size=100,
        max_seq_len=32, tie_word_embeddings=tied,
    )  # fmt: skip


def qwen3_logits_difference(ours: torch.nn.Module, theirs: torch.nn.Module, args: Qwen3ModelArgs) -> float:
    torch.manual_seed(1)
    tokens = torch.randint(0, args.vocab_size, (2, args.max_seq_len))
    with torch.no_grad():
        return (ours(tokens) - theirs(tokens).logits).abs().max().item()


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_qwen3_from_hf_matches_transformers_and_round_trips_bit_exact(tmp_path, tied):
    """A random transformers Qwen3ForCausalLM -> DCP -> ours: the same logits; -> HF again: the same files."""
    transformers = pytest.importorskip("transformers")
    args = tiny_qwen3(tied)
    config = transformers.Qwen3Config(
        vocab_size=args.vocab_size, hidden_size=args.dim, num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads, head_dim=args.head_dim,
        intermediate_size=args.hidden_dim, rms_norm_eps=args.norm_eps, rope_theta=args.rope_theta,
        tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(0)
    hf_model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for p in hf_model.parameters():  # the q/k norms too
            p.normal_(0.0, 0.1 if p.ndim > 1 else 1.0)
    hf_model.save_pretrained(tmp_path / "hf")
    hf_weights = load_file(tmp_path / "hf" / "model.safetensors")
    assert ("lm_head.weight" in hf_weights) != tied

    convert_hf_to_dcp.convert(str(tmp_path / "hf"), str(tmp_path / "dcp"))
    weights = read_model_weights(str(tmp_path / "dcp"))
    model = MODEL_SPECS["qwen3"].build(args).eval()
    assert weights.keys() == model.state_dict().keys()  # output.weight too when tied
    model.load_state_dict(weights)
    assert qwen3_logits_difference(model, hf_model, args) < 1e-5

    convert_dcp_to_hf.convert(str(tmp_path / "dcp"), str(tmp_path / "back"), args, name="qwen3")
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert back.keys() == hf_weights.keys()
    for name, w in hf_weights.items():
        assert torch.equal(back[name], w), name


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_qwen3_to_hf_loads_in_transformers(tmp_path, tied):
    """Ours -> DCP -> HF folder: AutoModelForCausalLM builds a Qwen3ForCausalLM with the same logits."""
    transformers = pytest.importorskip("transformers")
    args = tiny_qwen3(tied)
    model = random_model(args, "qwen3").eval()
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    convert_dcp_to_hf.convert(str(tmp_path / "dcp"), str(tmp_path / "hf"), args, name="qwen3")

    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["architectures"], config["model_type"]) == (["Qwen3ForCausalLM"], "qwen3")
    assert (config["head_dim"], config["num_key_value_heads"], config["intermediate_size"]) == (32, 2, 96)
    assert (config["tie_word_embeddings"], config["rope_theta"]) == (tied, 1e6)
    assert ("lm_head.weight" in load_file(tmp_path / "hf" / "model.safetensors")) != tied
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(hf_model).__name__ == "Qwen3ForCausalLM"
    assert qwen3_logits_difference(model, hf_model, args) < 1e-5

    if not tied:  # a tied flavour would drop the checkpoint's own output layer
        with pytest.raises(ConfigError, match="--flavor: the flavor ties the output layer"):
            convert_dcp_to_hf.convert(
                str(tmp_path / "dcp"),
                str(tmp_path / "x"),
                replace(args, tie_word_embeddings=True),
                name="qwen3",
            )


def test_hf_to_dcp_of_an_unsupported_model_type_is_one_line(tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    config = {"model_type": "mistral", "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"x")
    assert convert_hf_to_dcp.main([str(tmp_path / "hf"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    supported = (
        "(deepseek_v3, llama, qwen3, qwen3_5, qwen3_5_moe, qwen3_5_moe_text, qwen3_5_text, qwen3_moe, "
        "qwen3_next)"
    )
    assert f"has model_type 'mistral'; give a model of a supported type {supported}" in err
    assert err.count("\n") == 1, err


def test_dcp_to_torch_save_loads_with_weights_only(tmp_path):
    from test_checkpoint import Run

    run = Run(tmp_path, interval=1)
    run.train(1)
    output = tmp_path / "step-1.pt"
    convert_dcp_to_torch.main([str(tmp_path / "checkpoint" / "step-1"), str(output)])
    state = torch.load(output, weights_only=True)
    assert set(state) == {
        "model",
        "optimizer",
        "lr_scheduler",
        "dataloader",
        "train_state",
        "rng",
        "model_record",
    }
    assert state["model_record"]["name"] == "llama3"
    assert torch.equal(state["model"]["output.weight"], run.model.output.weight)
    assert state["train_state"]["step"] == 1 and state["dataloader"] == {"value": 2}
    # The same as torch's own converter (which unpickles without restrictions).
    dcp_to_torch_save(tmp_path / "checkpoint" / "step-1", tmp_path / "reference.pt")
    reference = torch.load(tmp_path / "reference.pt", weights_only=True)
    assert state.pop("model_record") == reference.pop("model_record")  # strings: not for assert_close
    torch.testing.assert_close(state, reference, rtol=0, atol=0)


INDEX = "model.safetensors.index.json"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def folder_bytes(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` and its bytes: a refused input must be left byte for byte as it was."""
    return {str(f.relative_to(folder)): f.read_bytes() for f in sorted(folder.rglob("*")) if f.is_file()}


def sharded_hf_folder(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A tiny Qwen3 folder sharded as the Hub's (two files and their index), and its model's weights."""
    args = tiny_qwen3(tied=False)
    weights = random_model(args, "qwen3").state_dict()
    dcp.save({"model": weights}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    hf = tmp_path / "hf"
    convert_dcp_to_hf.convert(str(tmp_path / "dcp"), str(hf), args, name="qwen3")
    tensors = load_file(hf / "model.safetensors")
    (hf / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {SHARDS[0]: names[: len(names) // 2], SHARDS[1]: names[len(names) // 2 :]}
    for file, part in shards.items():
        save_file({name: tensors[name] for name in part}, hf / file, {"format": "pt"})
    weight_map = {name: file for file, part in shards.items() for name in part}
    (hf / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return hf, weights


def stray_comma(path: Path) -> None:
    path.write_text(path.read_text().replace("{", "{,", 1))


def misplaced(path: Path) -> None:
    index = json.loads(path.read_text())
    name = next(name for name, file in index["weight_map"].items() if file == SHARDS[0])
    index["weight_map"][name] = SHARDS[1]
    path.write_text(json.dumps(index))


DAMAGE = {
    "index hand-edited": (INDEX, stray_comma, f"{INDEX} is not valid JSON"),
    "shard missing": (SHARDS[1], Path.unlink, f"{SHARDS[1]}; {INDEX} names it"),
    "shard cut short": (
        SHARDS[0],
        lambda p: p.write_bytes(p.read_bytes()[:-100]),
        "is damaged or not a safetensors",
    ),
    "index and shards disagree": (INDEX, misplaced, f"{INDEX} puts "),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_hf_to_dcp_reads_the_index_and_refuses_a_damaged_folder(tmp_path, capsys, damage):
    """The converter reads checkpoint.initial_load_path's way: the index, every shard it names, each
    holding what the index says; damage is one line naming the file, exit 2, nothing written."""
    hf, _ = sharded_hf_folder(tmp_path)
    file, spoil, message = DAMAGE[damage]
    spoil(hf / file)
    before = folder_bytes(hf)
    capsys.readouterr()
    assert convert_hf_to_dcp.main([str(hf), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: hf_folder: ") and err.count("\n") == 1 and message in err, err
    assert folder_bytes(hf) == before and not (tmp_path / "out").exists()


def test_hf_to_dcp_names_what_it_skips(tmp_path, capsys):
    """A sharded folder converts whole (the same weights), its multi-token prediction layer named as
    skipped, not an error."""
    hf, weights = sharded_hf_folder(tmp_path)
    save_file({"mtp.fc.weight": torch.ones(2, 2)}, hf / "mtp.safetensors")
    index = json.loads((hf / INDEX).read_text())
    index["weight_map"]["mtp.fc.weight"] = "mtp.safetensors"
    (hf / INDEX).write_text(json.dumps(index))
    assert convert_hf_to_dcp.main([str(hf), str(tmp_path / "out")]) == 0
    assert (
        "skipped (no model here has a place for them): multi-token prediction: 1 tensors (mtp.fc.weight)"
        in (capsys.readouterr().out)
    )
    back = read_model_weights(str(tmp_path / "out"))
    assert back.keys() == weights.keys() and all(torch.equal(back[k], w) for k, w in weights.items())


def test_converters_never_write_over_a_users_files(tmp_path, capsys):
    """An existing Hugging Face folder (or torch file) is refused as output unless --overwrite, which
    replaces it whole (no stale shard left beside the new weights); a run's step-N is never written into."""
    hf, _ = sharded_hf_folder(tmp_path)
    args = ModelArgs(dim=256, n_layers=6, n_heads=16, rope_theta=500000, vocab_size=40)
    tokenizer = str(ROOT / "assets" / "tokenizer" / "kjv_bpe.tiktoken")
    record = {"name": "llama3", "flavor": "debugmodel", "tokenizer_path": tokenizer}
    record["tokenizer_sha256"] = tokenizer_sha256(tokenizer)
    step = tmp_path / "checkpoint" / "step-3"
    state = {"model": random_model(args).state_dict(), RECORD: record}
    dcp.save(state, storage_writer=ChecksumWriter(str(step)), no_dist=True)
    before = {folder: folder_bytes(folder) for folder in (hf, step)}
    capsys.readouterr()

    refusals = [
        (convert_dcp_to_hf.main, [str(step), str(hf)], "already holds files (config.json, "),
        (convert_hf_to_dcp.main, [str(hf), str(step), "--overwrite"], "is a run's checkpoint"),
        (convert_hf_to_dcp.main, [str(hf), str(step / "hf")], f"is inside {step}, a run's checkpoint"),
        (convert_dcp_to_hf.main, [str(step), str(tmp_path), "--overwrite"], "holds the input"),
    ]
    saved = tmp_path / "step-3.pt"
    saved.write_bytes(b"a user's file")
    refusals += [
        (convert_dcp_to_torch.main, [str(step), str(saved)], "exists; give a new file, or pass --overwrite"),
        (convert_dcp_to_torch.main, [str(step), str(step / "x.pt"), "--overwrite"], "is inside"),
    ]
    for main, argv, message in refusals:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: output: ") and err.count("\n") == 1 and message in err, (argv, err)
        assert {folder: folder_bytes(folder) for folder in (hf, step)} == before
        assert saved.read_bytes() == b"a user's file"
    assert convert_dcp_to_torch.main([str(step), str(saved), "--overwrite"]) == 0
    assert torch.load(saved, weights_only=True)["model"].keys() == state["model"].keys()

    assert convert_dcp_to_hf.main([str(step), str(hf), "--overwrite"]) == 0
    exported = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]
    assert sorted(path.name for path in hf.iterdir()) == [*exported, "tokenizer_config.json"]
    assert folder_bytes(step) == before[step]


def drop_tensor(folder: Path, name: str) -> None:
    """The folder without the tensor `name` (in a single model.safetensors or a shard of the index)."""
    index = folder / INDEX
    files = json.loads(index.read_text())["weight_map"] if index.exists() else {name: "model.safetensors"}
    tensors = load_file(folder / files[name])
    del tensors[name]
    save_file(tensors, folder / files[name], {"format": "pt"})
    if index.exists():
        listing = json.loads(index.read_text())
        del listing["weight_map"][name]
        index.write_text(json.dumps(listing))


def test_a_folder_missing_a_layers_tensor_is_one_line_naming_it(tmp_path, capsys):
    """A layer's tensor gone from a sharded folder (its index too, so that the two agree): one line
    naming the tensor and the index, exit 2, nothing written, rather than a checkpoint without it."""
    hf, _ = sharded_hf_folder(tmp_path)
    drop_tensor(hf, "model.layers.1.self_attn.k_norm.weight")
    capsys.readouterr()
    assert convert_hf_to_dcp.main([str(hf), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and not (tmp_path / "out").exists(), err
    assert err.startswith(
        f"error: hf_folder: no file of {hf / INDEX} holds model.layers.1.self_attn.k_norm"
    ), err
