"""Pipeline parallelism: stage splitting, validation, and loss parity with 1 process under torchrun."""

import shutil

import pytest
import torch
from launch import VALIDATION, read_metrics, run_train, validation_losses
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

from torchtitan.checkpoint.state import merge_model_parts
from torchtitan.config.options import ConfigError, JobConfig, ParallelismConfig, default_of
from torchtitan.config.parser import parse_args
from torchtitan.config_rules import check_pipeline
from torchtitan.models.llama import ModelArgs
from torchtitan.models.llama.model import Transformer
from torchtitan.parallelisms.pipeline import split_model
from torchtitan.parallelisms.pipeline_layout import SINGLE_STAGE_SCHEDULES, stage_ids, stage_layers

TINY = ModelArgs(dim=32, n_layers=6, n_heads=4, vocab_size=64, multiple_of=16, max_seq_len=16)


def pp_config(
    degree: int = 2, schedule: str = "1F1B", points: str = "", microbatches: int = 0, batch: int = 4
):
    argv = [
        "--parallelism.pipeline_parallel_degree",
        str(degree),
        "--parallelism.pipeline_parallel_schedule",
        schedule,
        f"--parallelism.pipeline_parallel_split_points={points}",
        "--training.batch_size",
        str(batch),
    ]
    if microbatches:
        argv += ["--parallelism.pipeline_parallel_microbatches", str(microbatches)]
    return parse_args(argv)


def as_lists(ranges: list[range]) -> list[list[int]]:
    return [list(r) for r in ranges]


def test_every_schedule_choice_is_a_torch_schedule():
    choices = ParallelismConfig.__dataclass_fields__["pipeline_parallel_schedule"].metadata["choices"]
    for name in choices:
        assert get_schedule_class(name).__name__ == "Schedule" + name
        single = issubclass(get_schedule_class(name), PipelineScheduleSingle)
        assert single == (name in SINGLE_STAGE_SCHEDULES), name
    assert default_of(ParallelismConfig.__dataclass_fields__["pipeline_parallel_schedule"]) in choices


def test_even_split_gives_extra_layers_to_early_stages():
    assert as_lists(stage_layers(pp_config(schedule="GPipe"), 6)) == [[0, 1, 2], [3, 4, 5]]
    assert as_lists(stage_layers(pp_config(schedule="Interleaved1F1B"), 6)) == [[0, 1], [2, 3], [4], [5]]
    assert as_lists(stage_layers(pp_config(degree=3, schedule="ZBVZeroBubble"), 6)) == [[i] for i in range(6)]


def test_split_points_choose_the_stage_boundaries():
    config = pp_config(schedule="Interleaved1F1B", points="layers.1,layers.2,layers.5")
    assert as_lists(stage_layers(config, 6)) == [[0], [1], [2, 3, 4], [5]]
    # Looped multi-stage schedules take any multiple of the degree: 3 stages per rank here.
    config = pp_config(schedule="LoopedBFS", points="layers.1,layers.2,layers.3,layers.4,layers.5")
    assert as_lists(stage_layers(config, 6)) == [[i] for i in range(6)]


def test_stage_ids_loop_and_v():
    assert stage_ids(0, 2, 1, "1F1B") == [0]
    assert stage_ids(1, 4, 2, "Interleaved1F1B") == [1, 5]
    assert stage_ids(0, 2, 2, "ZBVZeroBubble") == [0, 3]
    assert stage_ids(1, 2, 2, "DualPipeV") == [1, 2]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"degree": 4, "schedule": "Interleaved1F1B", "batch": 8},
            "parallelism.pipeline_parallel_degree: Interleaved1F1B on 4 ranks makes 8 stages but the model "
            "has only 6 layers",
        ),
        ({"degree": 8, "schedule": "GPipe", "batch": 8}, "makes 8 stages but the model has only 6 layers"),
        (
            {"points": "layers.9"},
            "parallelism.pipeline_parallel_split_points: 'layers.9' is not a layer that can start a stage; "
            "use layers.1 to layers.5",
        ),
        ({"points": "layer.3"}, "'layer.3' is not a layer that can start a stage"),
        ({"points": "layers.0"}, "'layers.0' is not a layer that can start a stage"),
        (
            {"schedule": "Interleaved1F1B", "points": "layers.4,layers.2,layers.5"},
            "must be in increasing order without repeats",
        ),
        ({"points": "layers.2,layers.4"}, "2 points make 3 stages but 1F1B on 2 ranks needs 2 stages"),
        (
            {"schedule": "ZBVZeroBubble", "points": "layers.3"},
            "1 points make 2 stages but ZBVZeroBubble on 2 ranks needs 4 stages",
        ),
        (
            {"schedule": "Interleaved1F1B", "points": "layers.2,layers.4"},
            "needs a multiple of 2 stages",
        ),
        (
            {"microbatches": 3},
            "parallelism.pipeline_parallel_microbatches: 3 micro-batches do not divide training.batch_size 4",
        ),
        ({"schedule": "Interleaved1F1B", "batch": 6}, "4 micro-batches do not divide training.batch_size 6"),
    ],
)
def test_bad_pipeline_layout_is_a_one_line_error(kwargs, message):
    with pytest.raises(ConfigError) as err:
        check_pipeline(pp_config(**kwargs), n_layers=6)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_split_backward_schedules_refuse_compile():
    config = pp_config(schedule="ZBVZeroBubble")
    config.training.compile = True
    with pytest.raises(ConfigError, match="ZBVZeroBubble cannot run compiled blocks; set training.compile"):
        check_pipeline(config, n_layers=6)
    config.parallelism.pipeline_parallel_schedule = "Interleaved1F1B"
    check_pipeline(config, n_layers=6)


