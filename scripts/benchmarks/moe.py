"""benchmark.py's mixture-of-experts rows: the expert layer's grouped GEMM against a matmul per
expert, the Qwen3-MoE debug model's step time against a dense Qwen3 of the same active parameters, and
the share of an expert-parallel step spent in the all-to-all."""

import os
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from scripts.benchmarks.step import ROOT, STEADY_FROM, ms, reference_step_time, run_train, step_ratio

MOE_ARGS = ["--model.name", "qwen3_moe", "--model.tokenizer_path", "assets/tokenizer/kjv_bpe_hf"]


def part_moe(tmp: str) -> dict:
    """The Qwen3-MoE debug model (a dense layer of 768 hidden units, then 3 sparse layers whose tokens
    each take 2 experts of 256) vs a dense Qwen3 with the same active parameters (4 layers of 576
    hidden units; the routers' 6k weights aside), in the same minimal loop, on its recipe's batch."""
    from torchtitan.models.qwen3 import qwen3_configs

    dense_args = replace(qwen3_configs["debugmodel"], n_layers=4, hidden_dim=(768 + 3 * 2 * 256) // 4)
    dense_extra = ["--model.name", "qwen3", "--model.tokenizer_path", "assets/tokenizer/kjv_bpe_hf"]
    batch = ["--training.batch_size", "8", "--training.seq_len", "256"]  # qwen3_moe_debug.toml's
    moe = reference_step_time([*MOE_ARGS, *batch])
    dense = reference_step_time([*dense_extra, *batch], model_args=dense_args)
    return {"value": step_ratio(moe, dense), "moe": moe, "dense": dense}


DSV3_ARGS = ["--model.name", "deepseek_v3", "--model.tokenizer_path", "assets/tokenizer/kjv_bpe_hf"]
DSV3_BATCH = ["--training.batch_size", "8", "--training.seq_len", "256"]  # deepseek_v3_debug.toml's
ROUNDS = 2  # each model measured this many times, alternately; the best of each kept


def qwen3_moe_like_deepseek_v3():
    """Qwen3-MoE's arguments in DeepSeek-V3's debug shape, with its active parameters
    (tests/test_performance.py checks them)."""
    from torchtitan.models.qwen3_moe import qwen3_moe_configs

    return replace(
        qwen3_moe_configs["debugmodel"], n_layers=3, n_kv_heads=1, hidden_dim=512, top_k=3, moe_hidden_dim=128
    )


def part_deepseek_v3(tmp: str) -> dict:
    """DeepSeek-V3's debug model vs a Qwen3-MoE of the same active parameters, in the same minimal loop,
    measured alternately in this one process. The Qwen3-MoE is the debug model's shape with Qwen3's
    parts: 3 layers of dim 256, the first dense (hidden 512); attention of 4 query heads and 1 key/value
    head of 32 features (81,920 weights, as MLA's five projections); 8 experts of 128 hidden units of
    which each token takes 3, where DeepSeek-V3's takes 2 routed and its shared one (296,960 active
    weights a sparse layer either way). The difference: MLA (latents, YaRN, scores over 48 features
    against 32), sigmoid routing in groups and the shared expert computed densely; DeepSeek-V3 also holds
    one more expert's weights a sparse layer (the shared one), which AdamW updates."""
    qwen3_moe_args = qwen3_moe_like_deepseek_v3()
    steps: dict[str, list[dict]] = {"deepseek_v3": [], "qwen3_moe": []}
    for _ in range(ROUNDS):
        steps["deepseek_v3"].append(reference_step_time([*DSV3_ARGS, *DSV3_BATCH]))
        steps["qwen3_moe"].append(reference_step_time([*MOE_ARGS, *DSV3_BATCH], model_args=qwen3_moe_args))
    best = {name: min(times, key=lambda t: t["cpu"]) for name, times in steps.items()}
    return {"value": step_ratio(best["deepseek_v3"], best["qwen3_moe"]), **best, "rounds": steps}


LAYER_EXPERTS = (8, 64, 128)
LAYER_SHAPE = {"dim": 256, "hidden": 128, "tokens": 2048, "top_k": 2}  # 32 rows per expert at 128


def part_moe_layer(tmp: str) -> dict:
    """The experts' SwiGLU over routed rows, forward + backward, fp32, one thread: train.py's
    GroupedExperts (a torch._grouped_mm per projection) vs a matmul per expert in a Python loop (the
    reference of tests/test_moe.py), at each of LAYER_EXPERTS experts, routing uniform at random. Best
    of 5 windows of 10 iterations, CPU time."""
    import torch.nn.functional as F

    from torchtitan.models.moe import GroupedExperts

    torch.set_num_threads(1)
    dim, hidden, tokens, top_k = (LAYER_SHAPE[k] for k in ("dim", "hidden", "tokens", "top_k"))

    def grouped(experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return experts(x, counts)

    def loop(experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        outputs = []
        for rows, w1, w2, w3 in zip(torch.split(x, counts.tolist()), experts.w1, experts.w2, experts.w3):
            outputs.append((F.silu(rows @ w1.T) * (rows @ w3.T)) @ w2.T)
        return torch.cat(outputs)

    def seconds(
        forward, experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor, grad: torch.Tensor
    ) -> float:
        def step() -> None:  # gradients start from None, as after train.py's zero_grad
            x.grad = None
            experts.zero_grad(set_to_none=True)
            forward(experts, x, counts).backward(grad)

        for _ in range(3):
            step()
        best = float("inf")
        for _ in range(5):
            start = time.process_time()
            for _ in range(10):
                step()
            best = min(best, (time.process_time() - start) / 10)
        return best

    result = {}
    for num_experts in LAYER_EXPERTS:
        gen = torch.Generator().manual_seed(0)
        experts = GroupedExperts(dim, hidden, num_experts)
        with torch.no_grad():
            for p in experts.parameters():
                p.normal_(0.0, 0.02, generator=gen)
        choice = torch.randint(0, num_experts, (tokens * top_k,), generator=gen)
        counts = torch.bincount(choice, minlength=num_experts)
        x = torch.randn(tokens * top_k, dim, generator=gen).requires_grad_()
        grad = torch.randn(tokens * top_k, dim, generator=gen)
        grouped_s = seconds(grouped, experts, x, counts, grad)
        loop_s = seconds(loop, experts, x, counts, grad)
        result[str(num_experts)] = {
            "grouped_ms": 1e3 * grouped_s,
            "loop_ms": 1e3 * loop_s,
            "value": grouped_s / loop_s,
        }
    return result


MOE_EP_ARGS = [
    "--job.config_file",
    str(ROOT / "train_configs" / "qwen3_moe_debug.toml"),
    "--checkpoint.enable_checkpoint",
    "false",
    "--validation.enable",
    "false",
    "--parallelism.data_parallel_shard_degree",
    "2",
    "--parallelism.expert_parallel_degree",
    "2",
]
PROFILED_STEPS = 8  # steady steps profiled by the all-to-all part
FUNCOL = "_c10d_functional::"  # torch's functional collectives, as the profiler names their ops


def all_to_all_exchanges(events: list) -> list[float]:
    """Microseconds spent in each of the experts' all-to-alls among `events` (one thread's profiler
    events, in start order): a funcol all_to_all_single (its launch, in forward or in an autograd
    backward), then the funcol waits and autograd wrapping that follow it up to the next functional
    collective's launch. Expert parallelism waits for each all-to-all's result before launching
    another collective, so those waits are its; FSDP's collectives are c10d's own ops, not funcol's."""
    exchanges: list[float] = []
    launched, counted_until = "", 0.0
    for event in events:
        if not event.name.startswith(FUNCOL):
            continue
        op = event.name.removeprefix(FUNCOL)
        if op not in ("wait_tensor", "_wrap_tensor_autograd"):
            launched = op
            if op == "all_to_all_single":
                exchanges.append(0.0)
        if launched == "all_to_all_single" and event.time_range.start >= counted_until:  # not nested
            exchanges[-1] += event.time_range.elapsed_us()
            counted_until = event.time_range.end
    return exchanges


def part_moe_all_to_all(tmp: str) -> dict:
    """Share of an expert-parallel step spent in the all-to-all token exchange: train.py on the
    Qwen3-MoE debug recipe at EP 2 (2 FSDP ranks), each rank profiled over PROFILED_STEPS steady
    steps (from one optimizer step to the next), in wall time, as waiting for the other rank's tokens
    is part of the exchange's cost. The ranks make the same exchanges in the same order; the one that
    arrives last at an exchange blocks the least, for the exchange itself (`exchange_ms`): the rest
    of a rank's time in it is waiting for that rank."""
    import torch.distributed as dist

    profiler = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU],
        schedule=torch.profiler.schedule(wait=STEADY_FROM - 1, warmup=1, active=PROFILED_STEPS, repeat=1),
    )
    argv = [*MOE_EP_ARGS, "--training.steps", str(STEADY_FROM + PROFILED_STEPS)]
    with profiler:
        run_train([*argv, "--job.dump_folder", os.path.join(tmp, "moe_ep")], profiler.step)
    steps = [e for e in profiler.events() if e.name.startswith("ProfilerStep")]  # "ProfilerStep*"
    assert len(steps) == PROFILED_STEPS, [e.name for e in steps]
    loop = sorted(
        (e for e in profiler.events() if e.thread == steps[0].thread), key=lambda e: e.time_range.start
    )
    mine = (sum(e.time_range.elapsed_us() for e in steps) / 1e3 / PROFILED_STEPS, all_to_all_exchanges(loop))
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    dist.barrier()  # no rank tears gloo down while another still reads from it
    dist.destroy_process_group()
    ranks = [
        {"step_ms": step_ms, "all_to_all_ms": sum(ex) / 1e3 / PROFILED_STEPS, "exchanges": len(ex)}
        for step_ms, ex in gathered
    ]
    assert len({len(ex) for _, ex in gathered}) == 1, "the ranks' exchanges differ"
    exchange_ms = sum(map(min, zip(*(ex for _, ex in gathered)))) / 1e3 / PROFILED_STEPS
    mean_step_ms = sum(r["step_ms"] for r in ranks) / len(ranks)
    return {
        "value": sum(r["all_to_all_ms"] / r["step_ms"] for r in ranks) / len(ranks),
        "ranks": ranks,
        "exchange_ms": exchange_ms,
        "exchange_share": exchange_ms / mean_step_ms,
        "load_average": os.getloadavg()[0],
    }


def moe_rows(run_part: Callable[..., dict], add: Callable[..., None]) -> None:
    layer = run_part("moe_layer")
    shape = ", ".join(f"{k} {v}" for k, v in LAYER_SHAPE.items())
    for num_experts, goal in zip(LAYER_EXPERTS, (1.0, None, 0.8)):
        r = layer[str(num_experts)]
        add(
            f"MoE layer: grouped GEMM / loop, {num_experts} experts",
            r["value"],
            "(reported)" if goal is None else f"<= {goal}",
            goal is None or r["value"] <= goal,
            f"{r['grouped_ms']:.2f} vs {r['loop_ms']:.2f} ms forward + backward ({shape}, fp32, 1 thread)",
            r,
        )
    e = run_part("moe")
    add(
        "MoE step time",
        e["value"],
        "<= 1.2",
        e["value"] <= 1.2,
        f"Qwen3-MoE debugmodel {ms(e['moe'])}, dense Qwen3 of the same active parameters "
        f"{ms(e['dense'])} (a hand-written loop, one process)",
        e,
    )
    d = run_part("deepseek_v3")
    add(
        "DeepSeek-V3 / Qwen3-MoE step time",
        d["value"],
        "(reported)",
        True,
        f"DeepSeek-V3 debugmodel {ms(d['deepseek_v3'])}, a Qwen3-MoE of the same shape and active "
        f"parameters {ms(d['qwen3_moe'])} (8 x 256 tokens, a hand-written loop, one process, best of "
        f"{ROUNDS} alternate measurements each)",
        d,
    )
    a = run_part("moe_all_to_all", 2, cpu=True)  # gloo: the profile is host time
    add(
        "MoE all-to-all share",
        a["value"],
        "(reported)",
        True,
        "Qwen3-MoE debugmodel, EP 2 on 2 FSDP ranks (CPU, gloo), 8 x 256 tokens each, train.py profiled "
        "(wall time): "
        + ", ".join(
            f"rank {i} {r['all_to_all_ms']:.1f} of {r['step_ms']:.1f} ms/step"
            for i, r in enumerate(a["ranks"])
        )
        + f"; the exchange itself (the later rank's time) {a['exchange_ms']:.1f} ms/step, "
        f"{a['exchange_share']:.1%} of a step; the rest is waiting for the other rank",
        a,
    )
