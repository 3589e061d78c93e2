"""A loss term added through the objective alone (torchtitan/objective/): the z-loss
(`training.z_loss_weight`, objective/z_loss.py) is its option, its class and its place in TERMS. On one
process its value and gradients are its formula's, written out here; on FSDP 2 and on PP 2 (GPipe, two
micro-batches) its step equals one process's: the loss, the logged z-loss and every gradient, in fp32,
with rows of unequal targets (a rank's mean over its own targets would differ)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from launch import spawn_forked
from one_process import objective_of, one_process_step, step_of

from torchtitan.config.options import ConfigError
from torchtitan.config.parser import parse_args
from torchtitan.datasets.layout import IGNORE_INDEX, Batch
from torchtitan.models.init import clean_fqn
from torchtitan.models.llama import ModelArgs
from torchtitan.models.llama.model import Transformer
from torchtitan.parallelisms.parallel_dims import ParallelDims
from torchtitan.train_step import parallelize_model

ARGS = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, max_seq_len=16)
WEIGHT = 0.1  # large, so that its gradient shows
FP32 = ("--training.mixed_precision_param", "float32", "--training.z_loss_weight", str(WEIGHT))


def job(*argv: str):
    return parse_args(["--training.batch_size", "4", "--training.seq_len", "16", *FP32, *argv])


def tokens() -> torch.Tensor:
    """The step's global batch: 4 rows of 16 tokens and their next ones."""
    return torch.randint(0, ARGS.vocab_size, (4, 17), generator=torch.Generator().manual_seed(0))


def build() -> torch.nn.Module:
    with torch.device("meta"):
        model = Transformer(ARGS)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    return model


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def test_one_process_z_loss_is_its_formula():
    """Two micro-batches of 2 rows: the gradient of the mean cross entropy plus WEIGHT x the mean over
    every token of logsumexp(logits)^2; the logged z_loss is that mean."""
    batch = tokens()
    reference = build()
    logits = reference(batch[:, :-1])
    z_loss = torch.logsumexp(logits, -1).square().mean()
    (F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()) + WEIGHT * z_loss).backward()

    model = build()
    step = one_process_step(model, job("--training.batch_size", "2", "--training.global_batch_size", "4"))
    step.forward_backward(iter([Batch.of_windows(batch[:2]), Batch.of_windows(batch[2:])]))
    assert abs(step.objective.step_done()["z_loss"].item() - z_loss.item()) < 1e-5
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--training.loss_chunk_tokens", "8"), "training.z_loss_weight: the z-loss needs the whole logits"),
        (("--parallelism.tensor_parallel_degree", "2"), "training.z_loss_weight: the z-loss does not run"),
    ],
    ids=["chunked loss", "tensor parallel"],
)
def test_where_the_logits_are_not_whole_it_is_one_line(argv, message):
    with pytest.raises(ConfigError, match=message) as refused:
        objective_of(job(*argv), ARGS)
    assert "\n" not in str(refused.value)


def _step(dims: ParallelDims | None, config) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """One step on `dims` (one process when None): its loss, logged z-loss and full gradients."""
    mesh = dims.build_mesh("cpu") if dims is not None else None
    objective = objective_of(config, ARGS, dims, mesh)
    with torch.device("meta"):
        model = Transformer(ARGS)
    model_parts, pipeline = parallelize_model(
        model, mesh, dims or ParallelDims(dp_shard=1, world_size=1), config, torch.device("cpu"), objective
    )
    for part in model_parts:
        part.to_empty(device="cpu")
        part.init_weights(seed=0)
    step = step_of(model_parts, config, dims, mesh, pipeline, objective)
    batch = Batch.of_windows(tokens()).map(torch.clone)
    batch.labels[0, :10] = IGNORE_INDEX  # rows with unequal targets: a rank's mean is not the step's
    if dims is not None and dims.dp_enabled:  # each data-parallel rank its rows
        rank = dist.get_rank()
        batch = batch.map(lambda t: t[2 * rank : 2 * rank + 2])
    loss = step.forward_backward(iter([batch]))
    if dims is not None:
        for group in (objective.meshes.pp, objective.meshes.dp):
            if group is not None:  # the last stage's loss to every stage; the ranks' mean
                dist.all_reduce(loss, group=group.get_group())
        loss = loss / (objective.meshes.dp.size() if objective.meshes.dp is not None else 1)
    grads = {clean_fqn(n): full(p.grad) for part in model_parts for n, p in part.named_parameters()}
    return loss, objective.step_done()["z_loss"], grads


def _layouts_worker(rank: int, world_size: int, tmp_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp_dir}/store", rank=rank, world_size=world_size)
    try:
        pp = (
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_schedule",
            "GPipe",
        )
        results = {
            "fsdp2": _step(ParallelDims(dp_shard=2, world_size=2), job("--training.batch_size", "2")),
            "pp2": _step(ParallelDims(dp_shard=1, pp=2, world_size=2), job(*pp)),
        }
        torch.save(results, f"{tmp_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_fsdp2_and_pp2_equal_one_process(tmp_path):
    loss, z_loss, grads = _step(None, job())
    spawn_forked(_layouts_worker, 2, 2, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(2)]
    for layout in ("fsdp2", "pp2"):
        layout_grads = {}
        for rank in ranks:
            rank_loss, rank_z_loss, rank_grads = rank[layout]
            torch.testing.assert_close(rank_loss, loss, rtol=0, atol=1e-6, msg=layout)
            # log(Z)^2 is ~25 here: fp32's summation order moves it by ~1e-7 relative.
            torch.testing.assert_close(rank_z_loss, z_loss, rtol=1e-6, atol=0, msg=layout)
            layout_grads.update(rank_grads)  # each pipeline rank its stage's
        assert layout_grads.keys() == grads.keys(), layout
        for name, grad in grads.items():
            torch.testing.assert_close(layout_grads[name], grad, rtol=0, atol=1e-6, msg=f"{layout} {name}")