def test_unknown_schedule_is_a_config_error():
    with pytest.raises(ConfigError, match="pipeline_parallel_schedule: 'Zigzag' is not one of GPipe, 1F1B"):
        parse_args(["--parallelism.pipeline_parallel_schedule", "Zigzag"])


def test_stages_keep_fqns_and_get_the_one_process_weights():
    """Stages split from a meta model hold disjoint parts of it under the whole model's FQNs, and
    the seeded init gives each the weights of the whole model; merged back, they are the model."""
    whole = Transformer(TINY)
    whole.init_weights(seed=3)
    expected = dict(whole.named_parameters())
    with torch.device("meta"):
        meta = Transformer(TINY)
    config = pp_config(schedule="Interleaved1F1B")
    layers = stage_layers(config, TINY.n_layers)
    stages = [split_model(meta, r, i == 0, i == len(layers) - 1) for i, r in enumerate(layers)]
    seen = []
    for stage in stages:
        stage.to_empty(device="cpu")
        stage.init_weights(seed=3)
        for name, param in stage.named_parameters():
            torch.testing.assert_close(param, expected[name], rtol=0, atol=0)
            seen.append(name)
    assert sorted(seen) == sorted(expected)

    merged = merge_model_parts([stages[0], stages[3]])  # the V-shaped pair of rank 0
    assert [n for n, _ in merged.named_parameters()] == (
        ["tok_embeddings.weight"]
        + [n for n in expected if n.startswith(("layers.0.", "layers.1.", "layers.5."))]
        + ["norm.weight", "output.weight"]
    )

    tokens = torch.randint(0, TINY.vocab_size, (2, 8))
    h = tokens
    for stage in stages:
        h = stage(h)
    torch.testing.assert_close(h, whole(tokens), rtol=0, atol=0)


def test_default_microbatches_is_the_number_of_stages():
    assert JobConfig().parallelism.pipeline_parallel_microbatches is None
    check_pipeline(pp_config(schedule="Interleaved1F1B", batch=4), n_layers=6)  # 4 stages, 4 micro-batches


# End-to-end under torchrun: 1 process with batch 4 against pipeline layouts with the same global
# batch. name: (processes, per-rank batch, overrides). The schedules of more than one stage per rank run
# the debug model on 4 blocks (tests/launch.py's tiny job has 2), a block per stage, against one process on 4.
FOUR_LAYERS = ["--model.n_layers", "4"]
LAYOUTS = {
    # Batches of 3 sequences, validated on 4 (launch.VALIDATION_BATCH's, the references'): the schedule
    # evaluates them in the training shape, 3 and then 1 filled up with 2 rows without targets.
    "gpipe": (
        2,
        3,
        [
            "--parallelism.pipeline_parallel_schedule",
            "GPipe",
            "--parallelism.pipeline_parallel_microbatches",
            "3",
            "--validation.batch_size",
            "4",
        ],
    ),
    # 1F1B with 4 micro-batches and Interleaved1F1B with split points: test_parity.py's Qwen3 layouts.
    "looped_bfs": (2, 4, ["--parallelism.pipeline_parallel_schedule", "LoopedBFS", *FOUR_LAYERS]),
    # With the chunked loss: the last stage outputs its final hidden states, its loss projects them.
    "interleaved_zero_bubble_chunked_loss": (
        2,
        4,
        [
            "--parallelism.pipeline_parallel_schedule",
            "InterleavedZeroBubble",
            "--training.loss_chunk_tokens",
            "48",
            *FOUR_LAYERS,
        ],
    ),
    "zbv_zero_bubble": (2, 4, ["--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble", *FOUR_LAYERS]),
    "dual_pipe_v": (2, 4, ["--parallelism.pipeline_parallel_schedule", "DualPipeV", *FOUR_LAYERS]),
    "pp2_fsdp2": (
        4,
        2,
        [
            "--parallelism.pipeline_parallel_schedule",
            "Interleaved1F1B",
            "--parallelism.pipeline_parallel_microbatches",
            "2",
            *FOUR_LAYERS,
        ],
    ),
    "pp2_tp2": (4, 4, ["--parallelism.tensor_parallel_degree", "2"]),
}


