"""HSDP, TP/SP, activation checkpointing, compile wrappers and gradient accumulation: the checks that
need no training run (validation, wrappers, init and gradient norms on a mesh, when gradients are
all-reduced, the chunked loss on TP and PP layouts). Loss parity of whole training runs is in
test_parity.py."""

import collections
import contextlib
import gc
import importlib.util
import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from launch import TINY_JOB, run_train_in_process, spawn_forked
from one_process import load_balance, objective_of, step_of
from test_convert import random_model
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils._python_dispatch import TorchDispatchMode

import torchtitan.datasets.tokenizer
import torchtitan.parallelisms.distributed
from torchtitan.checkpoint.hf_reader import load_hf_weights
from torchtitan.config.options import JobConfig, MoEConfig
from torchtitan.config.parser import parse_args
from torchtitan.config_rules import gradient_accumulation_steps
from torchtitan.datasets.layout import Batch
from torchtitan.models.deepseek_v3 import deepseek_v3_configs
from torchtitan.models.deepseek_v3.model import Transformer as DeepSeekV3Transformer
from torchtitan.models.init import clean_fqn
from torchtitan.models.llama import ModelArgs
from torchtitan.models.llama.model import Transformer
from torchtitan.models.moe import MoE
from torchtitan.models.qwen3 import Qwen3ModelArgs
from torchtitan.models.qwen3.model import Transformer as Qwen3Transformer
from torchtitan.models.qwen3_moe import Qwen3MoeModelArgs
from torchtitan.models.qwen3_moe.model import Transformer as Qwen3MoeTransformer
from torchtitan.objective.chunked_cross_entropy import chunked_cross_entropy
from torchtitan.parallelisms.context_parallel import load_balanced_positions
from torchtitan.parallelisms.distributed import clip_grad_norm_
from torchtitan.parallelisms.parallel_dims import Meshes, ParallelDims
from torchtitan.parallelisms.parallelize import (
    apply_ac,
    apply_compile,
    fsdp_mesh,
    parallelize,
    set_grad_all_reduce,
)
from torchtitan.train_step import TrainStep, parallelize_model

TINY = ModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=16)
# Tied embeddings and per-head q/k norms; head_dim 32 is not dim / n_heads.
QWEN3_TINY = Qwen3ModelArgs(
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=32,
    hidden_dim=96,
    vocab_size=128,
    max_seq_len=16,
    tie_word_embeddings=True,
)
# Qwen3-MoE: 4 experts of which each token takes 2, both layers sparse.
MOE_TINY = Qwen3MoeModelArgs(
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=16,
    hidden_dim=96,
    vocab_size=128,
    max_seq_len=16,
    num_experts=4,
    top_k=2,
    moe_hidden_dim=32,
)
# DeepSeek-V3: a dense layer, then 4 experts in 2 groups (a q LoRA, YaRN: the debug flavour, smaller).
DSV3_TINY = replace(
    deepseek_v3_configs["debugmodel"],
    dim=64,
    n_layers=2,
    hidden_dim=96,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    num_experts=4,
    moe_hidden_dim=32,
    vocab_size=128,
    max_seq_len=16,
)
WORST_CASE_BIAS = [10.0, 10.0, 0.0, 0.0]  # every token to experts 0 and 1, both on EP rank 0
SEED = 3

# ---------------------------------------------------------------------------------------------
# Impossible layouts fail before any work, through train.py's own path (in-process)


PP2 = ["--parallelism.pipeline_parallel_degree", "2"]


