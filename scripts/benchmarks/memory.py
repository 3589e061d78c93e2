"""benchmark.py's memory rows: FSDP's per-rank state, and the chunked loss's peak and time."""

import os
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from scripts.benchmarks.step import ROOT, TRAIN_ARGS, ms, step_ratio
from torchtitan.config.parser import parse_args

ON_GPU = torch.cuda.is_available()


def fsdp_memory(train_args: list[str]) -> dict:
    """Bytes of the parameters, gradients and optimizer state this rank holds after a training step,
    built by the trainer's own parallelize and build_optimizer (FSDP over all ranks)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from torchtitan.datasets.tokenizer import build_tokenizer
    from torchtitan.models import build_model_args, model_spec
    from torchtitan.optimizers import build_optimizer
    from torchtitan.parallelisms.parallel_dims import ParallelDims
    from torchtitan.parallelisms.parallelize import parallelize

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1:
        dist.init_process_group("gloo")
    job_config = parse_args(train_args)
    args = build_model_args(job_config, build_tokenizer(ROOT / job_config.model.tokenizer_path).n_words)
    dims = ParallelDims(dp_shard=-1, world_size=world_size)
    with torch.device("meta"):
        model = model_spec(job_config.model).build(args)
    mesh = dims.build_mesh("cpu") if world_size > 1 else None
    model = parallelize(model, mesh, dims, job_config)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    optimizer = build_optimizer(model, job_config.optimizer)
    tokens = torch.randint(0, args.vocab_size, (2, 33))
    F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step()

    def nbytes(t: torch.Tensor) -> int:
        local = t.to_local() if isinstance(t, DTensor) else t
        return local.numel() * local.element_size()

    params = list(model.parameters())
    held = {
        "params": sum(nbytes(p) for p in params),
        "grads": sum(nbytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(nbytes(v) for s in optimizer.state.values() for v in s.values()),
    }
    gathered = [None] * world_size
    if world_size > 1:
        dist.all_gather_object(gathered, held)
        dist.barrier()  # no rank tears gloo down while another still reads from it
        dist.destroy_process_group()
    else:
        gathered = [held]
    return {"ranks": gathered}


LOSS_CHUNK_TOKENS = 1024  # training.loss_chunk_tokens of the chunked-loss figures
CHUNKED_LOSS_ARGS = ["--model.vocab_size", "128256", "--training.seq_len", "2048"]


def chunked_loss(train_args: list[str], chunk_tokens: int, steps: int = 3) -> dict:
    """Peak memory of a steady training step and its time (best of `steps`), without and with the
    chunked loss, built by the memory estimator's build_step (the trainer's TrainStep and optimizer)."""
    from torchtitan.config_rules import check_layout
    from torchtitan.memory_estimation.measure import measured_peak, run_step
    from torchtitan.memory_estimation.step import build_step, vocab_size_of

    device = torch.device("cuda" if ON_GPU else "cpu")
    result = {}
    for name, chunk in (("unfused", 0), ("chunked", chunk_tokens)):
        cfg = parse_args(
            [*train_args, *CHUNKED_LOSS_ARGS, "--training.mixed_precision_param", "float32"]
            + ["--training.loss_chunk_tokens", str(chunk)]
        )
        dims = check_layout(cfg, 1, device.type)
        peak, step = measured_peak(partial(build_step, cfg, dims, None, device, vocab_size_of(cfg)), device)
        wall, cpu = [], []
        for _ in range(steps):
            wall_start, cpu_start = time.perf_counter(), time.process_time()
            run_step(step)
            if ON_GPU:
                torch.cuda.synchronize()
            wall.append(time.perf_counter() - wall_start)
            cpu.append(time.process_time() - cpu_start)
        result[name] = {"peak": peak, "wall": min(wall), "cpu": min(cpu)}
        del step  # before the next one is built
    t = cfg.training
    return {**result, "logits_bytes": t.batch_size * t.seq_len * vocab_size_of(cfg) * 4}


def part_fsdp_memory(tmp: str) -> dict:
    return fsdp_memory(TRAIN_ARGS)


def part_chunked_loss(tmp: str) -> dict:
    return chunked_loss(TRAIN_ARGS, LOSS_CHUNK_TOKENS)


def fsdp_memory_rows(run_part: Callable[..., dict], add: Callable[..., None]) -> None:
    one, four = (
        run_part("fsdp_memory")["ranks"],
        run_part("fsdp_memory", 4)["ranks"],
    )
    total = [sum(r.values()) for r in four]
    ratio = max(total) / sum(one[0].values())
    add(
        "FSDP memory scaling",
        ratio,
        "<= 0.30",
        ratio <= 0.30,
        f"largest rank of 4 holds {max(total) / 2**20:.2f} MiB of params+grads+optimizer state, "
        f"1 rank {sum(one[0].values()) / 2**20:.2f} MiB",
        {"world_size_1": one, "world_size_4": four},
    )


def chunked_loss_rows(run_part: Callable[..., dict], add: Callable[..., None]) -> None:
    m = run_part("chunked_loss")
    unfused, chunked = m["unfused"]["peak"], m["chunked"]["peak"]
    add(
        "chunked-loss memory",
        chunked / unfused,
        "saves >= logits",
        unfused - chunked >= m["logits_bytes"],
        f"peak {chunked / 2**30:.2f} GiB with {LOSS_CHUNK_TOKENS}-token chunks, {unfused / 2**30:.2f} GiB "
        f"without: saves {(unfused - chunked) / 2**30:.2f} GiB, the fp32 logits are "
        f"{m['logits_bytes'] / 2**30:.2f} GiB (2 x 2048 tokens, vocabulary 128256)",
        m,
    )
    add(
        "chunked-loss step time",
        step_ratio(m["chunked"], m["unfused"]),
        "(reported)",
        True,
        f"chunked {ms(m['chunked'])}, unfused {ms(m['unfused'])}",
        m,
    )
