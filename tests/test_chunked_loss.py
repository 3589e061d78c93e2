"""training.loss_chunk_tokens: the chunked output projection + cross entropy equals the unfused one.

With TP (vocabulary shards, sequence parallel or not) and PP, within 1e-6 of the unfused step on the
same layout: test_parallelisms.py's mesh run (test_chunked_loss_*), so that no launch is added."""

import pytest
import torch
from one_process import one_process_step
from test_model import build

from scripts.parity_layouts import AC_OP, BLOCK_CAUSAL, CHUNKED_LOSS, COMPILE, QWEN3_MOE_BOTH, Layout, ep
from scripts.parity_matrix import run_layout
from torchtitan.config.parser import parse_args
from torchtitan.config_rules import check_layout
from torchtitan.datasets.layout import Batch
from torchtitan.models.llama import ModelArgs
from torchtitan.train_step import TrainStep

ARGS = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=131, max_seq_len=32)


def step_of(chunk: int, global_batch: int = -1) -> tuple[torch.nn.Module, TrainStep]:
    model = build(ARGS)
    job = parse_args(
        [
            "--training.batch_size",
            "2",
            "--training.global_batch_size",
            str(global_batch),
            "--training.loss_chunk_tokens",
            str(chunk),
            "--training.mixed_precision_param",
            "float32",
        ]
    )
    return model, one_process_step(model, job)


def batches(n: int):
    generator = torch.Generator().manual_seed(0)
    for _ in range(n):
        tokens = torch.randint(0, ARGS.vocab_size, (2, 26), generator=generator)
        yield Batch.of_windows(tokens)


@pytest.mark.parametrize("chunk", [1, 7, 16, 50, 64])  # 50 tokens per micro-batch: 7 does not divide it
def test_loss_and_gradients_equal_the_unfused_ones(chunk):
    """Two micro-batches (gradient accumulation) of 2 x 25 tokens, fp32, on CPU."""
    losses, grads = {}, {}
    for c in (0, chunk):
        model, step = step_of(c, global_batch=4)
        losses[c] = step.forward_backward(batches(2))
        grads[c] = {name: p.grad for name, p in model.named_parameters()}
        assert all(g is not None for g in grads[c].values())
    torch.testing.assert_close(losses[chunk], losses[0], atol=1e-6, rtol=0)
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[chunk][name], grad, atol=1e-6, rtol=0, msg=name)


def test_evaluation_equals_the_unfused_one():
    (_, unfused), (_, chunked) = step_of(0), step_of(7)
    evaluations = [
        step.objective.mean_over_ranks(*step.evaluate(batches(2))[:2]) for step in (chunked, unfused)
    ]
    torch.testing.assert_close(*evaluations)


def test_autocast_projects_in_its_dtype():
    """Under autocast the chunks' matmuls run in bf16, as the output projection's do."""
    _, step = step_of(7)
    step.autocast = step.objective.autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    inputs, labels, _ = step._prepare(next(batches(1)))
    step.objective.begin_step([labels])
    chunked = step._model_loss(inputs, labels, {}, training=True)
    step.objective.chunk_tokens, step.skip_output = 0, False
    unfused = step._model_loss(inputs, labels, {}, training=True)
    torch.testing.assert_close(chunked, unfused, atol=1e-5, rtol=0)


def test_loss_parallel_and_pipeline_parallelism_are_accepted():
    tp_pp = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.pipeline_parallel_degree", "2"]
    job_config = parse_args(["--training.loss_chunk_tokens", "64", *tp_pp])
    assert job_config.parallelism.enable_loss_parallel
    check_layout(job_config, world_size=4)


# Qwen3-MoE compiled under EP (its dense first block whole, its MoE blocks around the expert dispatch, the
# experts' FSDP unit gathering again in the recompute): the compile + selective AC path with the chunked
# loss. Qwen3 with TP, loss parallel, gradient accumulation and selective AC, FSDP over context-parallel
# ranks, with the chunked loss: test_parity.py.
CHUNKED_LAYOUTS = [
    Layout(
        "Qwen3-MoE aux + bias, block_causal: EP 2 + compile + AC selective op + chunked loss",
        2,
        2,
        4,
        ep(2) + COMPILE + AC_OP + CHUNKED_LOSS,
        (*QWEN3_MOE_BOTH, *BLOCK_CAUSAL),
    ),
]


def test_chunked_runs_match_the_unfused_single_process_run(tmp_path, reference_run):
    """train.py under torchrun: the chunked loss composed with FSDP (the root kept gathered), expert
    parallelism, compile and selective AC logs the losses, gradient norms and validation losses of the
    unfused 1-process run."""
    for i, layout in enumerate(CHUNKED_LAYOUTS):
        reference = reference_run(layout.global_batch, layout.model)  # shared with test_parity.py
        result = run_layout(layout, tmp_path / str(i), 10, reference)
        assert result.error is None, result.error
        assert result.max_loss_diff <= 1e-5 and result.max_grad_norm_diff <= 1e-5, result
        assert result.max_validation_diff <= 1e-5, result
