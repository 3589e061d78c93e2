"""benchmark.py's context-parallel rows: a rank's peak memory and step time on one long sequence
at CP 2 (2 gloo ranks) against CP 1, on the CPU whatever the device (`--only context_parallel`)."""

import math
import os
from collections.abc import Callable
from dataclasses import replace

import torch

from scripts.benchmarks.step import train_step_time

CP_SEQ_LEN = 4096  # long enough for the activations, which CP splits, to be most of the peak
CP_ARGS = [
    "--training.batch_size",
    "1",
    "--training.seq_len",
    str(CP_SEQ_LEN),
    "--training.mixed_precision_param",
    "float32",
    "--validation.enable",
    "false",
]
CP_MEASURED_STEP = 2  # the step whose peak counts: the first made the optimizer state
CP_STEADY_FROM = 3  # steps timed after this one (the profiler is stopped after the measured step)
CP_WINDOWS = 3  # timed steps, one per window; at ~6 s a step on one thread, a few suffice
CP_WINDOW = "context-parallel measured step"  # the profiler's marker around the measured step


def part_context_parallel(tmp: str) -> dict:
    """train.py on one CP_SEQ_LEN-token sequence, context-parallel over this part's processes (CP 1 in
    one process): each rank's peak memory over its second step, as scripts/estimate_memory.py
    --measure takes it on CPU (the profiler's memory events from before the model is built), then
    its step times with the profiler off."""
    import resource

    import torch.distributed as dist
    from torch.autograd.profiler import record_function

    from torchtitan.memory_estimation.measure import cpu_peak

    cp = int(os.environ.get("WORLD_SIZE", "1"))
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    window = record_function(CP_WINDOW)

    def around_measured_step(step: int) -> None:
        if step == CP_MEASURED_STEP - 1:
            window.__enter__()
        elif step == CP_MEASURED_STEP:
            window.__exit__(None, None, None)
            profiler.stop()

    profiler.start()
    timed = train_step_time(
        os.path.join(tmp, f"context_parallel_{cp}"),
        [*CP_ARGS, "--parallelism.context_parallel_degree", str(cp)],
        log_freq=1,
        steady_from=CP_STEADY_FROM,
        windows=CP_WINDOWS,
        after_step=around_measured_step,
    )
    # ru_maxrss (also what train.py logs as memory on CPU) adds the interpreter, libraries and the
    # profiler's own records: for reference only.
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    mine = {"peak": cpu_peak(profiler, CP_WINDOW), "max_rss": maxrss, **timed}
    if cp == 1:
        return {"ranks": [mine]}
    gathered: list = [None] * cp
    dist.all_gather_object(gathered, mine)
    dist.barrier()  # no rank tears gloo down while another still reads from it
    dist.destroy_process_group()
    return {"ranks": gathered}


def context_parallel_rows(run_part: Callable[..., dict], add: Callable[..., None]) -> None:
    """The part in 1 process (CP 1) and in 2 (CP 2), on the CPU, in CPU time whatever the device (the
    worst rank of the two counts)."""
    one = run_part("context_parallel", cpu=True)["ranks"][0]
    two = run_part("context_parallel", 2, cpu=True)["ranks"]

    def ranks(key: str, scale: float, spec: str) -> str:
        return " and ".join(format(r[key] * scale, spec) for r in two)

    peak = max(r["peak"] for r in two)
    add(
        "context-parallel memory",
        peak / one["peak"],
        "<= 0.6",
        peak / one["peak"] <= 0.6,
        f"peak per rank at CP 2 {ranks('peak', 2**-20, ',.0f')} MiB, at CP 1 {one['peak'] / 2**20:,.0f} "
        f"MiB (1 x {CP_SEQ_LEN} tokens, fp32, CPU)",
        {"cp_1": one, "cp_2": two},
    )
    slowest = max(r["cpu"] for r in two)
    add(
        "context-parallel step time",
        slowest / one["cpu"],
        "(reported)",
        True,
        f"CPU time per rank at CP 2 {ranks('cpu', 1, '.2f')} s/step, at CP 1 {one['cpu']:.2f} s/step "
        f"(wall, rank 0's log: {two[0]['wall']:.2f} vs {one['wall']:.2f}; best of steps {CP_STEADY_FROM + 1}-"
        f"{CP_STEADY_FROM + CP_WINDOWS}, one thread per process)",
        {"cp_1": one, "cp_2": two},
    )


