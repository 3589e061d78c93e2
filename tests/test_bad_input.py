"""Every kind of bad input stops the job with exit code 2 and one line naming the option or file (no
traceback), before any heavy work, and leaves the dump folder exactly as it was.

Most cases run train.py's run() in this process (what each rank runs); a few go through
run_llama_train.sh end to end, where the preflight answers before torch is imported."""

import hashlib
import json
import os
import pickle
import runpy
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from launch import ROOT, TINY_JOB, run_train_in_process

from torchtitan.checkpoint.checksums import MANIFEST
from torchtitan.checkpoint.safe_reader import SafeLoadPlanner, SafeReader, read_checkpoint
from torchtitan.datasets.pretokenized import pretokenize

CKPT = ["--checkpoint.enable_checkpoint", "true"]


def folder_hashes(folder: Path) -> dict[str, str]:
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A dump folder holding a real one-step run: checkpoint step-1 and metrics.jsonl."""
    dump = tmp_path_factory.mktemp("trained")
    code = run_train_in_process(*TINY_JOB, *CKPT, "--training.steps", "1", "--job.dump_folder", str(dump))
    assert code == 0
    assert (dump / "checkpoint" / "step-1" / ".metadata").is_file()
    return dump


class Evil:
    """Unpickling this runs a shell command: what a crafted checkpoint could do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def copy_checkpoint(trained: Path, dump: Path) -> Path:
    shutil.copytree(trained / "checkpoint" / "step-1", dump / "checkpoint" / "step-1")
    return dump / "checkpoint" / "step-1"


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(data)


@dataclass
class Case:
    """argv(tmp_path, dump, trained) -> extra arguments (and files written under tmp_path)."""

    id: str
    argv: object
    message: str
    env: dict | None = None


def toml(text: str):
    def argv(tmp, dump, trained):
        (tmp / "job.toml").write_text(text)
        return ["--job.config_file", str(tmp / "job.toml")]

    return argv


def args(*extra: str):
    return lambda tmp, dump, trained: list(extra)


def with_file(option: str, name: str, content: bytes | None):
    """An option pointing at a file (or, with content None, a missing one) under tmp_path."""

    def argv(tmp, dump, trained):
        if content is not None:
            (tmp / name).write_bytes(content)
        return [option, str(tmp / name)]

    return argv


def validation(make):
    """The same arguments with validation on."""
    return lambda tmp, dump, trained: ["--validation.enable", "true", *make(tmp, dump, trained)]


def empty_folder(option: str):
    def argv(tmp, dump, trained):
        (tmp / "empty").mkdir()
        return [option, str(tmp / "empty")]

    return argv


def hf_tokenizer_folder(config: dict, tokenizer_json: bool = True):
    """--model.tokenizer_path at a folder holding this tokenizer_config.json, and the bundled
    tokenizer.json if `tokenizer_json`."""

    def argv(tmp, dump, trained):
        (tmp / "tok").mkdir()
        if tokenizer_json:
            shutil.copy(ROOT / "assets/tokenizer/kjv_bpe_hf/tokenizer.json", tmp / "tok")
        (tmp / "tok" / "tokenizer_config.json").write_text(json.dumps(config))
        return ["--model.tokenizer_path", str(tmp / "tok")]

    return argv


def dump_elsewhere(make):
    """job.dump_folder replaced by what make(tmp) returns."""
    return lambda tmp, dump, trained: ["--job.dump_folder", str(make(tmp))]


def file_at(tmp: Path) -> Path:
    (tmp / "a_file").write_text("not a folder")
    return tmp / "a_file"


def checkpoint_folder_is_file(tmp, dump, trained):
    (dump / "ckpt_file").write_text("x")
    return [*CKPT, "--checkpoint.folder", "ckpt_file"]


def trained_run(*extra: str):
    """Resume from the trained run's own folder (which must not change)."""
    return lambda tmp, dump, trained: [*CKPT, "--job.dump_folder", str(trained), *extra]


def damaged(damage):
    def argv(tmp, dump, trained):
        damage(copy_checkpoint(trained, dump), tmp)
        return list(CKPT)

    return argv


def edit_a_size(path: Path) -> None:
    """A number changed in checksums.json, which stays valid JSON."""
    path.write_text(path.read_text().replace("[", "[1", 1))


def unverified(damage):
    """The damage done to a checkpoint without checksums (saved by an earlier version): what the
    loader's own defences catch."""

    def apply(step_dir: Path, tmp: Path) -> None:
        (step_dir / MANIFEST).unlink()
        damage(step_dir, tmp)

    return apply


def damaged_step_2(id: str, damage, name: str, problem: str, *extra: str) -> Case:
    """Steps 1 and 2 (a copy of 1), `damage` done to step 2's file `name`: the run stops with `problem`."""

    def argv(tmp, dump, trained):
        step_1 = copy_checkpoint(trained, dump)
        shutil.copytree(step_1, step_1.parent / "step-2")
        damage(step_1.parent / "step-2" / name)
        return [*CKPT, *extra]

    return Case(id, argv, f"checkpoint/step-2 is damaged: {problem}")


