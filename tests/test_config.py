import math
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from torchtitan.config import parser
from torchtitan.config.options import ConfigError, JobConfig, default_of
from torchtitan.config.parser import parse_args
from torchtitan.logging import logger

ROOT = Path(__file__).resolve().parent.parent


def write_toml(tmp_path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def test_defaults_without_file():
    config = parse_args([])
    assert config.training.steps == JobConfig().training.steps
    assert config.parallelism.data_parallel_shard_degree == -1


def test_precedence_cli_over_toml_over_default(tmp_path):
    path = write_toml(tmp_path, "[training]\nsteps = 7\nbatch_size = 3\n[optimizer]\nlr = 1e-2\n")
    config = parse_args(["--job.config_file", path, "--training.steps", "11", "--optimizer.lr=2e-3"])
    assert config.training.steps == 11  # CLI
    assert config.training.batch_size == 3  # TOML
    assert config.optimizer.lr == 2e-3  # CLI, = form
    assert config.training.seq_len == JobConfig().training.seq_len  # default
    assert config.job.config_file == path


def test_types_are_parsed_from_cli():
    config = parse_args(
        [
            "--training.deterministic",
            "true",
            "--lr_scheduler.decay_ratio",
            "0.25",
            "--training.dataset_path",
            "/data/x.jsonl",
            "--metrics.enable_color_printing=false",
        ]
    )
    assert config.training.deterministic is True
    assert config.lr_scheduler.decay_ratio == 0.25
    assert config.training.dataset_path == "/data/x.jsonl"
    assert config.metrics.enable_color_printing is False


def test_int_accepted_for_float_in_toml(tmp_path):
    config = parse_args(["--job.config_file", write_toml(tmp_path, "[optimizer]\nlr = 1\n")])
    assert config.optimizer.lr == 1.0 and isinstance(config.optimizer.lr, float)


@pytest.mark.parametrize(
    "toml, argv, message",
    [
        ("[trainig]\nsteps = 1\n", [], "unknown TOML section [trainig]; did you mean 'training'?"),
        ("[training]\nstep = 1\n", [], "unknown option 'step' in [training]; did you mean 'steps'?"),
        ("[training]\nsteps = '10'\n", [], "training.steps: expected int, got str '10'"),
        ("[training]\nsteps = 1.5\n", [], "training.steps: expected int, got float 1.5"),
        ("[training]\ndeterministic = 1\n", [], "training.deterministic: expected bool, got int 1"),
        ("[training]\nbatch_size = 0\n", [], "training.batch_size: 0 is below the minimum 1"),
        ("[model]\nname = 'gpt2'\n", [], "model.name: 'gpt2' is not one of llama2, llama3"),
        ("[training\nsteps = 1\n", [], "is not valid TOML"),
        ("training = 3\n", [], "[training] must be a table"),
        ("", ["--training.stepz", "3"], "unknown option --training.stepz; did you mean 'training.steps'?"),
        ("", ["--training.steps", "ten"], "--training.steps: expected int, got 'ten'"),
        ("", ["--training.seq_len=-4"], "--training.seq_len: -4 is below the minimum 1"),
        ("", ["--training.deterministic", "maybe"], "expected true or false"),
        ("", ["--training.steps"], "expected one argument"),
        ("", ["positional"], "unrecognized arguments: positional"),
        (
            "[moe]\naux_loss_coef = 0.1\naux_loss_weight = 0.2\n",
            [],
            "moe.aux_loss_coef and moe.aux_loss_weight both given in job.config_file: moe.aux_loss_coef is "
            "moe.aux_loss_weight's old name; keep only moe.aux_loss_weight",
        ),
        (
            "",
            ["--moe.sequence_aux_loss_weight", "0.1", "--moe.sequence_aux_loss_coeff=0.2"],
            "--moe.sequence_aux_loss_coeff and --moe.sequence_aux_loss_weight both given on the command line",
        ),
    ],
)
def test_bad_config_is_a_precise_error(tmp_path, toml, argv, message):
    argv = ["--job.config_file", write_toml(tmp_path, toml), *argv]
    with pytest.raises(ConfigError) as err:
        parse_args(argv)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "old, new",
    [("aux_loss_coef", "aux_loss_weight"), ("sequence_aux_loss_coeff", "sequence_aux_loss_weight")],
)
def test_former_option_names_read_the_same_with_one_notice(tmp_path, old, new, monkeypatch):
    """Recipes and command lines written before the loss weights were renamed still run, to the same
    JobConfig, and say once which name to use now."""
    monkeypatch.setattr(parser, "_NOTICED", set())
    warned = []  # the logger's warnings, whatever handlers earlier tests gave it
    monkeypatch.setattr(logger, "warning", warned.append)
    reference = parse_args(["--model.name", "qwen3_moe", f"--moe.{new}", "0.25"])
    assert getattr(reference.moe, new) == 0.25
    notices = []
    for argv in (
        ["--model.name", "qwen3_moe", f"--moe.{old}", "0.25"],
        ["--model.name", "qwen3_moe", f"--moe.{old}=0.25"],
        ["--job.config_file", write_toml(tmp_path, f"[model]\nname = 'qwen3_moe'\n[moe]\n{old} = 0.25\n")],
    ):
        warned.clear()
        config = parse_args(argv)
        assert config.moe == reference.moe
        assert f"moe.{new}" in config.explicit and f"moe.{old}" not in config.explicit
        notices += warned
    # Once a process, whichever way it came first.
    assert notices == [f"--moe.{old} is deprecated: use --moe.{new} (same meaning)"]
    parser._NOTICED.clear()
    warned.clear()
    parse_args(["--job.config_file", write_toml(tmp_path, f"[moe]\n{old} = 0.5\n")])
    assert warned == [f"moe.{old} is deprecated: use moe.{new} (same meaning)"]


