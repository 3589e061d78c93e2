"""One export (torchtitan/checkpoint/hf_export.py): a run's `checkpoint.last_save_in_hf` folder and
scripts/convert_dcp_to_hf.py's of the same checkpoint are the same files, byte for byte. A DeepSeek-V3
run with a multi-token prediction depth: num_nextn_predict_layers 1 and DeepSeek's copies of the
embeddings and head, transformers loads it (skipping the depth, as DeepSeek's) with our logits, and
convert_hf_to_dcp.py reads it back with its depth, every tensor equal. A chat run: the export carries the
template it trained with, transformers' apply_chat_template gives our ids, generation_config.json's
eos_token_id lists <|im_end|>, which transformers' greedy generation and generate.py --chat stop at, and
a chat fine-tune starts from the folder (its tokenizer and template)."""

import filecmp
import json
from pathlib import Path

import pytest
import torch
from launch import ROOT, TINY_JOB, run_train_in_process

from scripts import convert_dcp_to_hf, convert_hf_to_dcp
from scripts import generate as generate_py
from torchtitan.checkpoint.load import load_model_weights, read_model_weights
from torchtitan.config.parser import parse_args
from torchtitan.datasets.chat_template import load_chat_template
from torchtitan.datasets.hf_tokenizer import HFTokenizer
from torchtitan.models import build_model_args, model_spec

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("hf_cache")

HF_TOKENIZER = ROOT / "assets" / "tokenizer" / "kjv_bpe_hf"
EXPORTED = ["--checkpoint.enable_checkpoint", "true", "--checkpoint.last_save_in_hf", "true"]
# One step of two sequences: enough for a checkpoint, trained routing biases and an export.
SMALL = ["--training.steps", "1", "--training.batch_size", "2"]
MTP = [
    *TINY_JOB,
    *("--model.name", "deepseek_v3", "--model.tokenizer_path", str(HF_TOKENIZER), "--model.mtp_layers", "1"),
    *("--model.n_layers", "2"),  # the flavour's 3 blocks cut to 2: the script exports the weights' depth
    *("--moe.bias_update_rate", "0.01", *SMALL, *EXPORTED),
]
CHAT = [
    *TINY_JOB,
    *("--model.name", "qwen3", "--model.flavor", "debugmodel", "--model.attn_mask_type", "block_causal"),
    *("--model.tokenizer_path", str(HF_TOKENIZER), "--chat.enable", "true", "--training.dataset", "kjv_chat"),
    *("--training.seq_len", "128", *SMALL, *EXPORTED),
]
CONVERSATION = [
    {"role": "system", "content": "Answer from the King James Bible."},
    {"role": "user", "content": "Who was the first man?"},
    {"role": "assistant", "content": "Adam, made of the dust of the ground."},
    {"role": "user", "content": "And the first woman?"},
]


def same_files(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    _, differ, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    assert not differ and not errors, (differ, errors)


def export_both(argv: list[str], dump: Path) -> Path:
    """The run's own export, and the script's of its last checkpoint: the same files."""
    assert run_train_in_process(*argv, "--job.dump_folder", str(dump)) == 0
    step = dump / "checkpoint" / f"step-{parse_args(argv).training.steps}"
    assert convert_dcp_to_hf.main([str(step), str(dump / "script")]) == 0
    same_files(dump / "hf", dump / "script")
    return step


def test_an_mtp_run_exports_one_folder_that_loads_and_round_trips(tmp_path):
    step = export_both(MTP, tmp_path)
    hf = tmp_path / "hf"
    config = json.loads((hf / "config.json").read_text())
    n = config["num_hidden_layers"]
    assert config["num_nextn_predict_layers"] == 1
    from safetensors.torch import load_file

    tensors = load_file(hf / "model.safetensors")
    assert torch.equal(tensors[f"model.layers.{n}.embed_tokens.weight"], tensors["model.embed_tokens.weight"])
    assert torch.equal(tensors[f"model.layers.{n}.shared_head.head.weight"], tensors["lm_head.weight"])
    assert tensors[f"model.layers.{n}.mlp.gate.e_score_correction_bias"].abs().sum() > 0  # trained bias

    # transformers loads it (without the depth, as DeepSeek's) and computes our model's logits.
    job = parse_args([*MTP, "--job.dump_folder", str(tmp_path)])
    tokenizer = HFTokenizer(HF_TOKENIZER)
    model = model_spec(job.model).build(build_model_args(job, tokenizer.n_words, tokenizer.eos_id))
    load_model_weights([model], str(step))
    tokens = torch.randint(0, tokenizer.n_words, (2, 32), generator=torch.Generator().manual_seed(0))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    assert type(hf_model).__name__ == "DeepseekV3ForCausalLM"
    with torch.no_grad():
        difference = (model.eval()(tokens) - hf_model(tokens, use_cache=False).logits).abs().max()
    assert difference <= 1e-5, difference

    # Back to DCP with its depth (by default: config.json's), every tensor the checkpoint's.
    assert convert_hf_to_dcp.main([str(hf), str(tmp_path / "back")]) == 0
    back, saved = read_model_weights(str(tmp_path / "back")), read_model_weights(str(step))
    assert any(k.startswith("mtp.0.") for k in back) and back.keys() == saved.keys()
    assert all(torch.equal(back[k], w) for k, w in saved.items())


class ForceAt(transformers.LogitsProcessor):
    """Greedy generation made to pick `token` as its `at`-th new token: a tiny model briefly trained need
    not end its turn itself, so what is proved is that generation stops at the token it is given."""

    def __init__(self, start: int, at: int, token: int):
        self.stop, self.token = start + at - 1, token

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] == self.stop:
            scores = torch.full_like(scores, float("-inf"))
            scores[:, self.token] = 0.0
        return scores