@pytest.mark.parametrize(
    "world_size, argv, message",
    [
        (4, ["--parallelism.tensor_parallel_degree", "3"], "world size 4 is not divisible by the product"),
        (
            2,
            ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2"],
            "degrees multiply to 4 (data_parallel_replicate_degree 1 x data_parallel_shard_degree 2 x "
            "context_parallel_degree 1 x tensor_parallel_degree 2 x pipeline_parallel_degree 1) but the "
            "world size is 2",
        ),
        (
            3,
            ["--parallelism.tensor_parallel_degree", "3"],
            "3 does not divide the model's 16 attention heads",
        ),
        (
            2,
            ["--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "63"],
            "training.seq_len: 63 is not divisible by tensor_parallel_degree 2",
        ),
        (
            2,
            [
                "--parallelism.tensor_parallel_degree",
                "2",
                "--training.compile",
                "true",
                "--parallelism.enable_async_tensor_parallel",
                "true",
            ],
            "enable_async_tensor_parallel: needs CUDA",
        ),
        (
            1,
            ["--training.batch_size", "4", "--training.global_batch_size", "6"],
            "training.global_batch_size: 6 is not a multiple of batch_size x DP degree = 4 x 1",
        ),
        (
            2,
            ["--training.batch_size", "2", "--training.global_batch_size", "2"],
            "training.global_batch_size: 2 is not a multiple of batch_size x DP degree = 2 x 2",
        ),
        (
            1,
            ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "x"],
            "activation_checkpoint.selective_ac_option: expected 'op' or a positive integer, got 'x'",
        ),
        (
            2,
            [
                *PP2,
                "--parallelism.pipeline_parallel_schedule",
                "ZBVZeroBubble",
                "--validation.enable",
                "true",
                "--model.n_layers",
                "4",
            ],
            "validation.enable: torch's pipeline evaluation (schedule.eval) cannot run ZBVZeroBubble",
        ),
        (
            4,
            ["--validation.global_batch_size", "6"],
            "validation.global_batch_size: 6 is not a multiple of the data-parallel degree 4",
        ),
        (
            1,
            ["--validation.global_batch_size", "8", "--validation.batch_size", "2"],
            "validation.global_batch_size: set it or validation.batch_size, not both",
        ),
        (
            1,
            ["--validation.steps", "0"],
            "validation.steps: 0 evaluates nothing; use -1 or a positive number",
        ),
        (1, ["--model.attn_mask_type", "document"], "model.attn_mask_type"),
    ],
)
def test_impossible_layout_fails_before_any_work(monkeypatch, capsys, world_size, argv, message):
    def too_late(*args, **kwargs):
        raise AssertionError("the layout was not rejected before the work started")

    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    init = lambda timeout: (world_size, 0, torch.device("cpu"))  # noqa: E731
    monkeypatch.setattr(torchtitan.parallelisms.distributed, "init_distributed", init)
    monkeypatch.setattr(ParallelDims, "build_mesh", too_late)
    monkeypatch.setattr(torchtitan.datasets.tokenizer, "Tokenizer", too_late)
    assert run_train_in_process(*TINY_JOB, *argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1, err


def test_gradient_accumulation_steps():
    dims = ParallelDims(dp_shard=2, dp_replicate=2, world_size=4)
    config = parse_args(["--training.batch_size", "2"])
    assert gradient_accumulation_steps(config.training, dims) == 1
    config.training.global_batch_size = 8
    assert gradient_accumulation_steps(config.training, dims) == 1
    config.training.global_batch_size = 24
    assert gradient_accumulation_steps(config.training, dims) == 3


# ---------------------------------------------------------------------------------------------
# Activation checkpointing and compile wrappers (one process)


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


def _backward_ops(mode: str, option: str) -> collections.Counter[str]:
    """Ops run by backward: with checkpointing they include the recomputed forward ops."""
    torch.manual_seed(0)
    model = Transformer(TINY)
    if mode != "none":
        apply_ac(model, mode, option)
    loss = model(torch.randint(0, TINY.vocab_size, (2, 16))).sum()
    with _CountOps() as ops:
        loss.backward()
    return ops.counts


def test_activation_checkpointing_recomputes_what_the_mode_says():
    sdpa = "_scaled_dot_product_flash_attention_for_cpu"
    none, full = _backward_ops("none", "1"), _backward_ops("full", "1")
    op, every_2 = _backward_ops("selective", "op"), _backward_ops("selective", "2")
    assert none[sdpa] == 0 and full[sdpa] == TINY.n_layers  # attention recomputed in every block
    assert every_2[sdpa] == TINY.n_layers // 2  # ... in every other block
    assert op[sdpa] == 0  # ... saved by op-level selective AC
    recomputed_mm = {name: c["mm"] - none["mm"] for name, c in [("full", full), ("op", op), ("2", every_2)]}
    assert recomputed_mm["full"] > 0
    assert recomputed_mm["op"] == recomputed_mm["full"] // 2  # every other matmul is saved
    assert recomputed_mm["2"] == recomputed_mm["full"] // 2


def test_every_nth_block_is_checkpointed_by_layer_id():
    model = Transformer(TINY)
    apply_ac(model, "selective", "2")
    wrapped = [i for i, block in model.layers.items() if hasattr(block, "_checkpoint_wrapped_module")]
    assert wrapped == ["1", "3"]


@pytest.mark.parametrize("mode, option", [("full", "1"), ("selective", "op"), ("selective", "3")])
def test_wrappers_keep_checkpoint_fqns(mode, option):
    with torch.device("meta"):
        plain, wrapped = Transformer(TINY), Transformer(TINY)
    apply_ac(wrapped, mode, option)
    apply_compile(wrapped)
    assert any("_orig_mod._checkpoint_wrapped_module" in name for name, _ in wrapped.named_parameters())
    assert {clean_fqn(name) for name, _ in wrapped.named_parameters()} == set(dict(plain.named_parameters()))
    assert set(get_model_state_dict(wrapped)) == set(get_model_state_dict(plain))


# ---------------------------------------------------------------------------------------------
# On a mesh of 4 processes (gloo): TP/SP and FSDP x TP init and gradient norms, when HSDP and DDP
# all-reduce gradients, and the chunked loss (training.loss_chunk_tokens) on TP and PP layouts


def _config(**parallelism) -> JobConfig:
    config = JobConfig()
    config.training.mixed_precision_param = "float32"
    for name, value in parallelism.items():
        setattr(config.parallelism, name, value)
    return config


def _build(args: ModelArgs, world_mesh, dims: ParallelDims, config: JobConfig, cls=Transformer) -> nn.Module:
    with torch.device("meta"):
        model = cls(args)
    if world_mesh is not None:
        parallelize(model, world_mesh, dims, config)
    model.to_empty(device="cpu")
    model.init_weights(SEED)
    return model


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """train.py's loss: mean next-token cross entropy."""
    return F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten())


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def _loss_and_grads(model: nn.Module, tokens: torch.Tensor, loss_parallel_enabled: bool):
    """Loss, clipped-norm and full gradients after one forward/backward (as train.py computes them)."""
    with loss_parallel() if loss_parallel_enabled else contextlib.nullcontext():
        loss = _loss(model, tokens)
        loss.backward()
    norm = clip_grad_norm_([p for p in model.parameters()], max_norm=0.0)
    grads = {clean_fqn(n): _full(p.grad) for n, p in model.named_parameters()}
    return _full(loss), norm, grads