FALLBACK = "; resume from another one with --checkpoint.load_step (available steps: 1)"


def evil_metadata(step_dir: Path, tmp: Path) -> None:
    (step_dir / ".metadata").write_bytes(pickle.dumps(Evil(tmp / "pwned")))


def evil_item(step_dir: Path, tmp: Path) -> None:
    """A checkpoint whose optimizer state holds a pickled payload instead of a plain value (a parameter
    group's learning rate, a non-tensor item that every resume loads)."""
    state = read_checkpoint(str(step_dir))
    shutil.rmtree(step_dir)
    state["optimizer.param_groups.output.weight.lr"] = Evil(tmp / "pwned")
    dcp.save(state, checkpoint_id=str(step_dir), no_dist=True)


def old_loader_state(step_dir: Path, tmp: Path) -> None:
    """A checkpoint of the global-stream data loader: a position and a token buffer, no streams."""
    state = {k: v for k, v in read_checkpoint(str(step_dir)).items() if ".dataset_state." not in k}
    shutil.rmtree(step_dir)
    old = {"epoch": 0, "position": "3", "token_buffer": [1, 2, 3], "num_sequences": 8, "batch_size": 8}
    state.update({f"dataloader.dataset_state.{key}": value for key, value in old.items()})
    dcp.save(state, checkpoint_id=str(step_dir), no_dist=True)


def pretokenized(option: str, damage=None, texts: list[str] | None = None):
    """`option` pointing at a pre-tokenized folder of `texts` (default: the first 20 kjv chapters), damaged
    by damage(folder)."""

    def argv(tmp, dump, trained):
        with open(ROOT / "assets/corpus/kjv/train.jsonl") as f:
            chapters = [json.loads(line)["text"] for _, line in zip(range(20), f)]
        tokenizer = str(ROOT / "assets/tokenizer/kjv_bpe.tiktoken")
        pretokenize(iter([texts or chapters]), tokenizer, 2256, tmp / "tokens", 1, {"dataset": "kjv"})
        if damage is not None:
            damage(tmp / "tokens")
        return [option, str(tmp / "tokens")]

    return argv


def symlink_to(tmp: Path, target: Path) -> Path:
    (tmp / "link").symlink_to(target)
    return tmp / "link"


def same_folder_twice(other):
    """A mixture of the bundled corpus folder and `other(tmp)`, another spelling of it."""
    return lambda tmp, dump, trained: ["--training.mixture", f"{ROOT}/assets/corpus/kjv,{other(tmp)}"]


# What each kind of wrong path is made of, and the words of its error.
WRONG_PATHS = {
    "folder": (Path.mkdir, "is a folder, not a file"),
    "file": (lambda path: path.write_text("x"), "is a file, not a folder"),
    "dangling symlink": (lambda path: path.symlink_to(path.parent / "gone"), "is a symlink to {tmp}/gone"),
    "fifo": (os.mkfifo, "is a FIFO"),
    "not UTF-8": (lambda path: path.write_bytes("Genèse 1:1\n".encode("latin-1")), "is not UTF-8 text"),
}


def wrong_path(option: str, name: str, kind: str, *extra: str):
    def argv(tmp, dump, trained):
        WRONG_PATHS[kind][0](tmp / name)
        return [*extra, option, str(tmp / name)]

    return argv


def edit_manifest(**changes):
    def damage(folder: Path) -> None:
        manifest = json.loads((folder / "manifest.json").read_text())
        for key, value in changes.items():
            section, _, name = key.partition("__")
            (manifest[section] if name else manifest)[name or key] = value
        (folder / "manifest.json").write_text(json.dumps(manifest))

    return damage


PRETOKENIZED = [
    (
        "of another tokenizer",
        edit_manifest(tokenizer__sha256="0" * 64),
        "was tokenized with another tokenizer (sha256 000000000000, from",
    ),
    ("beyond the vocabulary", edit_manifest(tokenizer__vocab_size=70000), "beyond the model's vocabulary"),
    ("truncated", lambda folder: truncate(folder / "shard-00000.bin"), "the folder is damaged"),
    ("without manifest", lambda folder: (folder / "manifest.json").unlink(), "no manifest.json: run"),
    ("of another version", edit_manifest(version=2), "format version 2; this trainer reads version 1"),
]


def pretokenized_cases(option: str, wrap=lambda make: make) -> list:
    name = option.split(".")[0]
    return [
        *(
            Case(f"{name} pre-tokenized {what}", wrap(pretokenized(f"--{option}", damage)), message)
            for what, damage, message in PRETOKENIZED
        ),
        Case(
            f"{name} pre-tokenized too small",
            wrap(pretokenized(f"--{option}", texts=["In the beginning"] * 8)),
            "fewer than the 8 sequences of a global batch",
        ),
    ]