# Packed documents' lengths for the balance rows: log-normal (a few long documents do most of the
# attention work, which grows with the square of a document's length), web text's (median 700 tokens)
# and a long-context mixture's (median 8K), in 128K-token windows as train_configs/llama3_8b_128k.toml.
BALANCE_SEQ_LEN = 131072
BALANCE_LENGTHS = {"web text, median 700 tokens": 700, "long documents, median 8K tokens": 8000}
BALANCE_WINDOWS = 200


def attention_work(document_ids: torch.Tensor, positions: torch.Tensor) -> int:
    """block_causal attention work of the queries at `positions`: the keys each sees, summed."""
    from torchtitan.models.documents import document_positions

    return int((document_positions(document_ids) + 1)[:, positions].sum())


def packed_document_ids(seq_len: int, median: float, generator: torch.Generator) -> torch.Tensor:
    """(1, seq_len) document ids of a window of documents of log-normal lengths (sigma 1.2)."""
    lengths = torch.empty(0, dtype=torch.long)
    while lengths.sum() < seq_len:
        more = torch.empty(64).log_normal_(math.log(median), 1.2, generator=generator).long().clamp(min=1)
        lengths = torch.cat([lengths, more])
    ids = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    return ids[None, :seq_len]


def cp_balance_rows(run_part: Callable[..., dict], add: Callable[..., None]) -> None:
    """block_causal under context parallelism: the attention work of the busiest rank over the idlest,
    with head-tail chunks (as causal has them) and with the pieces dealt out by their work
    (context_parallel.sequence_layouts), over windows of packed documents; computed, nothing run."""
    from torchtitan.parallelisms.context_parallel import layout_positions, sequence_layouts

    for cp in (4, 8):
        for name, median in BALANCE_LENGTHS.items():
            generator = torch.Generator().manual_seed(0)
            ratios: dict[str, list[float]] = {"head-tail": [], "dealt": []}
            for _ in range(BALANCE_WINDOWS):
                ids = packed_document_ids(BALANCE_SEQ_LEN, median, generator)
                for kind, document_ids in (("head-tail", None), ("dealt", ids)):
                    layout = sequence_layouts(BALANCE_SEQ_LEN, cp, document_ids)[0]
                    work = [attention_work(ids, layout_positions(layout, r)) for r in range(cp)]
                    ratios[kind].append(max(work) / min(work))
            mean = {kind: sum(r) / len(r) for kind, r in ratios.items()}
            p95 = {kind: float(torch.tensor(r).quantile(0.95)) for kind, r in ratios.items()}
            add(
                f"CP {cp} attention work, busiest / idlest rank, {name}",
                mean["dealt"],
                "<= 1.3",
                mean["dealt"] <= 1.3,
                f"mean over {BALANCE_WINDOWS} windows of {BALANCE_SEQ_LEN} tokens (95th percentile): dealt "
                f"pieces {mean['dealt']:.3f} ({p95['dealt']:.3f}), head-tail chunks {mean['head-tail']:.3f} "
                f"({p95['head-tail']:.3f}); log-normal lengths, sigma 1.2",
                {"mean": mean, "p95": p95},
            )


# Multi-head latent attention under CP 2: the bytes each rank's attention all-gathers per layer, with its
# latents gathered (LatentGather) and with every head's keys and values gathered, counted as they run.
MLA_SEQ_LEN = {"debugmodel": 4096, "671B": 256}  # 671B: one attention layer, ~190M parameters a rank
MLA_REPORT_SEQ_LEN = 4096  # the per-layer figures' sequence length (bytes scale with it)