def test_float8_section_from_toml_and_cli(tmp_path):
    defaults = parse_args([]).float8
    assert (defaults.enable_float8_linear, defaults.recipe_name, defaults.filter_fqns) == (
        False,
        "tensorwise",
        ["output"],
    )
    assert (
        not defaults.enable_fsdp_float8_all_gather and not defaults.precompute_float8_dynamic_scale_for_fsdp
    )
    toml = (
        "[float8]\nenable_float8_linear = true\nenable_fsdp_float8_all_gather = true\n"
        "precompute_float8_dynamic_scale_for_fsdp = true\nfilter_fqns = ['output', 'layers.0']\n"
    )
    path = write_toml(tmp_path, toml)
    config = parse_args(["--job.config_file", path]).float8
    assert config.enable_float8_linear and config.enable_fsdp_float8_all_gather
    assert config.precompute_float8_dynamic_scale_for_fsdp and config.filter_fqns == ["output", "layers.0"]
    config = parse_args(
        ["--job.config_file", path, "--float8.recipe_name", "rowwise", "--float8.filter_fqns", "output,wq"]
    ).float8
    assert (config.recipe_name, config.filter_fqns, config.enable_float8_linear) == (
        "rowwise",
        ["output", "wq"],
        True,
    )
    with pytest.raises(
        ConfigError, match="float8.recipe_name: 'blockwise' is not one of tensorwise, rowwise"
    ):
        parse_args(["--float8.recipe_name", "blockwise"])


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="job.config_file: no such file"):
        parse_args(["--job.config_file", str(tmp_path / "nope.toml")])


def test_help_lists_every_option_with_type_and_default():
    out = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "--help"], capture_output=True, text=True, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    config = JobConfig()
    for section in fields(config):
        for option in fields(section.type):
            assert f"--{section.name}.{option.name}" in text
            assert f"default: {default_of(option)!r}" in text
    assert "(int, default: 10000)" in text
    assert "formerly --moe.aux_loss_coef, still read" in text
    # What it trains: every family, not "a Llama model".
    assert (
        "Llama model" not in text
        and "llama3, qwen3, qwen3_moe, qwen3_5, qwen3_5_moe, deepseek_v3 (model.name)" in text
    )