def path_cases(option: str, name: str, kinds: list[str], *extra: str) -> list["Case"]:
    """`option` given each kind of wrong path: one line naming the option and the path as given."""
    message = f"{option[2:]}: {{tmp}}/{name} "
    return [
        Case(f"{option} {k}", wrong_path(option, name, k, *extra), message + WRONG_PATHS[k][1]) for k in kinds
    ]


ON = ("--validation.enable", "true")


def hf_folder_config(content: bytes):
    """--checkpoint.initial_load_path at a Hugging Face folder holding this config.json."""

    def argv(tmp, dump, trained):
        (tmp / "hub").mkdir()
        (tmp / "hub" / "config.json").write_bytes(content)
        return ["--checkpoint.initial_load_path", str(tmp / "hub")]

    return argv


def hf_export_file(tmp, dump, trained):
    """checkpoint.last_save_in_hf with a file where the export goes."""
    (dump / "hf").write_text("a user's file\n")
    return [*CKPT, "--checkpoint.last_save_in_hf", "true"]


PATH_CASES = [
    *path_cases("--job.config_file", "job.toml", ["dangling symlink", "fifo"]),
    *path_cases("--model.tokenizer_path", "tok.model", ["dangling symlink", "fifo", "not UTF-8"]),
    *path_cases("--training.dataset_path", "data.txt", ["dangling symlink", "fifo", "not UTF-8"]),
    *path_cases(
        "--validation.dataset_path", "held out.jsonl", ["dangling symlink", "fifo", "not UTF-8"], *ON
    ),
    *path_cases("--job.dump_folder", "dump 2", ["file", "dangling symlink", "fifo"]),
    *path_cases("--checkpoint.initial_load_path", "step-1", ["file", "dangling symlink", "fifo"]),
]