class GatheredBytes:
    """A dispatch mode counting the bytes the functional all-gathers return (context parallelism's: the
    whole sequence's tensor, this rank's share included), as they run."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
                out = func(*args, **(kwargs or {}))
                if func is torch.ops._c10d_functional.all_gather_into_tensor.default:
                    counter.bytes += out.numel() * out.element_size()
                return out

        self.bytes = 0
        self.mode = Mode()

    def __enter__(self) -> "GatheredBytes":
        self.mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.mode.__exit__(*exc)


def mla_layer_gathered_bytes(flavor: str, seq_len: int, cp_mesh, gather_latents: bool) -> int:  # noqa: ANN001
    """One DeepSeek-V3 attention layer of `flavor`, context-parallel over `cp_mesh`, forward on one
    sequence of `seq_len` tokens under bf16 autocast (train.py's default): the bytes it all-gathered."""
    from torch import nn

    from torchtitan.models.deepseek_v3 import deepseek_v3_configs
    from torchtitan.models.deepseek_v3.model import Attention, precompute_freqs_cis
    from torchtitan.models.init import seeded_init
    from torchtitan.parallelisms.context_parallel import apply_cp

    args = replace(deepseek_v3_configs[flavor], max_seq_len=seq_len)
    holder = nn.Module()  # apply_cp's view of a model: its blocks (`blocks()`), their attention modules
    holder.layers = nn.ModuleDict({"0": nn.Module()})
    holder.layers["0"].attention = attention = Attention(args)
    holder.blocks = lambda: [(holder.layers, "0", 0)]
    with seeded_init(attention, 0):
        attention.init_weights(0.02)
    apply_cp(holder, cp_mesh, gather_latents=gather_latents)
    x = torch.randn(1, seq_len // cp_mesh.size(), args.dim)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), GatheredBytes() as counted:
        attention(x, precompute_freqs_cis(args))
    return counted.bytes


def part_mla_gather(tmp: str) -> dict:
    """On 2 gloo ranks: each flavour's bytes gathered per layer, latents and per head, measured."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    try:
        cp_mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))["cp"]
        return {
            flavor: {
                "seq_len": seq_len,
                **{
                    kind: mla_layer_gathered_bytes(flavor, seq_len, cp_mesh, kind == "latent")
                    for kind in ("latent", "per_head")
                },
            }
            for flavor, seq_len in MLA_SEQ_LEN.items()
        }
    finally:
        dist.barrier()
        dist.destroy_process_group()


def mla_gather_rows(run_part: Callable[..., dict], add: Callable[..., None]) -> None:
    """DeepSeek-V3 under CP 2: the bytes a rank all-gathers per attention layer, its latents and rotated
    RoPE key (kv_lora_rank + qk_rope_head_dim features a token) against every head's keys and values
    (n_heads x (qk_head_dim + v_head_dim)), counted on the collectives, in bf16."""
    from torchtitan.models.deepseek_v3 import deepseek_v3_configs

    measured = run_part("mla_gather", 2, cpu=True)
    for flavor, row in measured.items():
        args = deepseek_v3_configs[flavor]
        latent, per_head = (row[kind] / row["seq_len"] for kind in ("latent", "per_head"))
        n = MLA_REPORT_SEQ_LEN
        expected = (
            (args.kv_lora_rank + args.qk_rope_head_dim) * 2,
            args.n_heads * (args.head_dim + args.v_head_dim) * 2,
        )
        add(
            f"MLA CP 2 gathered bytes per layer, {flavor}",
            per_head / latent,
            "(reported)",
            (latent, per_head) == expected,
            f"per token: latent + rope key {latent:,.0f} B, per-head K/V {per_head:,.0f} B (bf16, counted on "
            f"the all-gathers over {row['seq_len']} tokens); a {n}-token sequence: "
            f"{latent * n / 2**20:,.1f} MiB vs {per_head * n / 2**20:,.1f} MiB per layer and rank",
            {"measured": row, "expected_per_token": expected},
        )
