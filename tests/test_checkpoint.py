"""CheckpointManager in one process: retention, load_step, incomplete checkpoints, async save, partial
loading, initial weights, export dtype, shape checks and RNG state."""

import os
import shutil
import warnings
from dataclasses import fields, replace

import pytest
import torch
import torch.distributed.checkpoint as dcp

from torchtitan.checkpoint.load import check_model_record
from torchtitan.checkpoint.manager import CheckpointManager
from torchtitan.checkpoint.safe_reader import saved_entries
from torchtitan.checkpoint.state import TrainState
from torchtitan.config.options import CheckpointConfig, ConfigError, JobConfig
from torchtitan.models.llama import ModelArgs
from torchtitan.models.llama.model import Transformer
from torchtitan.optimizers import build_lr_scheduler, build_optimizer

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


class Position:
    """A stand-in for the data loader's state."""

    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state_dict: dict) -> None:
        self.value = state_dict["value"]


class Run:
    """A tiny model with its optimizer, schedule, data position and checkpoint manager."""

    def __init__(self, dump_folder, dim: int = 16, vocab_size: int = 32, seed: int = 0, **checkpoint):
        cfg = JobConfig()
        cfg.job.dump_folder = str(dump_folder)
        cfg.checkpoint.enable_checkpoint = True
        for key, value in checkpoint.items():
            setattr(cfg.checkpoint, key, value)
        args = ModelArgs(dim=dim, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=vocab_size, multiple_of=16)
        self.model = Transformer(args)
        self.model.init_weights(seed=seed)
        self.optimizer = build_optimizer(self.model, cfg.optimizer)
        self.scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, 100)
        self.position, self.train_state = Position(), TrainState()
        self.checkpoint = CheckpointManager(
            self.model, self.optimizer, self.scheduler, self.position, self.train_state, cfg
        )

    def train(self, steps: int, last: int | None = None) -> None:
        for _ in range(steps):
            self.train_state.step += 1
            self.position.value += 2
            tokens = torch.randint(0, self.model.model_args.vocab_size, (2, 8))
            self.model(tokens).square().mean().backward()
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad()
            self.checkpoint.maybe_save(self.train_state.step, self.train_state.step == last)

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


def folder_names(tmp_path) -> list[str]:
    return sorted(os.listdir(tmp_path / "checkpoint"))


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_loadable_parts_are_the_options_choices(tmp_path):
    choices = {f.name: f.metadata["choices"] for f in fields(CheckpointConfig)}["exclude_from_loading"]
    assert set(Run(tmp_path).checkpoint.states) == set(choices)


@pytest.mark.parametrize("keep", [1, 2])
def test_keep_latest_k_deletes_older_checkpoints(tmp_path, keep):
    run = Run(tmp_path, interval=1, keep_latest_k=keep)
    run.train(5)
    run.checkpoint.close()
    assert folder_names(tmp_path) == [f"step-{s}" for s in range(6 - keep, 6)]


def test_keep_all_by_default(tmp_path):
    run = Run(tmp_path, interval=2)
    run.train(5, last=5)
    assert folder_names(tmp_path) == ["step-2", "step-4", "step-5"]


def test_load_step_picks_a_checkpoint_and_names_the_available_ones(tmp_path):
    run = Run(tmp_path, interval=2)
    run.train(2)
    at_2 = run.weights()
    run.train(2)
    resumed = Run(tmp_path, load_step=2)
    assert resumed.checkpoint.load() == 2
    assert resumed.train_state.step == 2 and resumed.position.value == 4
    assert_same(resumed.weights(), at_2)
    with pytest.raises(ConfigError, match=r"^checkpoint.load_step: .* step-3 .*; available steps: 2, 4$"):
        Run(tmp_path, load_step=3).checkpoint.load()