def test_a_chat_run_exports_its_template_and_stops_at_the_end_of_the_turn(tmp_path, monkeypatch, capsys):
    export_both(CHAT, tmp_path)
    hf, ours = tmp_path / "hf", HFTokenizer(HF_TOKENIZER)
    template = load_chat_template(ours.folder, ours.config, None)
    assert (hf / "chat_template.jinja").read_text() == template.source
    im_end, eos = ours.encode_rendered("<|im_end|>")[0][0], ours.eos_id
    assert json.loads((hf / "generation_config.json").read_text())["eos_token_id"] == [eos, im_end]

    # transformers renders our ids, with the generation prompt too.
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(hf)
    for prompt in (False, True):
        ids = hf_tokenizer.apply_chat_template(CONVERSATION, tokenize=True, add_generation_prompt=prompt)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        assert list(ids) == ours.encode_rendered(template.render(CONVERSATION, prompt)[0])[0]

    # Greedy generation stops at <|im_end|> (the generation config's list), not at max_new_tokens.
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    prompt = torch.tensor([ours.encode_rendered(template.render(CONVERSATION, True)[0])[0]])
    forced = transformers.LogitsProcessorList([ForceAt(prompt.shape[1], 3, im_end)])
    out = hf_model.generate(prompt, max_new_tokens=20, do_sample=False, logits_processor=forced)
    assert out[0, prompt.shape[1] :].tolist()[-1] == im_end and out.shape[1] == prompt.shape[1] + 3

    # generate.py --chat: the prompt transformers renders, and the reply ends at the end of the turn.
    reply = ours.encode_rendered("In the beginning")[0]
    seen = []

    class Scripted(torch.nn.Module):
        """The reply, <|im_end|>, then more text: what follows the end of the turn must not be printed."""

        def __init__(self, model_args):
            super().__init__()
            self.model_args, self.weight = model_args, torch.nn.Parameter(torch.zeros(1))

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            seen.append(tokens[0].tolist())
            script = [*reply, im_end, *reply]
            logits = torch.zeros(1, tokens.shape[1], ours.n_words)
            logits[0, -1, script[len(seen) - 1]] = 1.0
            return logits

    job = parse_args([*CHAT, "--job.dump_folder", str(tmp_path)])
    monkeypatch.setattr(
        generate_py, "load_model", lambda *a: Scripted(build_model_args(job, ours.n_words, eos))
    )
    capsys.readouterr()
    argv = [*CHAT, "--job.dump_folder", str(tmp_path), "--temperature", "0"]
    argv += ["--system", CONVERSATION[0]["content"], "--chat", CONVERSATION[1]["content"]]
    assert generate_py.main(argv) == 0
    expected = hf_tokenizer.apply_chat_template(CONVERSATION[:2], tokenize=True, add_generation_prompt=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert seen[0] == list(expected) and len(seen) == len(reply) + 1
    assert capsys.readouterr().out == "In the beginning\n"

    # Fine-tuned again from the folder: its tokenizer, its template.
    again = [
        *CHAT[: -len(EXPORTED)],
        "--model.tokenizer_path",
        str(hf),
        "--checkpoint.initial_load_path",
        str(hf),
    ]
    assert run_train_in_process(*again, "--job.dump_folder", str(tmp_path / "again")) == 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--chat", "Hi", "--prompt", "And"], "--prompt: continues a text, --chat answers a message"),
        (["--system", "Be brief"], "--system: a system prompt for --chat; give --chat MESSAGE too"),
    ],
)
def test_generate_chat_options_are_one_line(argv, message, capsys):
    assert generate_py.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_a_template_from_chat_template_path_is_recorded_and_exported(tmp_path):
    """A tokenizer without a template, the run's from chat.template_path: the checkpoint records it (the
    manager's model_record) and the script's export writes it as chat_template.jinja, with its end of
    turn in generation_config.json."""
    import torch.distributed.checkpoint as dcp
    from test_chat_train import tokenizer_without_template
    from test_convert import random_model

    from torchtitan.checkpoint.state import RECORD, model_record
    from torchtitan.datasets.hf_export import trained_chat_template

    tokenizer = tokenizer_without_template(tmp_path / "tokenizer")
    source = "{#- the run's own template -#}\n" + (HF_TOKENIZER / "chat_template.jinja").read_text()
    (tmp_path / "chat.jinja").write_text(source)
    argv = [*CHAT[: -len(EXPORTED)], "--model.tokenizer_path", str(tokenizer)]
    job = parse_args([*argv, "--chat.template_path", str(tmp_path / "chat.jinja")])
    record = model_record(job.model, trained_chat_template(job.model, job.chat))
    assert record["chat_template"] == source
    args = build_model_args(job, HFTokenizer(tokenizer).n_words, HFTokenizer(tokenizer).eos_id)
    state = {"model": random_model(args, "qwen3").state_dict(), RECORD: record}
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert convert_dcp_to_hf.main([str(tmp_path / "dcp"), str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "chat_template.jinja").read_text() == source
    im_end = HFTokenizer(tokenizer).encode_rendered("<|im_end|>")[0][0]
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text())["eos_token_id"][-1] == im_end