class _CountCollectives:
    """Counts gloo all-reduces and reduce-scatters, as FSDP2 issues them (through torch.distributed)."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        for name in ("all_reduce", "reduce_scatter_single"):
            original = getattr(dist, name)
            setattr(dist, name, self._counting(name, original))

    def _counting(self, name, original):
        def wrapper(*args, **kwargs):
            self.counts[name] += 1
            return original(*args, **kwargs)

        return wrapper


def _accumulate(model: nn.Module, batches: torch.Tensor, counter: _CountCollectives) -> list[dict[str, int]]:
    """Two micro-batches as train.py runs them; the collectives each backward issued."""
    per_microbatch = []
    for i, tokens in enumerate(batches):
        set_grad_all_reduce(model, i == len(batches) - 1)
        counter.counts.clear()
        (_loss(model, tokens) / len(batches)).backward()
        per_microbatch.append(dict(counter.counts))
    return per_microbatch


def _chunked_function_diffs(tp_mesh) -> dict[str, list[float]]:
    """chunked_cross_entropy with a vocabulary-sharded weight (131 rows over 2 ranks: 66 + 65) and
    hidden states sharded along the sequence (sequence parallel) or replicated, against the unfused
    cross entropy on one process: max |difference| of the loss and of the hidden states' and the
    weight's gradients, for chunks of 7 (not dividing the 2 x 16 tokens) and 64 tokens."""
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 16, 32, generator=generator)
    weight = torch.randn(131, 32, generator=generator) / 4
    labels = torch.randint(0, 131, (2, 16), generator=generator)
    reference = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
    loss = F.cross_entropy((reference[0] @ reference[1].T).flatten(0, 1), labels.flatten())
    loss.backward()
    diffs = {}
    for layout in ("sequence_parallel", "replicated"):
        for chunk in (7, 64):
            h = distribute_tensor(hidden, tp_mesh, [Shard(1)]) if layout == "sequence_parallel" else hidden
            inputs = [
                h.clone().requires_grad_(),
                distribute_tensor(weight, tp_mesh, [Shard(0)]).requires_grad_(),
            ]
            chunked = chunked_cross_entropy(*inputs, labels, chunk) / labels.numel()
            chunked.backward()
            grad_diffs = [(_full(x.grad) - r.grad).abs().max() for x, r in zip(inputs, reference)]
            diffs[f"{layout}_{chunk}"] = _max_over_ranks([(chunked - loss).abs(), *grad_diffs])
    return diffs


def _max_over_ranks(diffs: list[torch.Tensor]) -> list[float]:
    """The largest of each difference over the ranks (each holds its own stages and shards)."""
    diffs = torch.stack([d.detach().double() for d in diffs])
    dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
    return diffs.tolist()


def _train_step_results(step: TrainStep, tokens: torch.Tensor):
    """TrainStep's loss, gradients (this rank's local shards) and evaluation loss on one batch."""
    model_parts, batch = step.model_parts, Batch.of_windows(tokens)
    loss = step.forward_backward(iter([batch]))
    grads = {
        clean_fqn(n): p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        for part in model_parts
        for n, p in part.named_parameters()
    }
    evaluation = step.objective.mean_over_ranks(*step.evaluate(iter([batch]))[:2])
    return _full(loss), grads, torch.tensor(evaluation)  # loss parallel's are DTensors


def _chunked_step_diffs(mesh, dims: ParallelDims, tokens: torch.Tensor, **parallelism) -> list[float]:
    """A training step and an evaluation with training.loss_chunk_tokens 5 against the unfused
    ones on the same layout (TrainStep, as train.py runs them): max |difference| of the loss, of
    every gradient (on every rank) and of the evaluation loss."""
    results = []
    for chunk in (0, 5):
        config = _config(**parallelism)
        config.training.batch_size, config.training.loss_chunk_tokens = tokens.shape[0], chunk
        with torch.device("meta"):
            model = Transformer(TINY)
        objective = objective_of(config, TINY, dims, mesh)
        model_parts, pipeline = parallelize_model(model, mesh, dims, config, torch.device("cpu"), objective)
        for part in model_parts:
            part.to_empty(device="cpu")
            part.init_weights(SEED)
        step = step_of(model_parts, config, dims, mesh, pipeline, objective)
        results.append(_train_step_results(step, tokens))
    (loss, grads, evaluation), (chunked_loss, chunked_grads, chunked_evaluation) = results
    assert grads.keys() == chunked_grads.keys() and grads
    grad_diff = max((chunked_grads[n] - g).abs().max() for n, g in grads.items())
    return _max_over_ranks([(chunked_loss - loss).abs(), grad_diff, (chunked_evaluation - evaluation).abs()])


# The sequence-wise balance loss's weight in the MoE steps below: large, so that its gradient shows.
SEQUENCE_AUX = 0.1


def _moe_step(model: nn.Module, tokens: torch.Tensor, dp_mesh, worst_case: bool, tp_mesh=None) -> tuple:
    """One step's loss (the mean over the data-parallel ranks), auxiliary losses (the batch-wise and
    the sequence-wise one, their logged metrics) and full gradients of a mixture-of-experts model, the
    losses' statistics over `dp_mesh`'s and `tp_mesh`'s ranks; `worst_case`: every token routed to the
    experts of the first EP rank."""
    if worst_case:
        with torch.no_grad():
            for moe in (m for m in model.modules() if isinstance(m, MoE)):
                moe.expert_bias.copy_(torch.tensor(WORST_CASE_BIAS))
    config = MoEConfig(sequence_aux_loss_weight=SEQUENCE_AUX)
    balance = load_balance(model, config, Meshes(None, None, None, tp=tp_mesh, dp_cp=dp_mesh))
    loss = _loss(model, tokens)
    (loss + 0.001 * balance.aux_loss() + SEQUENCE_AUX * balance.sequence_aux_loss()).backward()
    metrics = balance.step_done()
    loss = loss.detach()
    if dp_mesh is not None:
        dist.all_reduce(loss, group=dp_mesh.get_group())
        loss /= dp_mesh.size()
    grads = {clean_fqn(n): _full(p.grad) for n, p in model.named_parameters()}
    return loss, metrics["aux_loss"], metrics["seq_aux_loss"], grads


