"""Training on chat data (train.py with [chat]): step 1's loss from a Hugging Face Qwen3 folder is
transformers' on the same packed batch (labels -100 where nothing is trained, positions restarting per
conversation), with the chunked loss too, and so is the validation loss of that batch; FSDP 2, gradient
accumulation and PP 2 train the losses of one process (the loss is the mean over the global batch's
trained tokens), and PP 2 killed with SIGKILL once a checkpoint is saved resumes bit for bit (the chat
streams' positions are in it); pre-tokenized chat shards train the streamed losses; mixtures of chat
sources; bad chat input is one line and exit 2 before any step. TP 2, CP 2 and their compositions, validated:
scripts/parity_matrix.py --only Chat."""

import json
import re
import runpy
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from launch import ROOT, TINY_JOB, losses, read_metrics, run_train, run_train_in_process, validation_losses
from test_hf_load import hub_folder

from scripts import chaos, show_data
from scripts.parity_layouts import pp
from torchtitan.checkpoint.safe_reader import read_checkpoint
from torchtitan.config.parser import parse_args
from torchtitan.datasets.build import build_training_data_loader
from torchtitan.datasets.chat_data import ChatStreams, chat_encoder, load_chat_dataset
from torchtitan.datasets.hf_tokenizer import HFTokenizer
from torchtitan.datasets.layout import IGNORE_INDEX, BatchLayout
from torchtitan.datasets.mixture import row_choices
from torchtitan.models.qwen3 import qwen3_configs

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("hf_cache")

HF_TOKENIZER = ROOT / "assets" / "tokenizer" / "kjv_bpe_hf"
CHAT = [
    *TINY_JOB,
    *("--model.name", "qwen3", "--model.flavor", "debugmodel", "--model.attn_mask_type", "block_causal"),
    *("--model.tokenizer_path", str(HF_TOKENIZER), "--chat.enable", "true"),
    *("--training.dataset", "kjv_chat", "--training.seq_len", "128", "--training.steps", "4"),
]