def test_incomplete_checkpoints_are_ignored_and_leftovers_removed(tmp_path):
    run = Run(tmp_path, interval=2)
    run.train(2)
    at_2 = run.weights()
    ckpt = tmp_path / "checkpoint"
    shutil.copytree(ckpt / "step-2", ckpt / "step-4.tmp")  # a save cut short before its rename
    shutil.copytree(ckpt / "step-2", ckpt / "step-6")  # a copy without its metadata
    (ckpt / "step-6" / ".metadata").unlink()
    (ckpt / "step-8.purging").mkdir()  # a deletion cut short
    (ckpt / "step-10.tmp").mkdir()
    resumed = Run(tmp_path)
    assert resumed.checkpoint.load() == 2
    assert_same(resumed.weights(), at_2)
    assert folder_names(tmp_path) == ["step-2", "step-6"]


def test_saving_a_step_again_replaces_it(tmp_path):
    """After rewinding with load_step, the run saves steps it had saved before."""
    run = Run(tmp_path, interval=2)
    run.train(4)
    rewound = Run(tmp_path, interval=2, load_step=2)
    rewound.checkpoint.load()
    torch.manual_seed(1)  # other data than the first time
    rewound.train(2)
    assert folder_names(tmp_path) == ["step-2", "step-4"]
    again = Run(tmp_path)
    assert again.checkpoint.load() == 4
    assert_same(again.weights(), rewound.weights())
    assert not torch.equal(again.weights()["output.weight"], run.weights()["output.weight"])


def test_async_save_writes_the_state_of_its_step(tmp_path):
    """Training goes on while the save is written; the checkpoint holds the state of the step it was
    taken at, and appears as step-N only once complete."""
    run = Run(tmp_path, interval=3, async_mode="async")
    run.train(3)
    at_3 = run.weights()
    run.train(1)  # changes the parameters while (or after) step 3 is written
    run.checkpoint.close()
    assert folder_names(tmp_path) == ["step-3"]
    resumed = Run(tmp_path, async_mode="async")
    assert resumed.checkpoint.load() == 3
    assert_same(resumed.weights(), at_3)
    assert resumed.position.value == 6