CASES = [
    # The job file and the command line
    Case(
        "unknown section",
        toml("[trainig]\nsteps = 1\n"),
        "unknown TOML section [trainig]; did you mean 'training'?",
    ),
    Case(
        "unknown key",
        toml("[training]\nbatch_sise = 2\n"),
        "unknown option 'batch_sise' in [training]; did you mean",
    ),
    Case("wrong type", toml("[training]\nsteps = '10'\n"), "training.steps: expected int, got str '10'"),
    Case("float for int", toml("[training]\nseq_len = 64.5\n"), "training.seq_len: expected int"),
    Case("out of range", toml("[optimizer]\nlr = -1.0\n"), "optimizer.lr: -1.0 is below the minimum 0.0"),
    Case("not a choice", toml("[model]\nname = 'gpt2'\n"), "model.name: 'gpt2' is not one of llama2, llama3"),
    Case("unknown optimizer", toml("[optimizer]\nname = 'SGD'\n"), "optimizer.name: 'SGD' is not one of"),
    Case(
        "Muon momentum of 1",
        toml("[optimizer]\nname = 'Muon'\nmuon_momentum = 1.0\n"),
        "optimizer.muon_momentum: 1.0 does not forget old gradients; set it below 1",
    ),
    Case("no Newton-Schulz step", toml("[optimizer]\nmuon_ns_steps = 0\n"), "muon_ns_steps: 0 is below"),
    Case(
        "list item", toml("[checkpoint]\nexclude_from_loading = ['optimiser']\n"), "'optimiser' is not one of"
    ),
    Case("malformed toml", toml("[training\nsteps = 1\n"), "is not valid TOML"),
    Case("section not a table", toml("training = 3\n"), "[training] must be a table"),
    Case(
        "config file is a folder",
        empty_folder("--job.config_file"),
        "empty is a folder, not a file; give a TOML",
    ),
    Case(
        "config file not UTF-8",
        with_file("--job.config_file", "job.toml", b"[training]\nsteps = 3 # \xff\xfe\n"),
        "job.toml is not UTF-8 text",
    ),
    Case(
        "missing config file",
        args("--job.config_file", "/nonexistent/job.toml"),
        "job.config_file: no such file",
    ),
    Case("unknown override", args("--training.stepz", "3"), "unknown option --training.stepz; did you mean"),
    Case("override without value", args("--training.steps"), "expected one argument"),
    Case("override not a number", args("--training.steps=ten"), "--training.steps: expected int, got 'ten'"),
    Case("bool override", args("--training.deterministic", "maybe"), "expected true or false"),
    Case("stray argument", args("steps=3"), "unrecognized arguments: steps=3"),
    Case("seq_len zero", args("--training.seq_len", "0"), "--training.seq_len: 0 is below the minimum 1"),
    Case(
        "batch negative",
        args("--training.batch_size", "-2"),
        "--training.batch_size: -2 is below the minimum 1",
    ),
    Case("steps zero", args("--training.steps", "0"), "--training.steps: 0 is below the minimum 1"),
    # Files
    Case(
        "missing tokenizer", with_file("--model.tokenizer_path", "tok.model", None), "model.tokenizer_path:"
    ),
    Case(
        "empty tokenizer",
        with_file("--model.tokenizer_path", "tok.model", b""),
        "is empty; set model.tokenizer_path",
    ),
    Case("tokenizer is a folder", empty_folder("--model.tokenizer_path"), "model.tokenizer_path: "),
    Case(
        "malformed tokenizer",
        with_file("--model.tokenizer_path", "tok.model", b"not base64 at all\n"),
        "model.tokenizer_path: Malformed tokenizer file",
    ),
    Case(
        "tokenizer.json not JSON",
        with_file("--model.tokenizer_path", "tokenizer.json", b'{"model": '),
        "model.tokenizer_path: {tmp}/tokenizer.json is not a tokenizer.json: not JSON (",
    ),
    Case(
        "tokenizer.json not a tokenizer",
        with_file("--model.tokenizer_path", "tokenizer.json", b'{"model": {"type": "BPE"}}'),
        "model.tokenizer_path: {tmp}/tokenizer.json is not a tokenizer.json `tokenizers` can read (",
    ),
    Case(
        "tokenizer folder without tokenizer.json",
        hf_tokenizer_folder({"eos_token": "<|endoftext|>"}, tokenizer_json=False),
        "model.tokenizer_path: {tmp}/tok is a folder, not a file, and holds no tokenizer.json; set it to",
    ),
    Case(
        "tokenizer without EOS",
        hf_tokenizer_folder({"eos_token": None}),
        "model.tokenizer_path: {tmp}/tok/tokenizer.json has no EOS token",
    ),
    Case(
        "tokenizer.json larger than the model's vocabulary",
        args(
            "--model.tokenizer_path", str(ROOT / "assets/tokenizer/kjv_bpe_hf"), "--model.vocab_size", "2000"
        ),
        "model.vocab_size: 2000 is smaller than the tokenizer's 2003 tokens; use -1 or a larger value",
    ),
    Case(
        "missing dataset", with_file("--training.dataset_path", "data.jsonl", None), "training.dataset_path:"
    ),
    Case("empty dataset", with_file("--training.dataset_path", "data.txt", b""), "training.dataset_path: "),
    Case("empty dataset folder", empty_folder("--training.dataset_path"), "holds no files"),
    Case(
        "malformed dataset",
        with_file("--training.dataset_path", "data.jsonl", b'{"text": "ok"}\n{"text": broken\n'),
        "training.dataset_path: ",
    ),
    Case(
        "unknown dataset",
        args("--training.dataset", "wikipedia"),
        "training.dataset: Unknown dataset 'wikipedia'",
    ),
    Case(
        "mixture weight negative",
        args("--training.mixture", "kjv:-1"),
        "training.mixture: 'kjv:-1' has weight -1; weights must be >= 0",
    ),
    Case(
        "mixture weights all zero",
        args("--training.mixture", "kjv:0,kjv_validation:0"),
        "training.mixture: every weight is 0",
    ),
    Case(
        "mixture unknown source",
        args("--training.mixture", "kjv:1,wikipedia:1"),
        "training.mixture: unknown source wikipedia: not a dataset name (c4, kjv, kjv_chat, kjv_validation)",
    ),
    Case(
        "mixture weights overflow",
        args("--training.mixture", "kjv:1e308,kjv_validation:1e308"),
        "training.mixture: the weights add up to inf, more than a float holds; scale them down",
    ),
    Case(
        "mixture source through a symlink",
        same_folder_twice(lambda tmp: str(symlink_to(tmp, ROOT / "assets/corpus/kjv"))),
        "training.mixture: '{root}/assets/corpus/kjv' and '{tmp}/link' are the same data "
        "({root}/assets/corpus/kjv); give each source once",
    ),
    Case(
        "mixture source with a trailing slash",
        same_folder_twice(lambda tmp: f"{ROOT}/assets/corpus/kjv/"),
        "training.mixture: '{root}/assets/corpus/kjv' and '{root}/assets/corpus/kjv/' are the same data",
    ),
    Case(
        "mixture pre-tokenized source shorter than a window",
        pretokenized("--training.mixture", texts=["In the beginning"] * 8),
        "training.mixture: source '{tmp}/tokens' holds 48 tokens, fewer than one window of seq_len + 1 = 65: "
        "give it more data or leave it out",
    ),
    Case(
        "mixture text source smaller than a global batch",
        with_file("--training.mixture", "few.jsonl", b'{"text": "In the beginning"}\n' * 4),
        "training.mixture: Dataset '{tmp}/few.jsonl' has 4 documents, fewer than the 8 sequences",
    ),
    Case("unknown flavor", args("--model.flavor", "3B"), "model.flavor: llama3 has no flavor '3B'"),
    Case(
        "flavor of another family",
        args("--model.name", "qwen3", "--model.flavor", "70B"),
        "model.flavor: qwen3 has no flavor '70B'; choose one of debugmodel, debugmodel_tied, 0.6B, 1.7B",
    ),
    Case(
        "TP not dividing the kv heads",
        args("--model.name", "qwen3", "--parallelism.tensor_parallel_degree", "4"),
        "parallelism.tensor_parallel_degree: 4 does not divide the model's 4 attention heads and 2 kv heads",
        env={"WORLD_SIZE": "4"},
    ),
    Case(
        "TP not dividing Gated DeltaNet's heads",
        args("--model.name", "qwen3_5", "--parallelism.tensor_parallel_degree", "4"),
        "parallelism.tensor_parallel_degree: 4 does not divide the model's 4 attention heads, 2 kv heads, 2 "
        "linear-attention key heads and 4 value heads; choose a common divisor",
        env={"WORLD_SIZE": "4"},
    ),
    Case(
        "tied embeddings under PP",
        args(
            "--model.name",
            "qwen3",
            "--model.flavor",
            "debugmodel_tied",
            "--parallelism.pipeline_parallel_degree",
            "2",
        ),
        "parallelism.pipeline_parallel_degree: qwen3 debugmodel_tied ties its embeddings to the output "
        "layer, which the first and last pipeline stages cannot share; use pipeline_parallel_degree 1 or an "
        "untied flavor",
        env={"WORLD_SIZE": "2"},
    ),
    Case(
        "TP with a mixture of experts, without FSDP",
        args("--model.name", "qwen3_moe", "--parallelism.tensor_parallel_degree", "2"),
        "parallelism.tensor_parallel_degree: qwen3_moe's experts are not tensor-parallel: each tp rank "
        "routes its own tokens and FSDP sums their gradients, so TP needs data_parallel_shard_degree > 1 or "
        "context_parallel_degree > 1 with it",
        env={"WORLD_SIZE": "2"},
    ),
    Case(
        "MoE auxiliary loss under PP with replicas alone",
        args(
            "--model.name",
            "qwen3_moe",
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.data_parallel_replicate_degree",
            "2",
        ),
        "moe.aux_loss_weight: qwen3_moe's auxiliary loss under pipeline parallelism needs FSDP or no data "
        "parallelism, not replicas alone (DDP)",
        env={"WORLD_SIZE": "4"},
    ),
    Case(
        "MoE sequence-wise balance loss under PP with replicas alone",
        args(
            "--model.name",
            "deepseek_v3",
            "--moe.aux_loss_weight",
            "0",
            "--moe.sequence_aux_loss_weight",
            "0.0001",
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.data_parallel_replicate_degree",
            "2",
        ),
        "moe.sequence_aux_loss_weight: deepseek_v3's auxiliary loss under pipeline parallelism needs FSDP or "
        "no data parallelism, not replicas alone (DDP)",
        env={"WORLD_SIZE": "4"},
    ),
    Case(
        "MoE sequence-wise balance loss negative",
        args("--model.name", "deepseek_v3", "--moe.sequence_aux_loss_weight", "-0.0001"),
        "--moe.sequence_aux_loss_weight: -0.0001 is below the minimum 0.0",
    ),
    Case(
        "EP on a dense model",
        args("--parallelism.expert_parallel_degree", "2"),
        "parallelism.expert_parallel_degree: llama3 has no experts to split; use 1",
        env={"WORLD_SIZE": "2"},
    ),
    Case(
        "[moe] option on a dense model, command line",
        args("--moe.bias_update_rate", "0.001"),
        "moe.bias_update_rate: llama3 has no experts, so [moe] options do nothing for it; remove it, or "
        "use a mixture-of-experts model.name (qwen3_moe, qwen3_5_moe, deepseek_v3)",
    ),
    Case(
        "[moe] option on a dense model, recipe (its default value)",
        with_file(
            "--job.config_file", "dense.toml", b'[model]\nname = "qwen3"\n[moe]\naux_loss_weight = 0.001\n'
        ),
        "moe.aux_loss_weight: qwen3 has no experts, so [moe] options do nothing for it",
    ),
    Case(
        "an option given by its former name and its new one",
        args("--moe.aux_loss_coef", "0.01", "--moe.aux_loss_weight", "0.02"),
        "--moe.aux_loss_coef and --moe.aux_loss_weight both given on the command line: --moe.aux_loss_coef "
        "is --moe.aux_loss_weight's old name; keep only --moe.aux_loss_weight",
    ),
    Case(
        "MTP on a family without it",
        args("--model.mtp_layers", "1"),
        "model.mtp_layers: llama3 has no multi-token prediction; use 0, or a model.name that has it "
        "(deepseek_v3)",
    ),
    Case(
        "negative MTP depths",
        args("--model.name", "deepseek_v3", "--model.mtp_layers", "-1"),
        "model.mtp_layers: -1 is below the minimum 0",
    ),
    Case(
        "negative MTP loss weight",
        args("--model.name", "deepseek_v3", "--model.mtp_layers", "1", "--model.mtp_loss_weight", "-0.1"),
        "model.mtp_loss_weight: -0.1 is below the minimum 0.0",
    ),
    Case(
        "EP not dividing the experts",
        args("--model.name", "qwen3_moe", "--parallelism.expert_parallel_degree", "3"),
        "parallelism.expert_parallel_degree: 3 does not divide the 8 experts of qwen3_moe debugmodel",
        env={"WORLD_SIZE": "3"},
    ),
    Case(
        "EP not dividing the FSDP degree",
        args("--model.name", "qwen3_moe", "--parallelism.expert_parallel_degree", "2"),
        "parallelism.expert_parallel_degree: 2 does not divide data_parallel_shard_degree 3",
        env={"WORLD_SIZE": "3"},
    ),
    Case(
        "CP not splitting the sequence into 2 x CP chunks",
        args("--parallelism.context_parallel_degree", "2", "--training.seq_len", "66"),
        "training.seq_len: 66 is not divisible by 2 x context_parallel_degree = 4",
        env={"WORLD_SIZE": "2"},
    ),
    Case(
        "CP x TP not splitting a rank's tokens",
        args(
            "--parallelism.context_parallel_degree",
            "2",
            "--parallelism.tensor_parallel_degree",
            "4",
            "--training.seq_len",
            "68",
        ),
        "training.seq_len: 68 / context_parallel_degree 2 is not divisible by tensor_parallel_degree 4",
        env={"WORLD_SIZE": "8"},
    ),
    Case(
        "CP with TP on latent attention",
        args(
            "--model.name",
            "deepseek_v3",
            "--model.tokenizer_path",
            "assets/tokenizer/kjv_bpe_hf",
            "--parallelism.context_parallel_degree",
            "2",
            "--parallelism.tensor_parallel_degree",
            "2",
        ),
        "parallelism.context_parallel_degree: deepseek_v3's latent attention gathers its latents over the "
        "cp ranks, which tensor parallelism's sequence-parallel latents do not compose with yet",
        env={"WORLD_SIZE": "4"},
    ),
    # Validation data (checked before the first training step)
    Case(
        "missing validation dataset",
        validation(with_file("--validation.dataset_path", "held_out.jsonl", None)),
        "validation.dataset_path: ",
    ),
    Case(
        "empty validation dataset",
        validation(with_file("--validation.dataset_path", "held_out.jsonl", b"")),
        "validation.dataset_path: ",
    ),
    Case(
        "validation dataset without text",
        validation(with_file("--validation.dataset_path", "held_out.jsonl", b'{"content": "a"}\n' * 8)),
        "validation.dataset_path: Dataset 'kjv_validation' has no 'text' field (columns: content)",
    ),
    Case(
        "validation dataset too small",
        validation(
            with_file("--validation.dataset_path", "held_out.jsonl", b'{"text": "In the beginning"}\n' * 8)
        ),
        "validation.dataset_path: ",
    ),
    Case(
        "unknown validation dataset",
        validation(args("--validation.dataset", "wikipedia")),
        "validation.dataset: Unknown dataset 'wikipedia'",
    ),
    # Pre-tokenized data (scripts/pretokenize.py)
    *pretokenized_cases("training.dataset_path"),
    *pretokenized_cases("validation.dataset_path", validation),
    # Parallel degrees against the world size
    Case(
        "degrees vs world size",
        args("--parallelism.tensor_parallel_degree", "3"),
        "parallelism: the world size 2 is not divisible",
        env={"WORLD_SIZE": "2"},
    ),
    Case(
        "shard degree vs world size",
        args("--parallelism.data_parallel_shard_degree", "4"),
        "degrees multiply to 4 (data_parallel_replicate_degree 1 x data_parallel_shard_degree 4",
    ),
    # The dump folder
    Case("dump folder is a file", dump_elsewhere(file_at), "job.dump_folder: "),
    Case(
        "dump folder inside a file",
        dump_elsewhere(lambda tmp: file_at(tmp) / "run"),
        "is a file, not a folder",
    ),
    Case(
        "dump folder not writable",
        dump_elsewhere(lambda tmp: Path("/proc/titan-run")),
        "job.dump_folder: cannot write in /proc/titan-run (its parent /proc is not writable)",
    ),
    Case("checkpoint folder is a file", checkpoint_folder_is_file, "checkpoint.folder: "),
    # Checkpoints
    Case("load_step missing", trained_run("--checkpoint.load_step", "7"), "available steps: 1"),
    Case(
        "initial_load_path not a checkpoint",
        args("--checkpoint.initial_load_path", "/tmp"),
        "initial_load_path",
    ),
    Case(
        "checkpoint of another model",
        trained_run("--model.vocab_size", "4096"),
        "tok_embeddings.weight with shape",
    ),
    Case(
        "checkpoint of another model of the same shapes",
        trained_run("--model.name", "llama2"),
        "/checkpoint/step-1 holds a llama3 debugmodel model, not this job's llama2 debugmodel; set "
        "--model.name llama3 --model.flavor debugmodel, or load a checkpoint of this model",
    ),
    Case(
        "checkpoint of another tokenizer",
        trained_run("--model.tokenizer_path", str(ROOT / "assets" / "tokenizer" / "kjv_bpe_hf")),
        "was trained with another tokenizer than",
    ),
    Case(
        "checkpoint of another global batch size",
        trained_run("--training.batch_size", "4"),
        "data streams depend on the global batch size; keep the saved global batch size, or start the data "
        "afresh with --checkpoint.exclude_from_loading dataloader",
    ),
    Case(
        "checkpoint of the old data loader",
        damaged(old_loader_state),
        "has no dataloader.dataset_state.global_batch_8.stream_0: its data loader state was saved for "
        "another global batch size or by an older data loader",
    ),
    Case(
        "truncated metadata",
        damaged(unverified(lambda d, tmp: truncate(d / ".metadata"))),
        "is damaged or not a DCP",
    ),
    Case(
        "truncated data",
        damaged(unverified(lambda d, tmp: truncate(d / "__0_0.distcp"))),
        "checkpoint: cannot load",
    ),
    Case(
        "code in metadata",
        damaged(unverified(evil_metadata)),
        "posix.system has no place in a checkpoint's metadata",
    ),
    # Checkpoints whose files differ from their checksums.json
    damaged_step_2(
        "bit flipped in metadata",
        flip_bit,
        ".metadata",
        ".metadata does not match its CRC32 checksum" + FALLBACK,
    ),
    damaged_step_2("metadata cut short", truncate, ".metadata", ".metadata has "),
    damaged_step_2(
        "bit flipped in a shard", flip_bit, "__0_0.distcp", "__0_0.distcp does not match its CRC32"
    ),
    damaged_step_2("shard cut short", truncate, "__0_0.distcp", "__0_0.distcp has "),
    damaged_step_2("shard missing", Path.unlink, "__0_0.distcp", "__0_0.distcp is missing" + FALLBACK),
    damaged_step_2(
        "size changed in the checksums", edit_a_size, MANIFEST, f"{MANIFEST} does not match its own checksum"
    ),
    damaged_step_2("checksums cut short", truncate, MANIFEST, f"{MANIFEST} is unreadable (JSONDecodeError)"),
    # The middle byte is a digit (another digit: "does not match its own checksum") or JSON's syntax ("is
    # unreadable"), as the sizes and CRCs of the run's files fall: either names the manifest.
    damaged_step_2("bit flipped in the checksums", flip_bit, MANIFEST, f"{MANIFEST} "),
    damaged_step_2("load_step damaged", flip_bit, "__0_0.distcp", "__0_0", "--checkpoint.load_step", "2"),
    Case(
        "only checkpoint damaged",
        damaged(lambda d, tmp: flip_bit(d / "__0_0.distcp")),
        "step-1 is damaged: __0_0.distcp does not match its CRC32 checksum; there is no other checkpoint "
        "to resume from: move it away to start afresh",
    ),
    Case("code in a saved item", damaged(evil_item), "is not plain data and is not loaded"),
    # Hugging Face folders and exports: refused before training, in the option's words
    Case(
        "HF config.json hand-edited",
        hf_folder_config(b'{"model_type": "llama",}'),
        "config.json is not valid JSON",
    ),
    Case(
        "HF export of a routing bias",
        args(
            *CKPT,
            "--checkpoint.last_save_in_hf",
            "true",
            "--model.name",
            "qwen3_moe",
            "--moe.bias_update_rate",
            "0.001",
        ),
        "checkpoint.last_save_in_hf: moe.bias_update_rate = 0.001 trains routing biases",
    ),
    Case(
        "HF export folder a file",
        hf_export_file,
        "checkpoint.last_save_in_hf: exports into {tmp}/dump/hf, which is not a folder",
    ),
    *PATH_CASES,
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_and_changes_nothing(case, trained, tmp_path, capsys, monkeypatch):
    """Refused before step 1, in one line; the dump folder is as it was: no file is added (`dump` holds no
    metrics.jsonl that opening could hide in) and none is changed (`trained` holds a run's)."""
    dump = tmp_path / "dump"
    dump.mkdir()
    (dump / "notes.txt").write_text("kept\n")
    extra = case.argv(tmp_path, dump, trained)
    for key, value in (case.env or {}).items():
        monkeypatch.setenv(key, value)
    watched = [dump, trained]
    before = [folder_hashes(folder) for folder in watched]
    code = run_train_in_process(*TINY_JOB, "--job.dump_folder", str(dump), *extra)
    err = capsys.readouterr().err
    assert code == 2, err
    # Ours is the last line; a library may have printed a progress bar or warning before it.
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and err.endswith(errors[0] + "\n"), err
    assert case.message.replace("{tmp}", str(tmp_path)).replace("{root}", str(ROOT)) in errors[0], err
    assert "Traceback" not in err
    assert [folder_hashes(folder) for folder in watched] == before
    assert not (tmp_path / "pwned").exists(), "code from a checkpoint was run"


@pytest.mark.parametrize("script", ["evaluate", "generate"])
def test_scripts_refuse_a_checkpoint_of_another_model(script, trained, capsys):
    """llama2's and llama3's debug models have the same shapes: only the checkpoint's record tells
    them apart (evaluate.py gave another loss, silently)."""
    main = runpy.run_path(str(ROOT / "scripts" / f"{script}.py"))["main"]
    code = main([*TINY_JOB, *CKPT, "--job.dump_folder", str(trained), "--model.name", "llama2"])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 2
    assert errors == [
        f"error: model.name: {trained}/checkpoint/step-1 holds a llama3 debugmodel model, not this job's "
        "llama2 debugmodel; set --model.name llama3 --model.flavor debugmodel, or load a checkpoint of "
        "this model"
    ]


def test_plain_dcp_would_run_code_from_a_checkpoint(tmp_path):
    """Why SafeReader and SafeLoadPlanner exist: torch 2.13's DCP unpickles non-tensor items with
    weights_only=False. (If a later torch stops doing so, this test tells us.)"""
    dcp.save({"item": Evil(tmp_path / "ran")}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    with pytest.raises(dcp.CheckpointException, match="not plain data"):  # DCP wraps our ConfigError
        dcp.load({"item": None}, storage_reader=SafeReader(str(tmp_path / "ckpt")), planner=SafeLoadPlanner())
    assert not (tmp_path / "ran").exists()
    dcp.load({"item": None}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    assert (tmp_path / "ran").exists()


def test_project_state_loads_as_plain_data(trained):
    """Every non-tensor item of a real checkpoint passes weights_only=True."""
    state = read_checkpoint(str(trained / "checkpoint" / "step-1"))
    plain = {key: value for key, value in state.items() if not isinstance(value, torch.Tensor)}
    assert isinstance(plain["optimizer.param_groups.output.weight.lr"], float)
    streams = {key: value for key, value in state.items() if key.startswith("dataloader.dataset_state.")}
    assert len(streams) == 8 and all(v.dtype == torch.int64 and v.shape == (4,) for v in streams.values())
    assert any(key.startswith("optimizer.param_groups.") for key in plain)


def test_preflight_imports_no_torch():
    modules = "torchtitan.reliability.preflight, torchtitan.reliability.launcher"
    code = f"import sys, {modules}; sys.exit('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT)
    assert result.returncode == 0


def run_script(tmp_path, *extra, env=None, timeout=300):
    environment = {**os.environ, "NGPU": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    cmd = [
        str(ROOT / "run_llama_train.sh"),
        *TINY_JOB[2:],
        "--job.dump_folder",
        str(tmp_path / "dump"),
        *extra,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, env=environment, cwd=ROOT, timeout=timeout)


@pytest.mark.parametrize(
    "extra, env, message",
    [
        (["--training.batch_sise", "2"], None, "error: unknown option --training.batch_sise; did you mean"),
        (
            ["--parallelism.tensor_parallel_degree", "3"],
            {"NGPU": "2"},
            "error: parallelism: the world size 2",
        ),
        ([], {"NGPU": "two"}, "error: NGPU: expected a number of processes, got 'two'"),
        ([], {"CONFIG_FILE": "/nonexistent.toml"}, "error: job.config_file: no such file"),
        (["--model.flavor", "3B"], None, "error: model.flavor: llama3 has no flavor '3B'; choose one of"),
    ],
    ids=["unknown option", "degrees vs NGPU", "NGPU not a number", "missing recipe", "unknown flavor"],
)
def test_launch_script_preflight(tmp_path, extra, env, message):
    start = time.perf_counter()
    result = run_script(tmp_path, *extra, env=env)
    assert result.returncode == 2
    assert result.stderr.strip() == result.stderr.strip().splitlines()[0], result.stderr
    assert message in result.stderr
    assert time.perf_counter() - start < 10  # no torch import, no worker
    assert not (tmp_path / "dump").exists()


def test_launch_script_refused_validation_set_leaves_the_dump_folder_as_it_was(tmp_path):
    """Validation data smaller than one batch is refused before anything is written: a fresh dump folder
    is not made (the lock's folder is removed again), an existing one keeps its listing (no empty
    metrics.jsonl)."""
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text('{"text": "In the beginning"}\n' * 8)
    small = ["--validation.enable", "true", "--validation.dataset_path", str(held_out)]
    message = "[rank0]:error: validation.dataset_path: "
    dump = tmp_path / "dump"
    for before in [None, ["notes.txt"]]:
        if before is not None:
            dump.mkdir()
            (dump / "notes.txt").write_text("kept\n")
        result = run_script(tmp_path, *small)
        out = result.stdout + result.stderr
        assert result.returncode == 2, out
        errors = [line for line in out.splitlines() if "error:" in line]
        assert len(errors) == 1 and errors[0].startswith(message), out
        if before is None:
            assert not dump.exists()
        else:
            assert sorted(p.name for p in dump.iterdir()) == before