def test_make_chat_data_help_says_its_whole_purpose():
    """Its description is the docstring's first paragraph, not its first line cut mid-sentence."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_chat_data.py"), "--help"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    description = " ".join(out.stdout.split("\n\n")[1].split())
    assert description.startswith("Regenerate the bundled chat set") and description.endswith(
        "the same file."
    )


def test_every_recipe_parses():
    recipes = sorted((ROOT / "train_configs").glob("*.toml"))
    assert recipes
    for recipe in recipes:
        parse_args(["--job.config_file", str(recipe)])


# The GPU recipes of DeepSeek-V3's architecture, at the GPU counts their comments size them for, and
# the user-supplied tokenizer each points at.
DEEPSEEK_V3_RECIPES = {
    "moonlight_16b": ([8], "assets/tokenizer/moonlight/tiktoken.model"),
    "deepseek_v3_671b": ([256, 512], "assets/tokenizer/deepseek_v3/tokenizer.json"),
    "kimi_k2": ([256, 512], "assets/tokenizer/kimi_k2/tiktoken.model"),
}


@pytest.mark.parametrize("recipe", DEEPSEEK_V3_RECIPES)
def test_deepseek_v3_recipes_hold_every_rule_and_name_their_missing_tokenizer(recipe, tmp_path, capsys):
    """Every rule between the options holds at the recipe's GPU counts (the layout, the pipeline split of
    61 or 27 layers, expert parallelism, the batch arithmetic); the tokenizer a user has not put in place
    yet stops the preflight with one line naming it, not a traceback."""
    from torchtitan.config_rules import check_layout
    from torchtitan.reliability import preflight

    world_sizes, tokenizer = DEEPSEEK_V3_RECIPES[recipe]
    argv = ["--job.config_file", str(ROOT / "train_configs" / f"{recipe}.toml")]
    for world_size in world_sizes:
        check_layout(parse_args(argv), world_size)
    dump = ["--job.dump_folder", str(tmp_path)]
    assert not (ROOT / tokenizer).exists()
    assert preflight.main(["--nproc", str(world_sizes[0]), *argv, *dump]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("error: model.tokenizer_path:"), errors
    assert Path(tokenizer).parent.as_posix() in errors[0], errors


def test_list_option_from_toml_array_and_comma_separated_cli(tmp_path):
    key = "--parallelism.pipeline_parallel_split_points"
    path = write_toml(tmp_path, "[parallelism]\npipeline_parallel_split_points = ['layers.2', 'layers.4']\n")
    assert parse_args(["--job.config_file", path]).parallelism.pipeline_parallel_split_points == [
        "layers.2",
        "layers.4",
    ]
    assert parse_args([key, "layers.1, layers.3"]).parallelism.pipeline_parallel_split_points == [
        "layers.1",
        "layers.3",
    ]
    assert parse_args(["--job.config_file", path, f"{key}="]).parallelism.pipeline_parallel_split_points == []
    first, second = JobConfig(), JobConfig()
    first.parallelism.pipeline_parallel_split_points.append("layers.1")
    assert second.parallelism.pipeline_parallel_split_points == []  # defaults are not shared


@pytest.mark.parametrize("value", ["'layers.2'", "[2, 4]"])
def test_list_option_rejects_wrong_types(tmp_path, value):
    path = write_toml(tmp_path, f"[parallelism]\npipeline_parallel_split_points = {value}\n")
    with pytest.raises(ConfigError, match=r"pipeline_parallel_split_points: expected list\[str\]"):
        parse_args(["--job.config_file", path])


DEBUG_RECIPES = sorted((ROOT / "train_configs").glob("*debug*.toml"))
# Degrees (world size, dp_replicate, tp, pp, cp; dp_shard the rest) of the layouts the tests and docs run.
DEBUG_LAYOUTS = [
    (1, 1, 1, 1, 1),
    (2, 1, 1, 1, 1),
    (2, 2, 1, 1, 1),
    (2, 1, 2, 1, 1),
    (2, 1, 1, 2, 1),
    (2, 1, 1, 1, 2),
    (4, 1, 1, 1, 1),
    (4, 2, 1, 1, 1),
    (4, 1, 2, 1, 1),
    (4, 1, 1, 2, 1),
    (4, 1, 2, 2, 1),
    (4, 1, 1, 2, 2),
    (4, 1, 1, 1, 2),
    (4, 2, 1, 2, 1),
    (8, 1, 2, 2, 1),
    (8, 2, 2, 2, 1),
    (8, 1, 1, 2, 2),
    (8, 1, 1, 4, 1),
]


@pytest.mark.parametrize("recipe", DEBUG_RECIPES, ids=lambda path: path.stem)
def test_every_training_batch_of_a_debug_recipe_validates_on_every_layout(recipe):
    """The recipes' validation settings compose with every layout: a training.batch_size the training
    rules accept (validation off) passes them with the recipe's validation on too, pipelines included
    (the validation batch runs in the training shape, train_step.py), e.g. debug_model.toml's
    validation.global_batch_size 8 on PP 2 with training.batch_size 4."""
    import copy

    from torchtitan.config_rules import check_layout

    base = parse_args(["--job.config_file", str(recipe)])
    assert base.validation.enable, recipe
    accepted = []
    for world, replicate, tp, pp, cp in DEBUG_LAYOUTS:
        for batch_size in range(1, 9):
            job = copy.deepcopy(base)
            parallelism = job.parallelism
            parallelism.data_parallel_replicate_degree, parallelism.tensor_parallel_degree = replicate, tp
            parallelism.pipeline_parallel_degree, parallelism.context_parallel_degree = pp, cp
            job.training.batch_size = batch_size
            job.validation.enable = False
            try:
                check_layout(job, world)
            except ConfigError:
                continue  # a layout or batch the training rules refuse
            job.validation.enable = True
            check_layout(job, world)
            accepted.append(pp)
    assert len(accepted) > 40 and accepted.count(2) > 10, accepted


@pytest.mark.parametrize(
    "text, value",
    [
        ("-5", -5.0),
        ("-.5", -0.5),
        ("-1e-4", -1e-4),
        ("-1E+3", -1000.0),
        ("-2.5e3", -2500.0),
        ("-inf", -math.inf),
    ],
)
def test_negative_numbers_in_any_notation_are_values(text, value):
    """A negative number after an option is its value, not another option (argparse reads -1e-4, -1E+3
    and -inf as options by itself): in train.py's options, checked then against their declaration, and
    in the scripts' own arguments (OneLineParser)."""
    from torchtitan.config.parser import OneLineParser

    shown = "-inf is not a finite number" if math.isinf(value) else f"{value!r} is below the minimum 0.0"
    with pytest.raises(ConfigError, match=f"^--optimizer.lr: {re.escape(shown)}$"):
        parse_args(["--optimizer.lr", text])
    parser = OneLineParser(prog="script.py")
    parser.add_argument("--x", type=float)
    parser.add_argument("positional", nargs="?")
    assert parser.parse_args(["--x", text]).x == value
    assert parse_args(["--validation.steps", "-1"]).validation.steps == -1
    with pytest.raises(ConfigError, match="argument --optimizer.lr: expected one argument"):
        parse_args(["--optimizer.lr", "-x"])  # not a number: still an option, refused


def test_model_n_layers_gives_the_flavours_width_on_that_many_blocks():
    """model.n_layers: the flavour on N blocks, everything else its own (DeepSeek-V3's first dense blocks
    kept), in the model the run builds and in every rule that counts its layers; 0 is the flavour."""
    from torchtitan.config_rules import check_layout
    from torchtitan.models import build_model_args, flavor_args

    flavour = flavor_args(parse_args(["--model.name", "deepseek_v3"]).model)
    config = parse_args(["--model.name", "deepseek_v3", "--model.n_layers", "5"])
    args = build_model_args(config, tokenizer_words=1000)
    assert flavour.n_layers == 3
    assert (args.n_layers, args.first_k_dense_replace, args.dim) == (5, 1, flavour.dim)
    assert build_model_args(parse_args(["--model.n_layers", "0"]), 1000).n_layers == 6
    pipelined = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule"]
    check_layout(parse_args([*pipelined, "Interleaved1F1B", "--model.n_layers", "4"]), 2)
    with pytest.raises(ConfigError, match="makes 4 stages but the model has only 3 layers"):
        check_layout(parse_args([*pipelined, "Interleaved1F1B", "--model.n_layers", "3"]), 2)