def test_first_loss_is_transformers(tmp_path, monkeypatch):
    tiny = {"dim": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "head_dim": 16, "hidden_dim": 64}
    monkeypatch.setitem(qwen3_configs, "tiny", replace(qwen3_configs["debugmodel"], **tiny))
    hub = hub_folder(tmp_path, "qwen3", **tiny)
    argv = [*CHAT, "--model.flavor", "tiny", "--checkpoint.initial_load_path", str(hub)]
    argv += ["--training.steps", "1", "--optimizer.lr", "0", "--training.seq_len", "256"]
    job = parse_args(argv)
    batch_size = job.training.batch_size
    loader = build_training_data_loader(
        job.training, HFTokenizer(HF_TOKENIZER), BatchLayout(batch_size), 2256, False, job.chat
    )
    batch = next(iter(loader))
    inputs, labels, positions = batch.parts()
    assert (positions == 0).sum() > 2 * batch_size  # several conversations a row: the packing is tested
    assert labels[:, -1].eq(IGNORE_INDEX).all()  # so transformers' labels, shifted by one, are ours
    hf_labels = torch.cat([torch.full((batch_size, 1), IGNORE_INDEX), labels[:, :-1]], dim=1)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(hub, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf_model(input_ids=inputs, position_ids=positions, labels=hf_labels, use_cache=False).loss
        unpacked = hf_model(input_ids=inputs, labels=hf_labels, use_cache=False).loss
    assert abs(unpacked - expected) > 1e-3  # the later conversations of a row are trained on too
    # Validated after the step (at learning rate 0: the same weights) on the same conversations: the
    # validation loss is the same mean over the batch's trained tokens.
    same_batch = ["--validation.enable", "true", "--validation.steps", "1"]
    same_batch += ["--validation.dataset_path", str(ROOT / "assets" / "corpus" / "kjv_chat" / "train.jsonl")]
    for name, extra in {"plain": same_batch, "chunked": ["--training.loss_chunk_tokens", "48"]}.items():
        assert run_train_in_process(*argv, *extra, "--job.dump_folder", str(tmp_path / name)) == 0
        assert abs(losses(tmp_path / name)[1] - expected.item()) <= 1e-5, (name, losses(tmp_path / name))
    assert abs(validation_losses(tmp_path / "plain")[1] - expected.item()) <= 1e-5
    assert read_metrics(tmp_path / "plain")[0]["trained_tokens"] == int((labels != IGNORE_INDEX).sum())


def test_layouts_train_the_losses_of_one_process_and_resume_after_sigkill(tmp_path):
    assert run_train_in_process(*CHAT, "--job.dump_folder", str(tmp_path / "one")) == 0
    one = losses(tmp_path / "one")
    batch = str(parse_args(CHAT).training.batch_size // 2)
    accumulated = [*CHAT, "--training.global_batch_size", str(parse_args(CHAT).training.batch_size)]
    assert (
        run_train_in_process(
            *accumulated, "--training.batch_size", batch, "--job.dump_folder", str(tmp_path / "acc")
        )
        == 0
    )
    result = run_train(2, tmp_path / "fsdp", *CHAT[len(TINY_JOB) :], "--training.batch_size", batch)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # PP 2 (each schedule micro-batch's loss divided by the whole step's count), saving every 2 steps.
    pipelined = [*pp(2), "--training.batch_size", str(parse_args(CHAT).training.batch_size)]
    pipelined += ["--checkpoint.enable_checkpoint", "true", "--checkpoint.interval", "2"]
    result = run_train(2, tmp_path / "pp", *CHAT[len(TINY_JOB) :], *pipelined)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for other in ("acc", "fsdp", "pp"):
        got = losses(tmp_path / other)
        assert got.keys() == one.keys() == {1, 2, 3, 4}
        assert all(abs(got[s] - one[s]) <= 1e-5 for s in one), (other, got, one)

    # Killed once step 2 is saved, relaunched: every step either launch logged is PP 2's, bit for bit.
    killed, straight = tmp_path / "killed", losses(tmp_path / "pp")
    chaos.kill_once_saved(chaos.Job(2, killed, *chaos.JOB, *CHAT, *pipelined), killed, 2)
    relaunch = chaos.run_to_end(2, killed, *CHAT, *pipelined)
    assert "Resumed from step 2" in relaunch.output(0)
    logged = chaos.losses(killed)
    assert {step for step, _ in logged} == {1, 2, 3, 4}
    assert all(loss == straight[step] for step, loss in logged), (logged, straight)
    # The last checkpoint too: weights, optimizer and the chat streams' positions (epoch, conversation,
    # windows taken per stream).
    got, want = (read_checkpoint(str(run / "checkpoint" / "step-4")) for run in (killed, tmp_path / "pp"))
    assert got.keys() == want.keys() and any("chat_global_batch" in key for key in want), sorted(want)
    for key, value in want.items():
        assert torch.equal(got[key], value) if isinstance(value, torch.Tensor) else got[key] == value, key


def tokenizer_without_template(folder: Path) -> Path:
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((HF_TOKENIZER / name).read_bytes())
    return folder


def chats(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_bad_chat_input_is_one_line(tmp_path, capsys):
    plain = str(tokenizer_without_template(tmp_path / "tok"))
    (tmp_path / "raises.jinja").write_text("{{ raise_exception('roles must alternate') }}")
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}")
    good = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}]
    cases = {
        "chat.template_path: the chat template .* does not render a conversation: roles must alternate": [
            *("--model.tokenizer_path", plain, "--chat.template_path", str(tmp_path / "raises.jinja"))
        ],
        "chat.template_path: the chat template .* does not compile": [
            *("--model.tokenizer_path", plain, "--chat.template_path", str(tmp_path / "broken.jinja"))
        ],
        "chat.template_path: the tokenizer has no chat template": ["--model.tokenizer_path", plain],
        "training.dataset_path: .*unknown role 'robot'": [
            "--training.dataset_path",
            chats(tmp_path / "robot.jsonl", [{"messages": [{"role": "robot", "content": "beep"}]}]),
        ],
        r"training.dataset_path: chat.format auto: the columns \['text'\] are none of": [
            "--training.dataset_path",
            chats(tmp_path / "text.jsonl", [{"text": "plain"}]),
        ],
        "chat.enable: conversations are packed as documents; set model.attn_mask_type = block_causal": [
            "--model.attn_mask_type",
            "causal",
            "--training.dataset_path",
            chats(tmp_path / "ok.jsonl", good),
        ],
        # Every cause of nothing to train, named before step 1 (the file named, not the default dataset).
        f"training.dataset_path: Dataset '{tmp_path / 'ok.jsonl'}' has 1 documents, fewer than the 8 "
        "sequences of a global batch": ["--training.dataset_path", str(tmp_path / "ok.jsonl")],
        "training.dataset_path: no conversation dealt to row 0 of the global batch has a token to train on: "
        "1 skipped .no assistant turn.: chat.loss_on assistant trains assistant turns; check the roles, or "
        "set chat.loss_on all": [
            *("--training.batch_size", "1", "--training.dataset_path"),
            chats(tmp_path / "asks.jsonl", [{"messages": [{"role": "user", "content": "Hi"}]}]),
        ],
        "training.dataset_path: no conversation dealt to row 0 .* 1 dropped as longer than training.seq_len "
        "8 under chat.overflow drop; set chat.overflow truncate or raise training.seq_len": [
            *("--training.batch_size", "1", "--training.seq_len", "8", "--chat.overflow", "drop"),
            *("--training.dataset_path", str(tmp_path / "ok.jsonl")),
        ],
        "1 dropped as longer than training.seq_len 8 under chat.overflow truncate .not even their first "
        "assistant turn fits.; raise training.seq_len": [
            *("--training.batch_size", "1", "--training.seq_len", "8"),
            *("--training.dataset_path", str(tmp_path / "ok.jsonl")),
        ],
        "training.dataset_path: no conversation dealt to row 0 .* 1 refused .the prompt before an assistant "
        "turn is not a token prefix of the turn's render.: the chat template .*last_only.jinja renders the "
        "prompt before an assistant turn differently .* add \\{% generation %\\} tags": [
            *("--model.tokenizer_path", plain, "--chat.template_path", str(tmp_path / "last_only.jinja")),
            *("--training.batch_size", "1", "--training.dataset_path", str(tmp_path / "ok.jsonl")),
        ],
        f"training.dataset_path: {tmp_path / 'broken.jsonl'} line 3: not valid JSON": [
            "--training.dataset_path",
            str(tmp_path / "broken.jsonl"),
        ],
        f"training.mixture: source {tmp_path / 'asks.jsonl'}: no conversation dealt .*no assistant turn": [
            *("--training.batch_size", "1", "--training.mixture"),
            f"{tmp_path / 'ok.jsonl'}:1,{tmp_path / 'asks.jsonl'}:1",
        ],
    }
    (tmp_path / "broken.jsonl").write_text(json.dumps(good[0]) + "\n\n{oops\n")
    # A template that shows the history only with a generation prompt: no render up to a turn starts
    # with the render of its prompt.
    (tmp_path / "last_only.jinja").write_text(
        "{% for m in messages %}{% if loop.last or add_generation_prompt %}"
        "{{ m['role'] + ': ' + m['content'] + '<|im_end|>' }}{% endif %}{% endfor %}"
    )
    for i, (message, args) in enumerate(cases.items()):
        capsys.readouterr()
        assert run_train_in_process(*CHAT, *args, "--job.dump_folder", str(tmp_path / f"run{i}")) == 2, (
            message
        )
        err = capsys.readouterr().err
        line = err.split("error:")[-1]
        assert err.count("error:") == 1 and line.count("\n") == 1, err
        assert re.search(message, line), (message, line)
        assert not (tmp_path / f"run{i}").exists() or not any((tmp_path / f"run{i}").iterdir())