def check(result):
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.fixture(scope="module")
def single_process(reference_run):
    """`single_process(global_batch)`: 1 process with that batch, validated (VALIDATION) on a global
    batch of 4: conftest.py's reference_run, shared."""

    def get(global_batch: int, model: tuple[str, ...] = ()) -> tuple[list[dict], dict[int, float]]:
        metrics = reference_run(global_batch, model)
        validation = {m["step"]: m["validation_loss"] for m in metrics if m["validation_loss"] is not None}
        return metrics, validation

    return get


def pipeline_args(layout: str) -> list[str]:
    _, batch, overrides = LAYOUTS[layout]
    return ["--training.batch_size", str(batch), "--parallelism.pipeline_parallel_degree", "2", *overrides]


ZBV_CHECKPOINTS = ["--checkpoint.enable_checkpoint", "true", "--checkpoint.interval", "5"]


@pytest.fixture(scope="module")
def zbv_run(tmp_path_factory):
    """The zbv_zero_bubble layout's run, saving checkpoints at steps 5 and 10 as well: one launch is
    compared with 1 process (test_pipeline_matches_single_process) and resumed from (the checkpoint
    test below)."""
    folder, nproc = tmp_path_factory.mktemp("zbv"), LAYOUTS["zbv_zero_bubble"][0]
    check(run_train(nproc, folder, *pipeline_args("zbv_zero_bubble"), *ZBV_CHECKPOINTS))
    return folder


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pipeline_matches_single_process(tmp_path, single_process, layout, request):
    """Per-step losses and gradient norms (clipping included) equal those of 1 process, and so do the
    validation losses (forward only, through the schedule's evaluation)."""
    validated = layout not in ("zbv_zero_bubble", "dual_pipe_v")  # torch cannot evaluate V schedules
    if layout == "zbv_zero_bubble":
        tmp_path = request.getfixturevalue("zbv_run")
    else:
        extra = VALIDATION if validated else []
        check(run_train(LAYOUTS[layout][0], tmp_path, *pipeline_args(layout), *extra))
    nproc, batch, overrides = LAYOUTS[layout]
    dp = nproc // 2 // (2 if "--parallelism.tensor_parallel_degree" in overrides else 1)
    model = tuple(FOUR_LAYERS) if set(FOUR_LAYERS) <= set(overrides) else ()
    single_process, single_validation = single_process(batch * dp, model)
    pipelined = read_metrics(tmp_path)
    if validated:
        validation = validation_losses(tmp_path)
        assert sorted(validation) == [5, 10]
        for step, loss in single_validation.items():
            assert abs(loss - validation[step]) < 1e-5, (step, loss, validation[step])
    assert [m["step"] for m in pipelined] == list(range(1, 11))
    assert abs(single_process[0]["loss"] - pipelined[0]["loss"]) < 1e-6
    for a, b in zip(single_process, pipelined, strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-5, (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) < 1e-5, (a, b)


def test_pipeline_checkpoint_resumes_bitwise_and_on_one_process(tmp_path, zbv_run):
    """ZBV puts the first and last stages on rank 0: its checkpoint holds two model parts. The run
    that never stopped is zbv_run (10 steps, checkpoints at 5 and 10)."""
    straight = {m["step"]: m["loss"] for m in read_metrics(zbv_run)}
    pp = pipeline_args("zbv_zero_bubble")
    for name, nproc, layout in (("pp", 2, pp), ("one", 1, ["--training.batch_size", "4", *FOUR_LAYERS])):
        shutil.copytree(zbv_run / "checkpoint/step-5", tmp_path / name / "checkpoint/step-5")
        result = run_train(nproc, tmp_path / name, *layout, *ZBV_CHECKPOINTS)
        check(result)
        assert "Resumed from step 5" in result.stdout
        resumed = {m["step"]: m["loss"] for m in read_metrics(tmp_path / name)}
        assert sorted(resumed) == [6, 7, 8, 9, 10]
        for step, loss in resumed.items():
            if name == "pp":
                assert loss == straight[step], (step, loss, straight[step])
            else:
                assert abs(loss - straight[step]) < 1e-5, (step, loss, straight[step])


def test_bad_pipeline_layout_stops_train_py_with_one_line(tmp_path):
    result = run_train(
        2,
        tmp_path,
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_split_points",
        "layers.7",
    )
    assert result.returncode != 0
    assert (
        "error: parallelism.pipeline_parallel_split_points: 'layers.7' is not a layer that can start a stage"
        in result.stderr
    )
