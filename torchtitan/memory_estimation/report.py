"""The printed table: a row per job, or per pipeline rank, in GiB."""

import time

import torch

from torchtitan.config.options import ConfigError, JobConfig
from torchtitan.config_rules import check_layout
from torchtitan.memory_estimation.simulate import estimate_ranks
from torchtitan.memory_estimation.step import vocab_size_of
from torchtitan.models import model_spec
from torchtitan.parallelisms.parallel_dims import ParallelDims

GIB = 2**30


def layout_of(cfg: JobConfig, parallel_dims: ParallelDims) -> str:
    degrees = [
        ("dp_replicate", parallel_dims.dp_replicate),
        ("dp_shard", parallel_dims.dp_shard),
        ("ep", parallel_dims.ep),
        ("cp", parallel_dims.cp),
        ("tp", parallel_dims.tp),
        ("pp", parallel_dims.pp),
    ]
    text = " ".join(f"{name}={d}" for name, d in degrees if d > 1) or "1 rank"
    if cfg.activation_checkpoint.mode != "none":
        text += f" ac={cfg.activation_checkpoint.mode}"
    if cfg.model.mtp_layers:
        text += f" mtp={cfg.model.mtp_layers}"
    return f"{text} bs={cfg.training.batch_size}x{cfg.training.seq_len} {cfg.training.mixed_precision_param}"


def row(cfg: JobConfig | str, layout: str, rank: object, values: list[object]) -> str:
    """A table row: the job's model (or a header's text), its layout, the rank and the values, bytes
    printed in GiB."""
    name = f"{cfg.model.name} {cfg.model.flavor}" if isinstance(cfg, JobConfig) else cfg
    cells = [f"{v / GIB:>8.3f}" if isinstance(v, int) else f"{v:>8}" for v in values]
    return f"{name:<16} {layout:<48} {rank!s:>5} " + " ".join(cells)


def routing_note(cfg: JobConfig, parallel_dims: ParallelDims, expert_load: float) -> str | None:
    """The routing a mixture of experts' estimate assumes (routing.py); None for a dense model. Its
    experts cannot take more than every rank's rows: `expert_load` above EP is refused."""
    if not model_spec(cfg.model).moe:
        return None
    if not parallel_dims.ep_enabled:
        return f"{cfg.model.flavor}: each rank runs its tokens x top_k expert rows (any routing)"
    if expert_load > parallel_dims.ep:
        raise ConfigError(
            f"--expert-load: {expert_load:g} is more than expert_parallel_degree {parallel_dims.ep}: a "
            "rank's experts cannot receive more than every rank's tokens"
        )
    if expert_load == 1:
        return f"{cfg.model.flavor}: balanced routing (each rank's experts receive tokens x top_k rows)"
    return f"{cfg.model.flavor}: this rank's experts receive {expert_load:g}x balanced routing's rows"


def estimate(configs: list[JobConfig], world_size: int, full: bool = False, expert_load: float = 1.0) -> None:
    """Print a row per job, or with pipeline parallelism a row per pipeline rank (their stages and
    in-flight micro-batches differ); the ranks of the other dimensions hold the same share (FSDP
    pads uneven shards; a context-parallel rank's two chunks together span as many keys as any
    other's), so the first stands for all, and for a mixture of experts the routing is
    assumed (routing.py), `expert_load` times balanced under expert parallelism."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    jobs, notes = [], []
    for cfg in configs:  # every job is checked before any is estimated
        if cfg.training.compile:
            cfg.training.compile = False
            cfg.parallelism.enable_async_tensor_parallel = False
            notes.append("training.compile was ignored: the figures are for eager mode")
        parallel_dims = check_layout(cfg, world_size, device.type)
        notes += [note] if (note := routing_note(cfg, parallel_dims, expert_load)) else []
        jobs.append((cfg, parallel_dims, vocab_size_of(cfg)))
    print(f"Estimated peak memory per rank (GiB) of a steady-state step, {world_size} ranks ({device.type}):")
    print(row("model", "layout", "rank", ["params", "grads", "optim", "activ", "peak"]))
    for cfg, parallel_dims, vocab in jobs:
        start = time.perf_counter()
        estimates = estimate_ranks(cfg, parallel_dims, world_size, device, vocab, full, expert_load)
        labels = (
            [f"pp{pp_rank}" for pp_rank in range(parallel_dims.pp)] if parallel_dims.pp_enabled else ["all"]
        )
        for label, cols in zip(labels, estimates.peaks):
            print(row(cfg, layout_of(cfg, parallel_dims), label, list(cols.values())), flush=True)
        notes.append(f"{cfg.model.flavor}: {estimates.how}, {time.perf_counter() - start:.1f}s")
    print("; ".join(dict.fromkeys(notes)))