def test_show_data_marks_what_is_not_trained(capsys):
    recipe = ["--job.config_file", str(ROOT / "train_configs" / "qwen3_chat_debug.toml")]
    assert show_data.main([*recipe, "--json", "--rows", "2"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 2 and all(len(row["input_ids"]) == 256 for row in rows)
    for row in rows:
        assert row["positions"][0] == 0 and row["positions"].count(0) > 1
        assert IGNORE_INDEX in row["labels"] and any(label != IGNORE_INDEX for label in row["labels"])
    assert show_data.main([*recipe, "--rows", "1"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("Legend: ⟦between these marks⟧ the tokens that are no target of the loss")
    assert "⟦<|im_start|>system\n" in text and "assistant\n⟧In the beginning" in text
    assert show_data.main(["--training.seq_len", "16", "--rows", "1"]) == 0  # text data: every token
    assert capsys.readouterr().out.count("⟦") == 2  # the legend's and the row's first token


def test_pretokenized_chat_shards_train_the_streamed_losses(tmp_path, capsys):
    """scripts/pretokenize.py writes the conversations with their masks and bounds; the shards give the
    streamed batches (every row of several steps, on 2 data-parallel ranks, a state resumed) and train
    the streamed losses; shards written for other chat settings are refused in one line."""
    chat_file = ROOT / "assets" / "corpus" / "kjv_chat" / "train.jsonl"
    streamed = [*CHAT, "--training.dataset_path", str(chat_file), "--training.steps", "2"]
    shards = tmp_path / "shards"
    run = runpy.run_path(str(ROOT / "scripts" / "pretokenize.py"))["run"]
    assert run([*streamed, "--output", str(shards), "--docs-per-shard", "20"]) == 0
    assert "48 conversations (" in capsys.readouterr().out
    manifest = json.loads((shards / "manifest.json").read_text())
    assert len(manifest["shards"]) == 3 and manifest["chat"]["seq_len"] == 128

    job = parse_args(streamed)
    tokenizer = HFTokenizer(HF_TOKENIZER)

    def loaders(path: Path) -> list:
        training = replace(job.training, dataset_path=str(path))
        return [
            build_training_data_loader(training, tokenizer, BatchLayout(2, 2, rank), 2256, False, job.chat)
            for rank in range(2)
        ]

    def steps(ranks: list, n: int) -> list[torch.Tensor]:
        its = [iter(loader) for loader in ranks]
        return [torch.cat([torch.stack(next(it).parts()) for it in its], dim=1) for _ in range(n)]

    expected = steps(loaders(chat_file), 6)  # (input_ids, labels, positions) x rows, past an epoch
    assert all(torch.equal(a, b) for a, b in zip(steps(loaders(shards), 6), expected))
    first = loaders(shards)
    steps(first, 2)
    resumed = loaders(shards)
    for loader, done in zip(resumed, first):
        loader.load_state_dict(done.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(steps(resumed, 4), expected[2:]))

    for name, path in {"streamed": chat_file, "shards": shards}.items():
        argv = [*streamed, "--training.dataset_path", str(path), "--job.dump_folder", str(tmp_path / name)]
        assert run_train_in_process(*argv) == 0
    assert losses(tmp_path / "shards") == losses(tmp_path / "streamed")

    capsys.readouterr()
    argv = [*streamed, "--training.dataset_path", str(shards), "--training.seq_len", "256"]
    assert run_train_in_process(*argv, "--job.dump_folder", str(tmp_path / "other")) == 2
    assert re.search(
        r"error: training.dataset_path: .* was written for other chat settings: seq_len 128 "
        r"\(the job: 256\); re-run scripts/pretokenize.py",
        capsys.readouterr().err,
    )
    # Without chat.enable the folder's masks would be ignored: refused.
    argv = [*streamed, "--training.dataset_path", str(shards), "--chat.enable", "false"]
    assert run_train_in_process(*argv, "--job.dump_folder", str(tmp_path / "plain")) == 2
    assert capsys.readouterr().err.endswith(
        f"error: training.dataset_path: {shards} holds pre-tokenized conversations (written with "
        "chat.enable): set chat.enable = true to train them with their loss masks\n"
    )
    assert not (tmp_path / "plain").exists() or not any((tmp_path / "plain").iterdir())


def test_mixtures_of_chat_sources(tmp_path):
    """training.mixture with chat.enable: each row of a global batch is the next window of whole
    conversations of its chosen source's stream (mixture.py's choice of (seed, step, row)), the same on
    every layout, resumed from the state, from a pre-tokenized chat folder alike; a mixture job trains."""
    corpus = ROOT / "assets" / "corpus" / "kjv_chat"
    files = [corpus / "train.jsonl", corpus / "validation.jsonl"]
    mixture = ["--training.mixture", f"{files[0]}:3,{files[1]}:1", "--training.steps", "2"]
    job = parse_args([*CHAT, *mixture])
    tokenizer = HFTokenizer(HF_TOKENIZER)

    def loaders(world: int) -> list:
        batch = 4 // world
        return [
            build_training_data_loader(
                job.training, tokenizer, BatchLayout(batch, world, r), 2256, False, job.chat
            )
            for r in range(world)
        ]

    def steps(ranks: list, n: int) -> list[torch.Tensor]:
        its = [iter(loader) for loader in ranks]
        return [torch.cat([torch.stack(next(it).parts(), dim=1) for it in its]) for _ in range(n)]

    expected = steps(loaders(1), 4)  # (rows, 3, seq_len): ids, labels, positions
    encoder = chat_encoder(job.chat, tokenizer, job.training.seq_len)
    streams = [
        ChatStreams(
            str(f),
            load_chat_dataset(str(f), str(f), "train", "auto"),
            encoder,
            128,
            tokenizer.pad_id,
            4,
            [0, 1, 2, 3],
        )
        for f in files
    ]
    chosen = set()
    for step, batch in enumerate(expected):
        for row, source in enumerate(row_choices(job.training.seed, step, 4, [3.0, 1.0])):
            assert torch.equal(batch[row], torch.stack(streams[source].next_window(row))), (step, row)
            chosen.add(int(source))
    assert chosen == {0, 1}
    assert all(torch.equal(a, b) for a, b in zip(steps(loaders(2), 4), expected))
    first = loaders(1)
    steps(first, 2)
    resumed = loaders(1)
    resumed[0].load_state_dict(first[0].state_dict())
    assert all(torch.equal(a, b) for a, b in zip(steps(resumed, 2), expected[2:]))
    # A pre-tokenized chat folder in place of a source's files: the same rows.
    shards = tmp_path / "shards"
    run = runpy.run_path(str(ROOT / "scripts" / "pretokenize.py"))["run"]
    assert run([*CHAT, "--training.dataset_path", str(files[1]), "--output", str(shards)]) == 0
    job = parse_args([*CHAT, *mixture, "--training.mixture", f"{files[0]}:3,{shards}:1"])
    assert all(torch.equal(a, b) for a, b in zip(steps(loaders(1), 4), expected))

    assert run_train_in_process(*CHAT, *mixture, "--job.dump_folder", str(tmp_path / "run")) == 0
    assert all(m["trained_tokens"] > 0 for m in read_metrics(tmp_path / "run"))