def _sequence_loss_step(mesh=None, dims: ParallelDims | None = None) -> tuple:
    """A DeepSeek-V3 mixture-of-experts layer (sigmoid scores in 2 groups) on 4 sequences of 16 tokens:
    the logged sequence-wise balance loss and the router's full gradient of a mean over the tokens
    plus that loss. With `mesh` (dp_shard x cp), each dp rank holds 2 of the sequences and each cp rank
    its tokens of them as context parallelism deals them (the layer acts on each token alone), the
    layer an FSDP unit over dp_shard x cp as a block is under CP (its gradients averaged over both)."""
    torch.manual_seed(SEED)
    moe = MoE(dim=16, hidden_dim=8, num_experts=4, top_k=2, score_func="sigmoid", n_group=2)
    with torch.no_grad():
        for param in moe.parameters():
            param.normal_(0.0, 0.3)
    part = nn.Sequential(moe)
    part.model_args = replace(DSV3_TINY, top_k=2, num_experts=4)
    x = torch.randn(4, 16, 16, generator=torch.Generator().manual_seed(6))
    dp = cp = None
    if mesh is not None:
        dp, cp = mesh["dp_shard"], mesh["cp"]
        positions = load_balanced_positions(16, cp.size(), cp.get_local_rank())
        x = x[2 * dp.get_local_rank() : 2 * dp.get_local_rank() + 2][:, positions]
        fully_shard(part, mesh=fsdp_mesh(mesh, dims))
    config = MoEConfig(aux_loss_weight=0.0, sequence_aux_loss_weight=1.0)
    balance = load_balance(part, config, Meshes(None, None, None, cp=cp, dp_cp=dp))
    (part(x).pow(2).mean() + balance.sequence_aux_loss()).backward()
    return balance.step_done()["seq_aux_loss"], _full(moe.router.weight.grad)


def _bf16_step(args, cls, dims: ParallelDims | None, tokens: torch.Tensor, **parallelism) -> tuple:
    """One bf16 training step (TrainStep: autocast, and FSDP/DDP's mixed precision) of a model whose norm
    weights were moved off 1 by less than bf16's step there: its loss and full gradients."""
    config = _config(**parallelism)
    config.training.mixed_precision_param, config.training.batch_size = "bfloat16", tokens.shape[0]
    config.model.name = "qwen3" if cls is Qwen3Transformer else "llama3"
    mesh = dims.build_mesh("cpu") if dims else None
    model = _build(args, mesh, dims, config, cls)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.003)
    step = step_of([model], config, dims, mesh)
    loss = step.forward_backward(iter([Batch.of_windows(tokens)]), microbatches=1)
    return _full(loss), {clean_fqn(n): _full(p.grad) for n, p in model.named_parameters()}


