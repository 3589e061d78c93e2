"""scripts/plot_metrics.py and scripts/generate.py on the metrics and checkpoints of real runs."""

import importlib.util
import json
import shutil
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from launch import ROOT, TINY_JOB, VALIDATION, run_train_in_process
from test_convert import random_model

from torchtitan.config.parser import parse_args
from torchtitan.models import build_model_args


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


plot_metrics = load_script("plot_metrics")
generate = load_script("generate")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls on several threads crawl when the cores are busy (as the subprocesses' OMP=1);
    module-wide, so that the runs trained in this process (`runs`) get it too."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two 6-step runs of the tiny job that differ in learning rate only, validated at steps 3 and 6.
    The first saves a full checkpoint at step 3 and, at step 6, a bfloat16 weights-only export, also
    exported for Hugging Face (checkpoint.last_save_in_hf)."""
    base = tmp_path_factory.mktemp("runs")
    common = [*TINY_JOB, "--training.steps", "6", "--training.batch_size", "2", *VALIDATION]
    common += ["--model.n_layers", "0"]  # the debug flavour's 6 blocks, which the scripts build by default
    common += ["--validation.freq", "3"]
    # In this process (no interpreter nor torch start-up): the scripts read the runs' files only.
    first = run_train_in_process(
        *common,
        "--job.dump_folder",
        str(base / "a"),
        "--checkpoint.enable_checkpoint",
        "true",
        "--checkpoint.interval",
        "3",
        "--checkpoint.model_weights_only",
        "true",
        "--checkpoint.export_dtype",
        "bfloat16",
        "--checkpoint.last_save_in_hf",
        "true",
    )
    second = run_train_in_process(*common, "--job.dump_folder", str(base / "b"), "--optimizer.lr", "1e-4")
    assert (first, second) == (0, 0)
    return base / "a", base / "b"


def test_plot_overlays_runs_in_one_png(runs, tmp_path):
    import matplotlib.image

    out = tmp_path / "plot.png"
    assert plot_metrics.main([str(runs[0]), str(runs[1]), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = matplotlib.image.imread(out).shape
    assert (width, height) == (1440, 960)
    loss_panel = plot_metrics.plot([str(runs[0]), str(runs[1])], str(out)).axes[0]
    curves = {line.get_label(): line.get_xdata().tolist() for line in loss_panel.get_lines()}
    assert curves == {
        "a": list(range(1, 7)),
        "b": list(range(1, 7)),
        "a (validation)": [3, 6],
        "b (validation)": [3, 6],
    }
    assert plot_metrics.run_labels([str(runs[0]), str(runs[1] / "metrics.jsonl")]) == ["a", "b"]


def test_plot_without_matplotlib_is_one_line_naming_the_install(runs, tmp_path, capsys, monkeypatch):
    """matplotlib is optional (a runtime install leaves it out): plotting then refuses in one line."""
    for name in ("matplotlib", "matplotlib.pyplot"):
        monkeypatch.setitem(sys.modules, name, None)  # `import matplotlib` raises ImportError
    assert plot_metrics.main([str(runs[0]), "-o", str(tmp_path / "plot.png")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: plotting needs matplotlib, which is not installed: run `./scripts/install.sh --dev` or "
        "`.venv/bin/pip install matplotlib` (--compare needs nothing more)"
    ]
    assert not (tmp_path / "plot.png").exists()


def test_compare_passes_on_equal_losses_and_fails_on_a_difference(runs, tmp_path, capsys):
    a, b = (str(r) for r in runs)
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy(runs[0] / "metrics.jsonl", copy)
    assert plot_metrics.main(["--compare", a, str(copy)]) == 0
    out = capsys.readouterr().out
    assert "OK: largest loss difference 0.000e+00" in out
    assert "largest validation_loss difference 0.000e+00" in out

    assert plot_metrics.main(["--compare", a, b]) == 1  # another learning rate
    assert "FAIL: loss differs by" in capsys.readouterr().out

    records = [json.loads(line) for line in (copy / "metrics.jsonl").read_text().splitlines()]
    changed = [r for r in records if "loss" in r][3]
    changed["loss"] += 3e-5
    (copy / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert plot_metrics.main(["--compare", a, str(copy), "--tol", "1e-5"]) == 1
    out = capsys.readouterr().out
    assert f"FAIL: loss differs by 3.000e-05 at step {changed['step']}" in out
    assert plot_metrics.main(["--compare", a, str(copy), "--tol", "1e-4"]) == 0
    validation = next(r for r in records if "validation_loss" in r)
    validation["validation_loss"] += 1e-3
    (copy / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert plot_metrics.main(["--compare", a, str(copy), "--tol", "1e-4"]) == 1
    assert (
        f"FAIL: validation_loss differs by 1.000e-03 at step {validation['step']}" in capsys.readouterr().out
    )


def test_compare_and_plot_report_a_missing_run(tmp_path, capsys):
    assert plot_metrics.main(["--compare", str(tmp_path), str(tmp_path)]) == 2
    assert plot_metrics.main([str(tmp_path / "nope"), "-o", str(tmp_path / "x.png")]) == 2
    assert capsys.readouterr().err.count("no metrics.jsonl there") == 2


def sample(run, capsys, *args: str) -> tuple[int, str]:
    argv = [
        "--job.config_file",
        str(ROOT / "train_configs" / "debug_model.toml"),
        "--job.dump_folder",
        str(run),
        "--training.seq_len",
        "64",
        "--prompt",
        "And God said",
        "--max_new_tokens",
        "12",
        *args,
    ]
    code = generate.main(argv)
    return code, capsys.readouterr()


def test_generate_is_deterministic_for_a_seed(runs, capsys):
    code, first = sample(runs[0], capsys, "--seed", "0")
    assert code == 0, first.err
    assert "checkpoint/step-6" in first.err  # the latest: the weights-only bfloat16 export
    assert first.out.startswith("And God said") and len(first.out.strip()) > len("And God said")
    assert sample(runs[0], capsys, "--seed", "0")[1].out == first.out
    assert sample(runs[0], capsys, "--seed", "1")[1].out != first.out


def test_generate_from_an_earlier_step_and_bad_input(runs, capsys):
    code, step3 = sample(runs[0], capsys, "--checkpoint.load_step", "3", "--temperature", "0")
    assert code == 0 and "checkpoint/step-3" in step3.err
    assert sample(runs[0], capsys, "--temperature", "0")[1].out != step3.out

    code, result = sample(runs[0], capsys, "--checkpoint.load_step", "4")
    assert code == 2
    assert "checkpoint.load_step: there is no complete checkpoint step-4" in result.err
    assert "available steps: 3, 6" in result.err
    code, result = sample(runs[1], capsys)
    assert code == 2 and "job.dump_folder: no checkpoint in" in result.err
    code, result = sample(runs[0], capsys, "--max_new_token", "3")
    assert code == 2 and "unknown option --max_new_token; did you mean --max_new_tokens?" in result.err


def corpus_lines() -> list[str]:
    lines = (ROOT / "assets" / "corpus" / "kjv" / "validation.jsonl").read_text().splitlines()
    return [json.loads(line)["text"] for line in lines]


def test_an_export_runs_in_transformers_as_generate_py(runs, tmp_path, capsys, tok):
    """Step 3 of a trained run exported for transformers with nothing but the checkpoint and a folder
    (its record names the model and the tiktoken tokenizer, written as tokenizer.json): AutoTokenizer
    gives our ids on the bundled corpus (BOS first), and transformers' text-generation pipeline writes
    generate.py's greedy text."""
    transformers = pytest.importorskip("transformers")
    convert = load_script("convert_dcp_to_hf")
    assert convert.main([str(runs[0] / "checkpoint" / "step-3"), str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (tok.bos_id, tok.eos_id)
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tok.eos_id

    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    for text in corpus_lines():
        assert hf_tokenizer(text)["input_ids"] == tok.encode(text, bos=True, eos=False), text

    code, ours = sample(runs[0], capsys, "--checkpoint.load_step", "3", "--temperature", "0")
    assert code == 0, ours.err
    pipe = transformers.pipeline("text-generation", model=str(tmp_path / "hf"), dtype=torch.float32)
    theirs = pipe("And God said", max_new_tokens=12, do_sample=False)[0]["generated_text"]
    assert theirs + "\n" == ours.out


def test_the_last_save_is_exported_for_transformers(runs, tok):
    """checkpoint.last_save_in_hf: {dump_folder}/hf holds step 6's weights as they were saved (bfloat16)
    and the tokenizer, and transformers loads it as it is; the option without checkpoints is refused."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from torchtitan.checkpoint.load import read_model_weights
    from torchtitan.models.llama.hf_convert import to_hf

    args = build_model_args(parse_args([*TINY_JOB, "--model.n_layers", "0"]), tok.n_words)
    saved = to_hf(read_model_weights(str(runs[0] / "checkpoint" / "step-6")), args)
    exported = load_file(runs[0] / "hf" / "model.safetensors")
    model = transformers.AutoModelForCausalLM.from_pretrained(runs[0] / "hf")
    assert model.dtype == torch.bfloat16 and exported.keys() == saved.keys()
    for name, w in saved.items():
        assert w.dtype == torch.bfloat16 and torch.equal(exported[name], w), name
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(runs[0] / "hf")
    assert hf_tokenizer("And God said")["input_ids"] == tok.encode("And God said", bos=True, eos=False)

    argv = [*TINY_JOB, "--checkpoint.last_save_in_hf", "true"]
    assert run_train_in_process(*argv) == 2


def test_generate_from_a_qwen3_checkpoint(tmp_path, capsys, tok):
    """model.name qwen3 (tied embeddings: one parameter under two names in the checkpoint): greedy
    sampling gives the greedy continuation of the very model that was saved."""
    tied = ["--model.name", "qwen3", "--model.flavor", "debugmodel_tied"]
    job = ["--job.config_file", str(ROOT / "train_configs" / "debug_model.toml"), *tied]
    args = build_model_args(parse_args([*job, "--training.seq_len", "64"]), tok.n_words)
    model = random_model(args, "qwen3").eval()
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "qwen3"), no_dist=True)
    code, result = sample(tmp_path / "run", capsys, *tied, "--temperature", "0",
                          "--checkpoint.initial_load_path", str(tmp_path / "qwen3"))  # fmt: skip
    assert code == 0, result.err
    assert "Loaded qwen3 debugmodel_tied" in result.err

    prompt = tok.encode("And God said", bos=True, eos=False)
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            next_id = int(model(torch.tensor([tokens]))[0, -1, : tok.n_words].argmax())
            if next_id == tok.eos_id:
                break
            tokens.append(next_id)
    assert len(tokens) > len(prompt)
    assert result.out == "And God said" + tok.decode(tokens[len(prompt) :]) + "\n"


def test_generate_with_a_tokenizer_without_bos(tmp_path, capsys, hf_tok):
    """Qwen3 with a Hugging Face tokenizer without BOS (its own style): the prompt starts after EOS, where
    documents start in training, and greedy sampling continues it as the saved model does; an empty
    prompt works."""
    tokenizer = str(ROOT / "assets" / "tokenizer" / "kjv_bpe_hf")
    hf = ["--model.name", "qwen3", "--model.tokenizer_path", tokenizer]
    job = ["--job.config_file", str(ROOT / "train_configs" / "debug_model.toml"), *hf]
    args = build_model_args(parse_args([*job, "--training.seq_len", "64"]), hf_tok.n_words)
    model = random_model(args, "qwen3")
    dcp.save({"model": model.eval().state_dict()}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    greedy = [*hf, "--temperature", "0", "--checkpoint.initial_load_path", str(tmp_path / "ckpt")]
    code, result = sample(tmp_path / "run", capsys, *greedy)
    assert code == 0, result.err
    result_greedy = result

    tokens = [hf_tok.eos_id, *hf_tok.encode("And God said", bos=False, eos=False)]
    start = len(tokens)
    with torch.no_grad():
        for _ in range(12):
            next_id = int(model(torch.tensor([tokens]))[0, -1, : hf_tok.n_words].argmax())
            if next_id == hf_tok.eos_id:
                break
            tokens.append(next_id)
    assert result.out == "And God said" + hf_tok.decode(tokens[start:]) + "\n"
    code, result = sample(tmp_path / "run", capsys, *greedy, "--prompt", "")
    assert code == 0, result.err

    # Exported with its tokenizer.json (no record: name and tokenizer given): transformers' ids are ours,
    # and the model's prompt after EOS, as generate.py's, gives its greedy text (docs/checkpointing.md).
    transformers = pytest.importorskip("transformers")
    convert = load_script("convert_dcp_to_hf")
    to_hf = [str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--name", "qwen3", "--tokenizer", tokenizer]
    assert convert.main(to_hf) == 0
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    for text in corpus_lines():
        assert hf_tokenizer(text)["input_ids"] == hf_tok.encode(text, bos=False, eos=False), text
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    prompt = hf_tokenizer(hf_tokenizer.eos_token + "And God said", return_tensors="pt")
    out = hf_model.generate(**prompt, max_new_tokens=12, do_sample=False)
    assert hf_tokenizer.decode(out[0, 1:], skip_special_tokens=True) + "\n" == result_greedy.out
    # generate.py from the exported folder (checkpoint.initial_load_path): the same text.
    from_hf = [*hf, "--temperature", "0", "--checkpoint.initial_load_path", str(tmp_path / "hf")]
    capsys.readouterr()  # the conversion's and transformers' output
    code, result = sample(tmp_path / "run", capsys, *from_hf)
    assert code == 0 and result.out == result_greedy.out, result.err