def test_pinned_memory_falls_back_to_plain_async_without_cuda(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("CPU-only behaviour")
    run = Run(tmp_path, interval=1, async_mode="async_with_pinned_mem")
    run.train(2)
    run.checkpoint.close()
    assert folder_names(tmp_path) == ["step-1", "step-2"]


def test_exclude_from_loading(tmp_path):
    run = Run(tmp_path, interval=2)
    run.train(2)
    resumed = Run(tmp_path, exclude_from_loading=["optimizer", "dataloader"])
    assert resumed.checkpoint.load() == 2
    assert_same(resumed.weights(), run.weights())
    assert resumed.optimizer.state_dict()["state"] == {}
    assert resumed.position.value == 0 and resumed.train_state.step == 2


def test_initial_load_path_starts_a_new_run_from_model_weights(tmp_path):
    pretrained = Run(tmp_path / "pretrain", interval=2)
    pretrained.train(2)
    path = str(tmp_path / "pretrain" / "checkpoint" / "step-2")
    finetune = Run(tmp_path / "finetune", seed=1, initial_load_path=path)
    assert finetune.checkpoint.load() is None
    assert_same(finetune.weights(), pretrained.weights())
    assert finetune.train_state.step == 0 and finetune.position.value == 0
    assert finetune.optimizer.state_dict()["state"] == {}

    finetune.checkpoint.checkpoint_config.interval = 1
    finetune.train(1)
    own = finetune.weights()
    restarted = Run(tmp_path / "finetune", seed=1, initial_load_path=path)
    assert restarted.checkpoint.load() == 1  # its own checkpoint wins
    assert_same(restarted.weights(), own)

    with pytest.raises(ConfigError, match=r"^checkpoint.initial_load_path: .* is not a DCP checkpoint"):
        Run(tmp_path / "other", initial_load_path=str(tmp_path / "nowhere")).checkpoint.load()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_model_weights_only_export_at_last_step(tmp_path, dtype):
    run = Run(tmp_path, interval=2, model_weights_only=True, export_dtype=dtype)
    run.train(3, last=3)
    saved = saved_entries(str(tmp_path / "checkpoint" / "step-3"))
    assert {key.split(".")[0] for key in saved} == {"model", "model_record"}  # the weights and what they are
    weights = [entry for key, entry in saved.items() if key.startswith("model.")]
    assert {entry.properties.dtype for entry in weights} == {getattr(torch, dtype)}
    assert "train_state.step" in saved_entries(str(tmp_path / "checkpoint" / "step-2"))

    resumed = Run(tmp_path)
    assert resumed.checkpoint.load() == 2  # an export cannot continue training
    with pytest.raises(ConfigError, match="step-3 has no optimizer, lr_scheduler, dataloader, train_state"):
        Run(tmp_path, load_step=3).checkpoint.load()

    served = Run(tmp_path / "serve", seed=1, initial_load_path=str(tmp_path / "checkpoint" / "step-3"))
    served.checkpoint.load()
    for key, value in run.weights().items():
        assert torch.equal(served.weights()[key], value.to(getattr(torch, dtype)).float()), key


def test_checkpoint_of_another_flavor_is_refused(tmp_path):
    """llama3's 8B and 3.1_8B have the same shapes (3.1_8B scales RoPE): the record tells them apart."""
    Run(tmp_path, interval=1).train(1)
    model = replace(JobConfig().model, flavor="3.1_8B")
    with pytest.raises(
        ConfigError, match="^model.flavor: .*step-1 holds a llama3 debugmodel model, not this"
    ):
        check_model_record(str(tmp_path / "checkpoint" / "step-1"), model)


def test_checkpoint_without_a_model_record_loads(tmp_path):
    """Saved by an earlier version or converted from Hugging Face: the model it holds is unknown, and
    loaded (its shapes are still checked)."""
    run = Run(tmp_path)
    dcp.save({"model": run.weights()}, checkpoint_id=str(tmp_path / "old"), no_dist=True)
    served = Run(tmp_path / "serve", seed=1, initial_load_path=str(tmp_path / "old"))
    served.checkpoint.load()
    assert_same(served.weights(), run.weights())


@pytest.mark.parametrize(
    "other, message",
    [
        (
            {"dim": 32},
            r"holds tok_embeddings.weight with shape \(32, 16\) but the model's is \(32, 32\); "
            "was it saved with another model.flavor, model.n_layers or tokenizer\\?$",
        ),
        ({"vocab_size": 40}, r"tok_embeddings.weight with shape \(32, 16\) but the model's is \(40, 16\);"),
    ],
)
def test_shape_mismatch_is_one_line_naming_the_parameter(tmp_path, other, message):
    Run(tmp_path, interval=1).train(1)
    with pytest.raises(ConfigError, match=message) as error:
        Run(tmp_path, **other).checkpoint.load()
    assert "\n" not in str(error.value)


def test_rng_state_is_restored(tmp_path):
    run = Run(tmp_path, interval=1)
    run.train(1)
    after_save = torch.rand(4)
    resumed = Run(tmp_path)
    torch.manual_seed(123)
    resumed.checkpoint.load()
    assert torch.equal(torch.rand(4), after_save)


def test_tools_read_a_checkpoint_without_warnings(tmp_path, capsys):
    """The converters, generate.py and evaluate.py read checkpoints in one process on purpose: DCP's
    warning that it assumes so is noise on their output; local data loads print no progress bars."""
    from torchtitan.checkpoint.safe_reader import read_checkpoint
    from torchtitan.datasets.sources import load_text_dataset

    dcp.save({"model": {"w": torch.arange(3.0)}}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    (tmp_path / "docs.jsonl").write_text('{"text": "In the beginning"}\n')  # a new file: generated anew
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch.equal(read_checkpoint(str(tmp_path / "ckpt"), "model.")["model.w"], torch.arange(3.0))
        load_text_dataset("docs", str(tmp_path / "docs.jsonl"))
    assert [str(w.message) for w in caught] == []
    assert "Generating" not in capsys.readouterr().err