def _mesh_worker(rank: int, world_size: int, tmp_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp_dir}/store", rank=rank, world_size=world_size)
    try:
        results = {}
        tokens = torch.randint(0, TINY.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
        for case, dims in {
            "tp": ParallelDims(dp_shard=1, dp_replicate=2, tp=2, world_size=4, enable_loss_parallel=True),
            "fsdp_tp": ParallelDims(dp_shard=2, tp=2, world_size=4, enable_loss_parallel=True),
            "fsdp_tp_gathered": ParallelDims(dp_shard=2, tp=2, world_size=4, enable_loss_parallel=False),
        }.items():
            mesh = dims.build_mesh("cpu")
            config = _config(tensor_parallel_degree=2, enable_loss_parallel=dims.enable_loss_parallel)
            # "tp": TP only; each dp_replicate group works on its own (no data parallelism applied).
            model_dims = replace(dims, dp_replicate=1, world_size=2) if case == "tp" else dims
            model = _build(TINY, mesh, model_dims, config)
            results[case] = {clean_fqn(n): _full(p) for n, p in model.named_parameters()}
            results[f"{case}_placements"] = {
                clean_fqn(n): tuple(p.placements) for n, p in model.named_parameters()
            }
            # Every dp rank gets the same batch, so the dp-averaged gradients are its gradients.
            results[f"{case}_step"] = _loss_and_grads(model, tokens, dims.loss_parallel_enabled)
            results[f"{case}_local_shapes"] = {
                clean_fqn(n): (p.to_local().shape, p.grad.to_local().shape)
                for n, p in model.named_parameters()
            }
            if case == "tp":
                results["chunked_function"] = _chunked_function_diffs(mesh["tp"])

        # Qwen3 with tied embeddings on FSDP 2 x TP 2: the tied table is one DTensor, the q/k norms see
        # this rank's heads and their gradients are summed over the TP group.
        dims = ParallelDims(dp_shard=2, tp=2, world_size=4, enable_loss_parallel=True)
        config = _config(tensor_parallel_degree=2, enable_loss_parallel=True)
        config.model.name = "qwen3"
        model = _build(QWEN3_TINY, dims.build_mesh("cpu"), dims, config, Qwen3Transformer)
        assert model.output.weight is model.tok_embeddings.weight
        results["qwen3"] = {clean_fqn(n): _full(p) for n, p in model.named_parameters()}
        results["qwen3_placements"] = {clean_fqn(n): tuple(p.placements) for n, p in model.named_parameters()}
        results["qwen3_step"] = _loss_and_grads(model, tokens, loss_parallel_enabled=True)

        # The chunked loss against the unfused one on TP and PP layouts (4 sequences: 4 micro-batches).
        batch = torch.randint(0, TINY.vocab_size, (4, 17), generator=torch.Generator().manual_seed(1))
        fsdp_tp = ParallelDims(dp_shard=2, tp=2, world_size=4, enable_loss_parallel=True)
        pp_tp = ParallelDims(dp_shard=1, pp=2, tp=2, world_size=4, enable_loss_parallel=True)
        pp = ParallelDims(dp_shard=1, dp_replicate=2, pp=2, world_size=4)
        for case, dims, model_dims, parallelism in (
            ("fsdp_tp", fsdp_tp, fsdp_tp, {"tensor_parallel_degree": 2}),
            ("pp_tp", pp_tp, pp_tp, {"tensor_parallel_degree": 2, "pipeline_parallel_degree": 2}),
            # Two pipelines of 2 ranks, 2 stages each; zero bubble splits the backward (input, then weights).
            (
                "pp_zero_bubble",
                pp,
                replace(pp, dp_replicate=1, world_size=2),
                {"pipeline_parallel_degree": 2, "pipeline_parallel_schedule": "InterleavedZeroBubble"},
            ),
        ):
            mesh = dims.build_mesh("cpu")
            results[f"chunked_{case}"] = _chunked_step_diffs(mesh, model_dims, batch, **parallelism)

        # Qwen3-MoE with expert parallelism over 2 of 4 FSDP ranks (the experts FSDP-sharded over the
        # other 2), each rank on its own sequence of the batch; and with every token routed to one rank.
        dims = ParallelDims(dp_shard=4, ep=2, world_size=4)
        mesh = dims.build_mesh("cpu")
        config = _config(expert_parallel_degree=2)
        config.model.name = "qwen3_moe"
        moe_batch = torch.randint(0, MOE_TINY.vocab_size, (4, 17), generator=torch.Generator().manual_seed(2))
        for case, worst_case in (("moe_ep", False), ("moe_ep_worst_case", True)):
            # Worst case with every block's activations recomputed in backward (the all-to-alls too).
            config.activation_checkpoint.mode = "full" if worst_case else "none"
            model = _build(MOE_TINY, mesh, dims, config, Qwen3MoeTransformer)
            results[f"{case}_placements"] = {
                clean_fqn(n): tuple(p.placements) for n, p in model.named_parameters()
            }
            results[case] = _moe_step(model, moe_batch[rank : rank + 1], mesh["dp_shard"], worst_case)
        # Further worst-case steps leave no tensor behind (the routing of each exchange is released).
        live_tensors = []
        for _ in range(4):
            model.zero_grad(set_to_none=True)
            _moe_step(model, moe_batch[rank : rank + 1], mesh["dp_shard"], worst_case=True)
            gc.collect()
            live_tensors.append(sum(torch.is_tensor(o) for o in gc.get_objects()))
        results["moe_ep_live_tensors"] = live_tensors
        # EP 2 with TP 2 on attention: each tp rank routes the tokens of its half of each sequence.
        dims = ParallelDims(dp_shard=2, ep=2, tp=2, world_size=4, enable_loss_parallel=False)
        mesh = dims.build_mesh("cpu")
        config = _config(expert_parallel_degree=2, tensor_parallel_degree=2, enable_loss_parallel=False)
        config.model.name = "qwen3_moe"
        model = _build(MOE_TINY, mesh, dims, config, Qwen3MoeTransformer)
        placements = {clean_fqn(n): tuple(p.placements) for n, p in model.named_parameters()}
        results["moe_ep_tp_placements"] = placements
        dp_rank = mesh["dp_shard"].get_local_rank()
        tokens = moe_batch[dp_rank : dp_rank + 1]
        results["moe_ep_tp"] = _moe_step(model, tokens, mesh["dp_shard"], False, mesh["tp"])
        # DeepSeek-V3 (sigmoid scores in groups, a shared expert, MLA) on FSDP 2 x TP 2: each tp rank
        # routes its half of its dp rank's sequence.
        dims = ParallelDims(dp_shard=2, tp=2, world_size=4, enable_loss_parallel=False)
        mesh = dims.build_mesh("cpu")
        config = _config(tensor_parallel_degree=2, enable_loss_parallel=False)
        config.model.name = "deepseek_v3"
        model = _build(DSV3_TINY, mesh, dims, config, DeepSeekV3Transformer)
        dp_rank = mesh["dp_shard"].get_local_rank()
        tokens = moe_batch[dp_rank : dp_rank + 1]
        results["moe_dsv3_tp"] = _moe_step(model, tokens, mesh["dp_shard"], False, mesh["tp"])
        # The sequence-wise balance loss under CP 2 x FSDP 2: each sequence's counts over its cp ranks.
        dims = ParallelDims(dp_shard=2, cp=2, world_size=4)
        results["moe_cp_sequence_loss"] = _sequence_loss_step(dims.build_mesh("cpu"), dims)

        # bf16 on FSDP 4 (Llama: the embeddings a unit of their own) and DDP 4 (Qwen3, tied embeddings:
        # the root keeps the table), each rank on the same batch.
        tokens = torch.randint(0, TINY.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
        fsdp = ParallelDims(dp_shard=4, world_size=4)
        results["bf16_fsdp"] = _bf16_step(TINY, Transformer, fsdp, tokens)
        results["bf16_fsdp_gathered_in_fp32"] = _bf16_step(
            TINY, Transformer, fsdp, tokens, fsdp_gather_dtype="float32"
        )
        ddp = ParallelDims(dp_shard=1, dp_replicate=4, world_size=4)
        results["bf16_ddp"] = _bf16_step(
            QWEN3_TINY, Qwen3Transformer, ddp, tokens, data_parallel_replicate_degree=4
        )

        # Hugging Face folders (saved by transformers) loaded straight into sharded models: Llama on
        # FSDP 2 x TP 2 (strided dim-0 shards, wq/wk rows reordered per head), Qwen3-MoE's stacked experts
        # on EP 2 over FSDP 4, DeepSeek-V3's on EP 2 x TP 2 (MLA's heads split, its latents replicated);
        # what each rank read of the files.
        for name, args, cls, dims, parallelism in (
            ("llama3", TINY, Transformer, fsdp_tp, {"tensor_parallel_degree": 2}),
            ("qwen3_moe", MOE_TINY, Qwen3MoeTransformer, ParallelDims(dp_shard=4, ep=2, world_size=4),
             {"expert_parallel_degree": 2}),
            ("deepseek_v3", DSV3_TINY, DeepSeekV3Transformer,
             ParallelDims(dp_shard=2, tp=2, ep=2, world_size=4),
             {"tensor_parallel_degree": 2, "expert_parallel_degree": 2}),
        ):  # fmt: skip
            hub = f"{tmp_dir}/hub_{name}"
            if not os.path.isdir(hub):  # without transformers
                continue
            config = _config(**parallelism)
            config.model.name = name
            model = _build(args, dims.build_mesh("cpu"), dims, config, cls)
            reader = load_hf_weights(model, hub, config.model, args)
            results[f"hf_{name}"] = {clean_fqn(n): _full(p) for n, p in model.named_parameters()}
            read = [None] * world_size
            dist.all_gather_object(read, reader.bytes_read)
            results[f"hf_{name}_bytes_read"] = read

        counter = _CountCollectives()
        batches = torch.randint(0, TINY.vocab_size, (2, 2, 17), generator=torch.Generator().manual_seed(rank))
        for case, dims in {
            "hsdp": ParallelDims(dp_shard=2, dp_replicate=2, world_size=4),
            "ddp": ParallelDims(dp_shard=1, dp_replicate=4, world_size=4),
        }.items():
            mesh = dims.build_mesh("cpu")
            config = _config(data_parallel_replicate_degree=dims.dp_replicate)
            model = _build(TINY, mesh, dims, config)
            results[f"{case}_collectives"] = _accumulate(model, batches, counter)
        if rank == 0:
            torch.save(results, f"{tmp_dir}/results.pt")
    finally:
        dist.destroy_process_group()


def _hub_folder(folder: Path, name: str, args: ModelArgs) -> None:
    """A random model of family `name` saved by transformers' save_pretrained (the Hub's layout)."""
    import transformers

    from torchtitan.checkpoint.hf_export import export_hf

    model = random_model(args, name)
    work = folder / name  # the export never writes over a folder: one per family
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(work / "dcp"), no_dist=True)
    export_hf(str(work / "dcp"), str(work / "ours"), args, name=name)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(work / "ours", dtype=torch.float32)
    hf_model.save_pretrained(folder / f"hub_{name}")


@pytest.fixture(scope="module")
def mesh_results(tmp_path_factory):
    tmp_dir = tmp_path_factory.mktemp("mesh4")
    if importlib.util.find_spec("transformers") is not None:
        _hub_folder(tmp_dir, "llama3", TINY)
        _hub_folder(tmp_dir, "qwen3_moe", MOE_TINY)
        _hub_folder(tmp_dir, "deepseek_v3", DSV3_TINY)
    spawn_forked(_mesh_worker, 4, 4, str(tmp_dir))
    results = torch.load(tmp_dir / "results.pt", weights_only=False)
    results["tmp_dir"] = tmp_dir
    return results


@pytest.mark.parametrize("name", ["llama3", "qwen3_moe", "deepseek_v3"])
def test_a_hugging_face_folder_loads_each_rank_its_share(mesh_results, name):
    """checkpoint.initial_load_path as a folder transformers saved (checkpoint/hf_reader.py): the sharded
    model holds exactly the weights of the whole-model conversion (convert_hf_to_dcp.py's), and each of 4
    ranks read about a quarter of the files."""
    pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from torchtitan.models import MODEL_SPECS

    hub = mesh_results["tmp_dir"] / f"hub_{name}"
    files = load_file(hub / "model.safetensors")
    config = json.loads((hub / "config.json").read_text())
    expected = MODEL_SPECS[name].hf().from_hf(files, config)
    loaded = mesh_results[f"hf_{name}"]
    assert loaded.keys() <= expected.keys()
    for fqn, tensor in loaded.items():
        assert torch.equal(tensor, expected[fqn]), fqn
    total = sum(t.numel() * t.element_size() for t in files.values())
    read = mesh_results[f"hf_{name}_bytes_read"]
    assert max(read) <= 0.3 * total and sum(read) >= total, (read, total)


@pytest.fixture(scope="module")
def single():
    model = _build(TINY, None, None, None)
    tokens = torch.randint(0, TINY.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    return {clean_fqn(n): p.detach().clone() for n, p in model.named_parameters()}, _loss_and_grads(
        model, tokens, False
    )


@pytest.mark.parametrize("case", ["tp", "fsdp_tp"])
def test_init_with_tp_matches_single_process(mesh_results, single, case):
    weights, _ = single
    assert mesh_results[case].keys() == weights.keys()
    for name, value in weights.items():
        assert torch.equal(mesh_results[case][name], value), name


def test_tp_plan_placements(mesh_results):
    tp, fsdp_tp = mesh_results["tp_placements"], mesh_results["fsdp_tp_placements"]
    assert tp["layers.0.attention.wq.weight"] == (Shard(0),)  # column-wise: a subset of heads
    assert tp["layers.0.attention.wo.weight"] == (Shard(1),)  # row-wise
    assert tp["layers.0.feed_forward.w2.weight"] == (Shard(1),)
    assert tp["tok_embeddings.weight"] == (Shard(0),)  # row-wise: a slice of the vocabulary
    assert tp["output.weight"] == (Shard(0),)  # vocabulary-sharded logits
    assert tp["layers.0.attention_norm.weight"] == (Replicate(),)  # sequence parallel
    assert fsdp_tp["layers.0.attention_norm.weight"] == (Shard(0), Replicate())
    assert fsdp_tp["layers.0.attention.wo.weight"] == (Shard(0), Shard(1))


@pytest.mark.parametrize("case", ["tp", "fsdp_tp"])
def test_each_rank_holds_the_gradients_of_its_shards(mesh_results, case):
    """A rank's gradient of a parameter is the size of its shard of it: the embedding table's too,
    whose lookup torch's DTensor differentiates into the whole table's gradient on every rank (TP alone
    kept it so: parallelisms/vocab_parallel.py)."""
    for name, (param, grad) in mesh_results[f"{case}_local_shapes"].items():
        assert grad == param, name


@pytest.mark.parametrize("case", ["tp", "fsdp_tp", "fsdp_tp_gathered"])
def test_tp_loss_grads_and_grad_norm_match_single_process(mesh_results, single, case):
    """Sharded and replicated (norm) gradients each count once in the total norm."""
    _, (loss, norm, grads) = single
    got_loss, got_norm, got_grads = mesh_results[f"{case}_step"]
    torch.testing.assert_close(got_loss, loss, rtol=0, atol=1e-6)
    torch.testing.assert_close(got_norm.float(), norm.float(), rtol=1e-6, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_qwen3_tied_on_fsdp_tp_matches_single_process(mesh_results):
    """Init, loss, gradients (the tied table's: its embedding and output uses summed) and their norm."""
    model = _build(QWEN3_TINY, None, None, None, Qwen3Transformer)
    weights = {clean_fqn(n): p.detach().clone() for n, p in model.named_parameters()}
    assert "output.weight" not in weights  # one parameter, tok_embeddings.weight
    tokens = torch.randint(0, TINY.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    loss, norm, grads = _loss_and_grads(model, tokens, False)
    assert mesh_results["qwen3"].keys() == weights.keys()
    for name, value in weights.items():
        assert torch.equal(mesh_results["qwen3"][name], value), name
    placements = mesh_results["qwen3_placements"]
    assert placements["tok_embeddings.weight"][1] == Shard(0)  # TP: a slice of the vocabulary
    assert placements["layers.0.attention.q_norm.weight"] == (Shard(0), Replicate())
    got_loss, got_norm, got_grads = mesh_results["qwen3_step"]
    torch.testing.assert_close(got_loss, loss, rtol=0, atol=1e-6)
    torch.testing.assert_close(got_norm.float(), norm.float(), rtol=1e-6, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("case", ["bf16_fsdp", "bf16_fsdp_gathered_in_fp32", "bf16_ddp"])
def test_bf16_on_fsdp_and_ddp_computes_what_one_process_does(mesh_results, case):
    """One mixed-precision semantics on every layout (docs/numerics.md): FSDP's and DDP's units round the
    matmul weights as one process's autocast does (FSDP gathering them in bf16, or in fp32 for autocast
    to round), and keep the norms, the embeddings and the residual stream in fp32. Casting every
    parameter and the blocks' inputs (FSDP's default) moves this loss by about 1e-3."""
    args, cls = (QWEN3_TINY, Qwen3Transformer) if case == "bf16_ddp" else (TINY, Transformer)
    tokens = torch.randint(0, TINY.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    loss, grads = _bf16_step(args, cls, None, tokens)
    got_loss, got_grads = mesh_results[case]
    torch.testing.assert_close(got_loss, loss, rtol=0, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-3, atol=1e-6, msg=name)


@pytest.mark.parametrize("case", ["hsdp", "ddp"])
def test_replicas_all_reduce_only_after_the_last_microbatch(mesh_results, case):
    first, last = mesh_results[f"{case}_collectives"]
    assert first.get("all_reduce", 0) == 0, first
    assert last.get("all_reduce", 0) > 0, last
    if case == "hsdp":  # gradients stay sharded: reduce-scattered within the replica every time
        assert first["reduce_scatter_single"] == last["reduce_scatter_single"] > 0


@pytest.mark.parametrize(
    "case", ["sequence_parallel_7", "sequence_parallel_64", "replicated_7", "replicated_64"]
)
def test_chunked_loss_on_vocabulary_shards_equals_the_unfused_one(mesh_results, case):
    """TP 2 (training.loss_chunk_tokens with loss parallel): the loss and the gradients of the hidden
    states (sequence-sharded or replicated) and of the vocabulary-sharded weight."""
    loss_diff, hidden_grad_diff, weight_grad_diff = mesh_results["chunked_function"][case]
    assert loss_diff <= 1e-6 and hidden_grad_diff <= 1e-6 and weight_grad_diff <= 1e-6, case


@pytest.mark.parametrize("case", ["fsdp_tp", "pp_tp", "pp_zero_bubble"])
def test_chunked_loss_step_equals_the_unfused_one(mesh_results, case):
    """FSDP 2 x TP 2 (loss parallel, SP), PP 2 x TP 2 (1F1B) and PP 2 (InterleavedZeroBubble: split
    backward): the training step's loss, every gradient and the evaluation loss, chunked vs unfused."""
    loss_diff, grad_diff, evaluation_diff = mesh_results[f"chunked_{case}"]
    assert loss_diff <= 1e-6 and grad_diff <= 1e-6 and evaluation_diff <= 1e-6, (case, loss_diff, grad_diff)


def test_expert_parallel_steps_leak_nothing(mesh_results):
    """Live tensors after each of 4 worst-case steps: a leak (a forward's routing, an activation or a
    graph kept) grows them every step; a transient one (a cache) may come and go."""
    live = mesh_results["moe_ep_live_tensors"]
    assert max(live) - min(live) <= 1 and live[-1] <= live[0] + 1, live


@pytest.mark.parametrize("case", ["moe_ep", "moe_ep_worst_case", "moe_ep_tp"])
def test_expert_parallel_step_matches_single_process(mesh_results, case):
    """EP 2 on 4 FSDP ranks, each with a quarter of the batch: the loss, the auxiliary losses (the
    batch-wise one, and the sequence-wise one of each rank's own sequences) and every weight's
    gradient, each expert's included, are those of one process on the whole batch (with the expert
    gradients divided by the whole data-parallel degree, not by the ranks FSDP shards them over); also
    when every token goes to the first EP rank's experts and the second receives none, with full
    activation checkpointing; and EP 2 with TP 2 on 2 data-parallel ranks, each tp rank routing its
    half of the sequence (the router's and experts' gradients summed over tp by FSDP; a sequence's
    counts summed over its tp ranks)."""
    experts = "layers.0.feed_forward.experts.w1"
    if case == "moe_ep_tp":  # EP over the dp ranks, FSDP over the tp ranks; the router over both
        placements = mesh_results["moe_ep_tp_placements"]
        assert placements[experts] == (_StridedShard(0, split_factor=2), Shard(0)), placements[experts]
        assert placements["layers.0.feed_forward.router.weight"] == (Shard(0),)
    else:
        assert mesh_results["moe_ep_placements"][experts] == (_StridedShard(0, split_factor=2), Shard(0))
    model = _build(MOE_TINY, None, None, None, Qwen3MoeTransformer)
    moe_batch = torch.randint(0, MOE_TINY.vocab_size, (4, 17), generator=torch.Generator().manual_seed(2))
    batch = moe_batch[:2] if case == "moe_ep_tp" else moe_batch
    loss, aux_loss, sequence_loss, grads = _moe_step(model, batch, None, case == "moe_ep_worst_case")
    ep_loss, ep_aux_loss, ep_sequence_loss, ep_grads = mesh_results[case]
    torch.testing.assert_close(ep_loss, loss, rtol=0, atol=1e-6)
    torch.testing.assert_close(ep_aux_loss, aux_loss, rtol=0, atol=1e-6)
    torch.testing.assert_close(ep_sequence_loss, sequence_loss, rtol=0, atol=1e-6)
    assert ep_grads.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(ep_grads[name], grad, rtol=0, atol=1e-6, msg=name)


def test_deepseek_v3_moe_step_on_fsdp_tp_matches_single_process(mesh_results):
    """FSDP 2 x TP 2, DeepSeek-V3 (MLA, sigmoid routing in groups, a shared expert), every balancing
    loss on: each tp rank routes half of its dp rank's sequence, so the sequence-wise loss sums each
    sequence's counts over its tp ranks; the loss, the logged auxiliary losses and every gradient are one
    process's on the 2 sequences within 1e-6."""
    model = _build(DSV3_TINY, None, None, None, DeepSeekV3Transformer)
    moe_batch = torch.randint(0, MOE_TINY.vocab_size, (4, 17), generator=torch.Generator().manual_seed(2))
    loss, aux_loss, sequence_loss, grads = _moe_step(model, moe_batch[:2], None, False)
    tp_loss, tp_aux_loss, tp_sequence_loss, tp_grads = mesh_results["moe_dsv3_tp"]
    assert sequence_loss > 1.0
    for got, want in ((tp_loss, loss), (tp_aux_loss, aux_loss), (tp_sequence_loss, sequence_loss)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert tp_grads.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(tp_grads[name], grad, rtol=0, atol=1e-6, msg=name)


def test_sequence_balance_loss_under_context_parallelism_matches_single_process(mesh_results):
    """CP 2 x FSDP 2: each cp rank holds half of each sequence's tokens, so a sequence's counts are
    summed over its cp ranks (T and f_e are the whole sequence's) and each rank's loss is its tokens'
    share, scaled by the cp degree as FSDP averages the cp ranks' gradients: the logged loss and the
    router's gradient are one process's on the 4 sequences."""
    loss, grad = _sequence_loss_step()
    cp_loss, cp_grad = mesh_results["moe_cp_sequence_loss"]
    assert loss > 1.0
    torch.testing.assert_close(cp_loss, loss, rtol=0, atol=1e-6)
    torch.testing.assert_close(cp_grad, grad, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Graphs per compiled block on FSDP 2 in bf16 (2 processes)


def _compiled_graphs(args, cls, name: str, mesh, dims: ParallelDims, gather: str) -> dict[str, int]:
    """Dynamo's graphs and breaks over one bf16 training step of a compiled model on FSDP, run by the
    aot_eager backend (seconds; inductor takes a minute with a cold cache)."""
    config = _config(fsdp_gather_dtype=gather)
    config.training.mixed_precision_param, config.training.compile, config.model.name = "bfloat16", True, name
    config.training.compile_backend = "aot_eager"  # dynamo makes the graphs, whatever the backend
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = _build(args, mesh, dims, config, cls)
    step = step_of([model], config, dims, mesh)
    tokens = torch.randint(0, args.vocab_size, (1, 17), generator=torch.Generator().manual_seed(0))
    step.forward_backward(iter([Batch.of_windows(tokens)]), microbatches=1)
    counters = torch._dynamo.utils.counters
    return {
        "graphs": counters["stats"]["unique_graphs"],
        "breaks": sum(counters["graph_break"].values()),
        "inductor graphs": sum(counters["inductor"].values()),  # none: training.compile_backend is obeyed
    }


def _compile_worker(rank: int, world_size: int, tmp_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp_dir}/store", rank=rank, world_size=world_size)
    try:
        dims = ParallelDims(dp_shard=2, world_size=2)
        mesh = dims.build_mesh("cpu")
        results = {
            name: _compiled_graphs(args, cls, name, mesh, dims, "float32")
            for name, args, cls in (
                ("llama3", replace(TINY, n_layers=2), Transformer),
                ("qwen3", QWEN3_TINY, Qwen3Transformer),
                ("qwen3_moe", MOE_TINY, Qwen3MoeTransformer),
            )
        }
        if rank == 0:
            torch.save(results, f"{tmp_dir}/results.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def compiled_graphs(tmp_path_factory):
    tmp_dir = tmp_path_factory.mktemp("compile2")
    spawn_forked(_compile_worker, 2, 2, str(tmp_dir))
    return torch.load(tmp_dir / "results.pt", weights_only=False)


@pytest.mark.parametrize("name", ["llama3", "qwen3", "qwen3_moe"])
def test_fsdp_bf16_blocks_compile_as_one_graph(compiled_graphs, name):
    """parallelism.fsdp_gather_dtype = "float32": each block one FSDP unit, its norms inside, so it
    compiles whole: one graph for the blocks (alike in each model), one for the loss, no break. With
    "bfloat16" (the norms units of their own) Llama's compiles 4 graphs with 2 breaks."""
    assert compiled_graphs[name] == {"graphs": 2, "breaks": 0, "inductor graphs": 0}
