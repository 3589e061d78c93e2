"""GPU figures in one run, for a short loan of one H100 or H200: each part in a fresh process, in
priority order, and a part that would not fit in the time left is skipped, so one call of about 8
minutes prints one table (docs/performance.md keeps the figures, with their setup).

    python scripts/benchmarks/benchmark_gpu.py --out DIR [--budget 480] [--only llama1b,moe_grouped_mm]
        [--small]

| part | what |
| --- | --- |
| llama1b | train.py, 1B recipe, 4 x 2048 tokens per optimizer step, full logits (not chunked) |
| torchtitan_1b | the PyPI torchtitan wheel on the same shape, batch, compile and AC (if installed) |
| moe_grouped_mm | a Qwen3-30B-A3B-width expert layer, forward + backward: a grouped GEMM per projection |
|  | vs the per-expert loop, and the values of both vs float32 on the CPU |
| llama8b_4layers | Llama 3 8B's width with 4 layers, 1 x 8192 tokens, compiled |
| llama1b_block_causal | llama1b with block_causal attention (FlexAttention), as the recipe has it |
| attention_block_causal | block_causal attention (FlexAttention, compiled block mask) vs causal SDPA: time |
|  | and memory at 8K and 32K tokens with 8 and 64 documents; values and gradients vs the CPU path in fp32 |
| cp_attention_cuda | context parallel's CUDA attention (SDPA lower-right per chunk; FlexAttention with |
|  | documents) for each CP 2 rank's pieces, in one process: values and gradients vs the CPU path in fp32 |
| cp_compiled_block_causal | CP's attention on a 1-rank mesh, compiled blocks, block_causal: vs no CP |
| cp2_one_gpu | train.py at CP 2, two processes sharing the GPU over gloo, vs one process: fp32, bf16 losses |
| fsdp2_one_gpu | train.py at FSDP 2 the same way, bf16, compiled, blocks gathered in bf16 and in fp32: |
|  | losses, memory, graphs |
| llama1b_muon | llama1b with optimizer.name Muon (bf16 Newton-Schulz) |
| llama1b_chunked_loss | llama1b with training.loss_chunk_tokens 2048, as the recipe has it |
| llama1b_fp8_tensorwise, llama1b_fp8_rowwise | llama1b with float8 linear layers (torchao) |
| qwen3_moe_2layers | Qwen3-30B-A3B's width with 2 layers, 2 x 4096 tokens, compiled |
| host_syncs | the host-device syncs of each step (CUDA's sync debug mode), Qwen3-MoE debug recipe |

A train.py part reports its last logged window (steps 21-30): tokens/s per GPU, MFU and the peak
memory the CUDA allocator reserved, as train.py's own log line computes them, plus the graphs
dynamo compiled (unique graphs, graph breaks). `--small` runs every part on tiny shapes on whatever
device there is, CPU included: a check of the script before a loan, not a figure. Check it under the
device machine's torch too (2.11): `python -m venv V && V/bin/pip install torch==2.11.0 numpy tomli
tiktoken datasets tokenizers safetensors` (PyPI's CUDA build, about 5 GB, runs on the CPU), then
`PYTHONPATH=. V/bin/python scripts/benchmarks/benchmark_gpu.py --small --out DIR`.
"""

import argparse
import functools
import json
import os
import runpy
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from torchtitan.config.parser import parse_args  # noqa: E402
from torchtitan.models import MODEL_SPECS  # noqa: E402

STEPS, LOG_FREQ = 30, 10
COMMON = ["--checkpoint.enable_checkpoint", "false", "--validation.enable", "false", "--metrics.log_freq"]


def flavor_with_layers(family: str, flavor: str, n_layers: int) -> str:
    """Register `flavor` cut to n_layers under a new name (a flavour of this process only)."""
    flavors = MODEL_SPECS[family].flavors
    flavors[f"{flavor}-{n_layers}layers"] = replace(flavors[flavor], n_layers=n_layers)
    return f"{flavor}-{n_layers}layers"


def train_figures(
    out: Path, name: str, argv: list[str], small: bool, layers: tuple[str, str, int] | None
) -> dict:
    """train.py's main() in this process; `layers` = (family, flavour, n_layers) trains that flavour
    cut to n_layers (a flavour of this process only)."""
    if small:
        argv = [
            *argv,
            "--model.flavor",
            "debugmodel",
            "--model.vocab_size",
            "-1",
            "--training.seq_len",
            "256",
        ]
        if not torch.cuda.is_available():  # bf16 matmuls are slow on most CPUs
            argv += ["--training.mixed_precision_param", "float32"]
    elif layers is not None:
        argv = [*argv, "--model.flavor", flavor_with_layers(*layers)]
    dump = out / name
    steps, log_freq = (4, 2) if small else (STEPS, LOG_FREQ)
    argv = [*argv, *COMMON, str(log_freq), "--training.steps", str(steps), "--job.dump_folder", str(dump)]
    train_main = runpy.run_path(str(ROOT / "train.py"))["main"]  # a program: executed, not imported
    start = time.perf_counter()
    code = train_main(parse_args(argv))
    wall = time.perf_counter() - start
    with open(dump / "metrics.jsonl") as f:
        records = [r for r in map(json.loads, f) if "tps" in r]
    last = records[-1]
    counters = torch._dynamo.utils.counters
    return {
        "exit": code,
        "tps": round(last["tps"]),
        "mfu_pct": None if last["mfu"] is None else round(last["mfu"], 2),
        "memory_gib": round(last["memory_gib"], 2),
        "step_ms": round(1000 * last["step_time"], 1),
        "wall_s": round(wall, 1),
        "unique_graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
        "argv": " ".join(argv),
    }


LLAMA_1B = [  # full logits and the causal mask, as torchtitan_1b runs; the recipe chunks and masks documents
    "--job.config_file", str(ROOT / "train_configs" / "llama3_1b.toml"),
    "--training.global_batch_size", "-1", "--training.loss_chunk_tokens", "0",
    "--model.attn_mask_type", "causal",
]  # fmt: skip


def part_llama1b(out: Path, small: bool) -> dict:
    return train_figures(out, "llama1b", LLAMA_1B, small, None)


def part_llama1b_chunked_loss(out: Path, small: bool) -> dict:
    return train_figures(
        out, "llama1b_chunked_loss", [*LLAMA_1B, "--training.loss_chunk_tokens", "2048"], small, None
    )


def part_llama1b_block_causal(out: Path, small: bool) -> dict:
    """llama1b with packed documents attending within themselves (FlexAttention), as the recipe has it."""
    argv = [*LLAMA_1B, "--model.attn_mask_type", "block_causal"]
    return train_figures(out, "llama1b_block_causal", argv, small, None)


def fp8(out: Path, small: bool, recipe: str) -> dict:
    argv = [*LLAMA_1B, "--float8.enable_float8_linear", "true", "--float8.recipe_name", recipe]
    return train_figures(out, f"llama1b_fp8_{recipe}", argv, small, None)


def part_llama1b_fp8_tensorwise(out: Path, small: bool) -> dict:
    return fp8(out, small, "tensorwise")


def part_llama1b_fp8_rowwise(out: Path, small: bool) -> dict:
    return fp8(out, small, "rowwise")


def part_llama8b_4layers(out: Path, small: bool) -> dict:
    argv = [
        "--job.config_file", str(ROOT / "train_configs" / "llama3_1b.toml"),
        "--model.attn_mask_type", "causal", "--model.name", "llama3",
        "--training.batch_size", "1", "--training.seq_len", "8192",
        "--training.global_batch_size", "-1",
    ]  # fmt: skip
    return train_figures(out, "llama8b_4layers", argv, small, ("llama3", "8B", 4))


def part_qwen3_moe_2layers(out: Path, small: bool) -> dict:
    argv = [
        "--job.config_file", str(ROOT / "train_configs" / "qwen3_moe_debug.toml"),
        "--training.batch_size", "2", "--training.seq_len", "4096", "--training.global_batch_size", "-1",
        "--model.vocab_size", "151936", "--training.mixed_precision_param", "bfloat16",
        "--training.compile", "true",
        "--optimizer.implementation", "fused", "--lr_scheduler.warmup_steps", "10",
    ]  # fmt: skip
    return train_figures(out, "qwen3_moe_2layers", argv, small, ("qwen3_moe", "30B-A3B", 2))


def part_moe_grouped_mm(out: Path, small: bool) -> dict:
    """One expert layer's SwiGLU over routed tokens, forward and backward, at Qwen3-30B-A3B's width
    (128 experts, dim 2048, expert hidden 768, top 8 of 8192 tokens): torch._grouped_mm per projection
    (train.py's GroupedExperts) vs a matmul per expert, bf16; and each one's error against float32 on
    the CPU."""
    import torch.nn.functional as F

    from torchtitan.models.init import seeded_init
    from torchtitan.models.moe import GroupedExperts

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    experts, dim, hidden, top_k, tokens = (8, 64, 32, 2, 256) if small else (128, 2048, 768, 8, 8192)
    gen = torch.Generator().manual_seed(0)
    layer = GroupedExperts(dim, hidden, experts)
    with seeded_init(layer, seed=0):
        layer.init_weights(init_std=0.02)
    # Routing as a trained router gives it: uneven loads (a few experts take several times the mean).
    popularity = torch.rand(experts, generator=gen) ** 3 + 0.05
    choice = torch.multinomial(popularity.expand(tokens, experts), top_k, generator=gen)
    counts = torch.bincount(choice.flatten(), minlength=experts)
    x_cpu = torch.randn(tokens * top_k, dim, generator=gen)
    grad_cpu = torch.randn(tokens * top_k, dim, generator=gen)

    def grouped(x: torch.Tensor, counts: torch.Tensor, m: GroupedExperts) -> torch.Tensor:
        return m(x, counts)  # train.py's experts

    def loop(x: torch.Tensor, counts: torch.Tensor, m: GroupedExperts) -> torch.Tensor:
        """The per-expert loop the grouped GEMM replaced, host sync included."""
        outputs = []
        for rows, w1, w2, w3 in zip(torch.split(x, counts.tolist()), m.w1, m.w2, m.w3):
            outputs.append((F.silu(rows @ w1.T) * (rows @ w3.T)) @ w2.T)
        return torch.cat(outputs)

    def run(fn, dtype, dev, timed: bool) -> tuple[torch.Tensor, torch.Tensor, float | None]:
        m = GroupedExperts(dim, hidden, experts).to(dev)
        m.load_state_dict(layer.state_dict())
        m.to(dtype)
        x = x_cpu.to(dev, dtype, copy=True).requires_grad_()
        grad, c = grad_cpu.to(dev, dtype), counts.to(dev)
        seconds = None
        if timed:
            for _ in range(1 if small else 3):
                fn(x, c, m).backward(grad)
            sync = torch.cuda.synchronize if dev.type == "cuda" else lambda: None
            sync()
            start, iters = time.perf_counter(), 1 if small else 10
            for _ in range(iters):
                fn(x, c, m).backward(grad)
            sync()
            seconds = (time.perf_counter() - start) / iters
        x.grad = None
        y = fn(x, c, m)
        y.backward(grad)
        return y.detach().float().cpu(), x.grad.float().cpu(), seconds

    ref_y, ref_dx, _ = run(loop, torch.float32, torch.device("cpu"), timed=False)

    def error(y: torch.Tensor, dx: torch.Tensor) -> dict:
        return {
            "y": float((y - ref_y).abs().max() / ref_y.abs().max()),
            "dx": float((dx - ref_dx).abs().max() / ref_dx.abs().max()),
        }

    load = round(float(counts.max() / counts.float().mean()), 2)
    result = {"device": str(device), "experts": experts, "dim": dim, "hidden": hidden}
    result.update(top_k=top_k, tokens=tokens, max_load_over_mean=load)
    y, dx, loop_s = run(loop, torch.bfloat16, device, timed=True)
    result["loop_ms"], result["loop_bf16_error"] = round(1000 * loop_s, 2), error(y, dx)
    y, dx, grouped_s = run(grouped, torch.bfloat16, device, timed=True)
    result["grouped_ms"], result["grouped_bf16_error"] = round(1000 * grouped_s, 2), error(y, dx)
    result["speedup"] = round(loop_s / grouped_s, 2)
    try:
        y, dx, _ = run(grouped, torch.float32, device, timed=False)
        result["grouped_fp32_error"] = error(y, dx)
    except RuntimeError as e:  # float32 grouped GEMM is not on every device and version
        result["grouped_fp32_error"] = f"not run: {str(e).splitlines()[0][:120]}"
    return result


def part_llama1b_muon(out: Path, small: bool) -> dict:
    return train_figures(out, "llama1b_muon", [*LLAMA_1B, "--optimizer.name", "Muon"], small, None)


def _document_ids(seqlen: int, documents: int, gen: torch.Generator) -> torch.Tensor:
    """(1, seqlen) ids of `documents` packed documents of uneven lengths (cut at random positions)."""
    cuts = torch.randperm(seqlen - 1, generator=gen)[: documents - 1] + 1
    starts = torch.zeros(1, seqlen, dtype=torch.long)
    starts[0, cuts] = 1
    return starts.cumsum(1)


def _relative_errors(outputs: list[torch.Tensor], references: list[torch.Tensor]) -> list[float]:
    return [float((o.float().cpu() - r).abs().max() / r.abs().max()) for o, r in zip(outputs, references)]


def block_causal_on(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """train.py's block_causal attention, its mask built from `ids` (once per forward in training)."""
    from torchtitan.models.documents import Documents, block_causal_attention

    return block_causal_attention(q, k, v, Documents(ids))


def _attention_and_grads(fn, q, k, v, ids, grad, dtype, device) -> list[torch.Tensor]:  # noqa: ANN001
    """fn's output and the gradients of q, k and v, on a copy of the inputs in `dtype` on `device`."""
    inputs = [t.to(device, dtype, copy=True).requires_grad_() for t in (q, k, v)]
    output = fn(*inputs, ids.to(device))
    output.backward(grad.to(device, dtype))
    return [output.detach(), *(t.grad for t in inputs)]


def part_attention_block_causal(out: Path, small: bool) -> dict:
    """block_causal attention as train.py runs it (FlexAttention with a compiled block mask on CUDA)
    against causal SDPA (flash), bf16, 32 heads of 64 (the 1B recipe's, kv heads repeated), forward +
    backward with the mask built in each (as once per forward in training): time and peak memory at 8K
    and 32K tokens with 8 and 64 documents of uneven lengths; and at 8K (8 heads) the values and
    gradients of FlexAttention and of the CPU path's SDPA per document segment run on the GPU, both in
    bf16, and FlexAttention in fp32, each against the CPU path in fp32."""
    import torch.nn.functional as F

    from torchtitan.models.documents import _segment_attention

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    heads, head_dim = (4, 16) if small else (32, 64)
    lengths, iters = ((512,), 1) if small else ((8192, 32768), 10)
    gen = torch.Generator().manual_seed(0)
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None

    def timed(fn, q, k, v, grad) -> tuple[float, float]:
        """(ms per forward + backward, peak MiB above what was allocated before)."""
        for _ in range(2):
            fn(q, k, v).backward(grad)
        sync()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() if device.type == "cuda" else 0
        start = time.perf_counter()
        for _ in range(iters):
            fn(q, k, v).backward(grad)
        sync()
        ms = 1000 * (time.perf_counter() - start) / iters
        peak = torch.cuda.max_memory_allocated() - before if device.type == "cuda" else 0
        return round(ms, 2), round(peak / 2**20, 1)

    def causal(q, k, v):  # noqa: ANN001, ANN202
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)

    result = {"device": str(device), "heads": heads, "head_dim": head_dim, "dtype": "bfloat16"}
    for seqlen in lengths:
        shape = (1, heads, seqlen, head_dim)
        q, k, v = (torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in "qkv")
        grad = torch.randn(1, seqlen, heads, head_dim, device=device, dtype=torch.bfloat16)
        row = {"causal_sdpa": timed(causal, q, k, v, grad)}
        for documents in (8, 64):
            ids = _document_ids(seqlen, documents, gen).to(device)
            row[f"block_causal_{documents}docs"] = timed(
                functools.partial(block_causal_on, ids=ids), q, k, v, grad
            )
        result[f"{seqlen}_tokens_ms_mib"] = row
        del q, k, v, grad

    seqlen, heads = (512, 4) if small else (8192, 8)
    for documents in (1, 8, 64):
        ids = _document_ids(seqlen, documents, gen)
        q, k, v = (torch.randn(1, heads, seqlen, head_dim, generator=gen) for _ in "qkv")
        grad = torch.randn(1, seqlen, heads, head_dim, generator=gen)

        cpu = torch.device("cpu")
        reference = _attention_and_grads(_segment_attention, q, k, v, ids, grad, torch.float32, cpu)
        errors = {
            name: _relative_errors(_attention_and_grads(fn, q, k, v, ids, grad, dtype, device), reference)
            for name, fn, dtype in [
                ("flex_bf16", block_causal_on, torch.bfloat16),
                ("segments_bf16", _segment_attention, torch.bfloat16),
                ("flex_fp32", block_causal_on, torch.float32),
            ]
        }
        result[f"errors_out_dq_dk_dv_{documents}docs"] = {
            name: [f"{e:.2e}" for e in values] for name, values in errors.items()
        }
    return result


def part_cp_attention_cuda(out: Path, small: bool) -> dict:
    """Context parallel's attention on the GPU (causal: SDPA with a lower-right causal bias per chunk;
    block_causal: FlexAttention with the documents' block mask at the rank's positions), for each
    rank of CP 2 in turn, in one process (the all-gather is the same on any device): the rank's
    outputs and the gradients of q, k and v against the whole sequence's attention on the CPU in fp32
    (one process), in fp32 and bf16. 8192 tokens, 8 heads of 64, 8 documents of uneven lengths."""
    import torch.nn.functional as F

    from torchtitan.models.documents import Documents, _segment_attention
    from torchtitan.parallelisms.context_parallel import (
        chunked_causal_attention,
        chunked_document_attention,
        rows_positions,
        sequence_layouts,
    )

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    seqlen, heads, head_dim, cp_degree = (1024, 4, 16, 2) if small else (8192, 8, 64, 2)
    gen = torch.Generator().manual_seed(0)
    ids = _document_ids(seqlen, 8, gen)
    q, k, v = (torch.randn(1, heads, seqlen, head_dim, generator=gen) for _ in "qkv")
    grad = torch.randn(1, seqlen, heads, head_dim, generator=gen)
    result = {"device": str(device), "seqlen": seqlen, "heads": heads, "cp_degree": cp_degree}
    for mask in ("causal", "block_causal"):
        layouts = sequence_layouts(seqlen, cp_degree, ids if mask == "block_causal" else None)
        for rank in range(cp_degree):
            positions = rows_positions(layouts, rank)[0]
            rows_ends = [[(p + 1) * piece for p in held[rank]] for piece, held in layouts]
            rank_grad = torch.zeros_like(grad)
            rank_grad[:, positions] = grad[:, positions]
            inputs = [t.clone().requires_grad_() for t in (q, k, v)]
            whole = (
                F.scaled_dot_product_attention(*inputs, is_causal=True).transpose(1, 2)
                if mask == "causal"
                else _segment_attention(*inputs, ids)
            )
            whole.backward(rank_grad)
            reference = [
                whole.detach()[:, positions],
                inputs[0].grad[:, :, positions],
                inputs[1].grad,
                inputs[2].grad,
            ]
            for dtype in (torch.float32, torch.bfloat16):
                inputs = [t.to(device, dtype, copy=True) for t in (q, k, v)]
                inputs[0] = inputs[0][:, :, positions]
                for t in inputs:
                    t.requires_grad_()
                if mask == "causal":
                    output = chunked_causal_attention(*inputs, rows_ends[0])
                else:
                    output = chunked_document_attention(*inputs, rows_ends, Documents(ids.to(device)))
                output.backward(grad[:, positions].to(device, dtype))
                errors = _relative_errors([output.detach(), *(t.grad for t in inputs)], reference)
                name = f"{mask}_rank{rank}_{str(dtype).split('.')[1]}_out_dq_dk_dv"
                result[name] = [f"{e:.2e}" for e in errors]
    return result


def part_cp_compiled_block_causal(out: Path, small: bool) -> dict:
    """The 128K recipe's combination on one GPU: context parallel's attention modules (a 1-rank cp mesh,
    the sequence dealt by the documents' work as on more ranks), blocks compiled whole (fullgraph),
    block_causal, fp32: the loss and every gradient against the same model without CP, and dynamo's
    graphs (the documents' layout and block mask are made before the blocks)."""
    import copy

    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan.models.documents import find_documents
    from torchtitan.models.llama import ModelArgs
    from torchtitan.models.llama.model import Transformer
    from torchtitan.parallelisms.context_parallel import apply_cp

    _torch_2_11_names()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT="29517")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("cp",))
    seqlen = 1024 if small else 8192
    args = ModelArgs(
        dim=256, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=1024, max_seq_len=seqlen,
        attn_mask_type="block_causal", eos_id=1,
    )  # fmt: skip
    with torch.device("meta"):
        reference = Transformer(args)
    reference.to_empty(device=device)
    reference.init_weights()
    cp_model = copy.deepcopy(reference)
    apply_cp(cp_model, mesh["cp"])
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(2, args.vocab_size, (2, seqlen + 1), generator=gen)
    tokens[:, torch.randperm(seqlen, generator=gen)[:7]] = 1  # 8 documents per row, uneven
    tokens = tokens.to(device)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    if device.type == "cuda":
        for model in (reference, cp_model):
            for layer_id, block in model.layers.items():
                model.layers.register_module(layer_id, torch.compile(block, fullgraph=True))
    losses = []
    for model, kwargs in ((reference, {}), (cp_model, {"document_ids": find_documents(inputs, 1, None)})):
        for _ in range(2):  # the second step runs the compiled code
            model.zero_grad()
            logits = model(inputs, **kwargs)
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
            loss.backward()
        losses.append(loss.item())
    gradient_error = max(
        float((a.grad - b.grad).abs().max() / b.grad.abs().max())
        for a, b in zip(cp_model.parameters(), reference.parameters())
    )
    counters = torch._dynamo.utils.counters
    dist.destroy_process_group()
    return {
        "device": str(device), "seqlen": seqlen, "loss_cp_vs_reference": losses[::-1],
        "max_gradient_error": f"{gradient_error:.2e}", "unique_graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
    }  # fmt: skip


def _torch_2_11_names() -> None:
    """Context parallel's gather under the name torch < 2.12 (the device machine's 2.11) gives it."""
    import torch.distributed._functional_collectives as funcol

    if not hasattr(funcol, "all_gather_single"):
        funcol.all_gather_single = funcol.all_gather_tensor_autograd


def _train_rank(rank: int, world_size: int, port: int, argv: list[str]) -> None:
    """One rank of a job whose ranks share this machine's one GPU (a process started by mp.spawn)."""
    import torch.distributed as dist

    _torch_2_11_names()
    if "1B-2layers" in argv:
        flavor_with_layers("llama3", "1B", 2)
    os.environ.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(world_size))
    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)  # train.py takes this group as it is
    code = runpy.run_path(str(ROOT / "train.py"))["main"](parse_args(argv))
    if code:
        raise SystemExit(code)


def _one_process_and_two_ranks(
    out: Path, name: str, base: list[str], variants: dict[str, list[str]], two_ranks: list[str]
) -> dict:
    """Each variant of train.py in this process and as two ranks (with the options `two_ranks`)
    sharing the one GPU over gloo (NCCL refuses two ranks on one device; the collectives are copied
    through the host, so nothing here says anything of speed): the largest loss difference, and
    rank 0's memory and compiled graphs (graphs, breaks) in each."""
    import torch.multiprocessing as mp

    result: dict = {"device": "cuda" if torch.cuda.is_available() else "cpu"}
    for variant, extra in variants.items():
        runs = {}
        for ranks in (1, 2):
            dump = out / f"{name}_{variant}_{ranks}"
            argv = [*base, *extra, "--job.dump_folder", str(dump), *(two_ranks if ranks == 2 else [])]
            if ranks == 1:
                runpy.run_path(str(ROOT / "train.py"))["main"](parse_args(argv))
            else:  # spawned: this process has CUDA initialised, which a fork could not use
                mp.spawn(_train_rank, args=(ranks, 29531, argv), nprocs=ranks)
            with open(dump / "metrics.jsonl") as f:
                runs[ranks] = [r for r in map(json.loads, f) if "loss" in r]
        one, two = runs[1], runs[2]
        result[variant] = {
            "max_loss_difference": f"{max(abs(a['loss'] - b['loss']) for a, b in zip(one, two)):.2e}",
            "losses_one_process": [round(r["loss"], 5) for r in one],
            "memory_gib_one_two": [round(one[-1]["memory_gib"], 2), round(two[-1]["memory_gib"], 2)],
            "graphs_breaks_one_two": [
                (r[-1].get("compiled_graphs"), r[-1].get("graph_breaks")) for r in (one, two)
            ],
        }
    return result


def _two_layers_of_1b(small: bool, seqlen: int) -> list[str]:
    """The 1B recipe at batch 1, cut to 2 layers (the debug model with --small), 10 steps."""
    argv = [
        "--job.config_file", str(ROOT / "train_configs" / "llama3_1b.toml"),
        "--training.batch_size", "1", "--training.seq_len", str(seqlen), "--training.global_batch_size", "-1",
        *COMMON, "1", "--training.steps", "10",
    ]  # fmt: skip
    if small:
        return [*argv, "--model.flavor", "debugmodel", "--model.vocab_size", "-1"]
    return [*argv, "--model.flavor", flavor_with_layers("llama3", "1B", 2)]  # spawned ranks register it too


def part_cp2_one_gpu(out: Path, small: bool) -> dict:
    """Context parallel's CUDA branch end to end: train.py at CP 2 against one process, in fp32 and
    bf16, eager, block_causal documents at 8192 tokens: the losses, and each rank's memory."""
    base = _two_layers_of_1b(small, 512 if small else 8192)
    base += ["--training.compile", "false", "--model.attn_mask_type", "block_causal"]
    variants = {dtype: ["--training.mixed_precision_param", dtype] for dtype in ("float32", "bfloat16")}
    cp2 = ["--parallelism.context_parallel_degree", "2"]
    return _one_process_and_two_ranks(out, "cp2_one_gpu", base, variants, cp2)


def part_fsdp2_one_gpu(out: Path, small: bool) -> dict:
    """The bf16 semantics under FSDP 2 (one GPU runs no FSDP): train.py at FSDP 2 against one
    process, bf16, compiled, with the blocks gathered in bf16 (norms as fp32 units of their own) and
    in fp32 (one unit per block): the losses, rank 0's memory and the graphs dynamo compiled."""
    base = _two_layers_of_1b(small, 256 if small else 2048)
    base += ["--training.compile", "true", "--training.mixed_precision_param", "bfloat16"]
    # The same 2 sequences a step: one on each rank, or 2 micro-batches in one process.
    base += ["--training.global_batch_size", "2"]
    variants = {f"gather_{d}": ["--parallelism.fsdp_gather_dtype", d] for d in ("bfloat16", "float32")}
    return _one_process_and_two_ranks(out, "fsdp2_one_gpu", base, variants, [])  # FSDP takes both ranks


def part_host_syncs(out: Path, small: bool) -> dict:
    """CUDA's sync debug mode over the Qwen3-MoE debug recipe, eager, bf16, 6 steps logging at 1, 3
    and 6: the host-device syncs counted between one step's update and the next one's, from step 1
    on (docs/performance.md: only the logging steps' should remain)."""
    import warnings

    from torchtitan.metrics import MetricLogger

    per_step, steps_done, step_done = {}, [0], MetricLogger.step_done

    def counting_step_done(self) -> None:
        steps_done[0] += 1
        if steps_done[0] == 1 and torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("warn")
        step_done(self)

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" in str(message):
            where = f"step {steps_done[0]}"
            per_step[where] = per_step.get(where, 0) + 1

    MetricLogger.step_done = counting_step_done
    warnings.showwarning = record
    warnings.simplefilter("always")
    argv = [
        "--job.config_file", str(ROOT / "train_configs" / "qwen3_moe_debug.toml"),
        "--training.mixed_precision_param", "bfloat16", "--moe.bias_update_rate", "0.01",
        "--metrics.log_freq", "3", "--training.steps", "6", "--job.dump_folder", str(out / "host_syncs"),
        "--checkpoint.enable_checkpoint", "false", "--validation.enable", "false",
    ]  # fmt: skip
    code = runpy.run_path(str(ROOT / "train.py"))["main"](parse_args(argv))
    return {
        "exit": code,
        "device": "cuda" if torch.cuda.is_available() else "cpu (nothing counted)",
        **per_step,
    }


def part_torchtitan_1b(out: Path, small: bool) -> dict:
    """compare_torchtitan/run.sh: the torchtitan wheel, installed from .whl/ into its own
    folder so that this repository's torchtitan/ never shadows it."""
    env = {**os.environ, "TT_SITE": "/tmp/torchtitan_site", "TT_STEPS": str(STEPS)}
    if small:
        env.update(TT_SMOKE="1", TT_STEPS="8")
    runner = Path(__file__).parent / "compare_torchtitan" / "run.sh"
    subprocess.run(["bash", str(runner), str(out / "torchtitan_1b")], cwd=ROOT, env=env, timeout=200)
    summary = json.loads((out / "torchtitan_1b" / "torchtitan_summary.json").read_text())
    keep = ("tps", "mfu", "memory_gib", "steps", "exit_code", "tps_median", "mfu_ours_formula")
    return {"torchtitan": {k: summary.get(k) for k in keep}}


PARTS = {  # name: (function, estimated seconds on an H100), in priority order
    "llama1b": (part_llama1b, 75),
    "torchtitan_1b": (part_torchtitan_1b, 100),
    "moe_grouped_mm": (part_moe_grouped_mm, 30),
    "llama1b_block_causal": (part_llama1b_block_causal, 60),
    "attention_block_causal": (part_attention_block_causal, 60),
    "cp_attention_cuda": (part_cp_attention_cuda, 30),
    "cp_compiled_block_causal": (part_cp_compiled_block_causal, 40),
    "cp2_one_gpu": (part_cp2_one_gpu, 90),
    "fsdp2_one_gpu": (part_fsdp2_one_gpu, 150),
    "llama1b_muon": (part_llama1b_muon, 75),
    "host_syncs": (part_host_syncs, 30),
    "llama8b_4layers": (part_llama8b_4layers, 70),
    "llama1b_chunked_loss": (part_llama1b_chunked_loss, 50),
    "llama1b_fp8_tensorwise": (part_llama1b_fp8_tensorwise, 70),
    "llama1b_fp8_rowwise": (part_llama1b_fp8_rowwise, 70),
    "qwen3_moe_2layers": (part_qwen3_moe_2layers, 70),
}


def run_parts(out: Path, names: list[str], budget: float, small: bool) -> dict:
    """Each part in a fresh process (train.py's main() disables GC and compiles), skipped when its
    estimate does not fit in what is left of `budget`, stopped when it runs past it."""
    start, results = time.perf_counter(), {}
    for name in names:
        left = budget - (time.perf_counter() - start)
        if not small and left < PARTS[name][1]:
            results[name] = {"skipped": f"{left:.0f} s left, needs about {PARTS[name][1]} s"}
            continue
        cmd = [sys.executable, __file__, "--part", name, "--out", str(out)] + (["--small"] if small else [])
        log = out / f"{name}.log"
        began = time.perf_counter()
        try:
            with open(log, "w") as f:
                code = subprocess.run(
                    cmd, stdout=f, stderr=subprocess.STDOUT, timeout=max(left, 1)
                ).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
        result_file = out / f"{name}.json"
        if code == 0 and result_file.exists():
            results[name] = json.loads(result_file.read_text())
        else:
            tail = log.read_text().strip().splitlines()[-3:]
            results[name] = {"failed": f"exit {code}: {' | '.join(tail)[-400:]}"}
        results[name]["part_s"] = round(time.perf_counter() - began, 1)
        (out / "results.json").write_text(json.dumps(results, indent=1))
        print(f"{name}: {json.dumps(results[name])}", flush=True)
    return results


def print_table(results: dict) -> None:
    print("\n| part | tokens/s | MFU % | memory GiB | step ms | graphs (breaks) | part s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, r in results.items():
        if "tps" in r:
            graphs = f"{r['unique_graphs']} ({r['graph_breaks']})"
            cells = [f"{r['tps']:,}", r["mfu_pct"], r["memory_gib"], r["step_ms"], graphs, r["part_s"]]
        elif "torchtitan" in r:
            t = r["torchtitan"]
            cells = [f"{t['tps']:,}", t["mfu"], t["memory_gib"], "", "", r["part_s"]]
        elif "speedup" in r:
            errors = {k: v for k, v in r.items() if k.endswith("_error")}
            what = f"loop {r['loop_ms']} ms, grouped {r['grouped_ms']} ms: x{r['speedup']}; errors {errors}"
            cells = [what, "", "", "", "", r["part_s"]]
        else:
            what = json.dumps({k: v for k, v in r.items() if k != "part_s"})
            cells = [what, "", "", "", "", r.get("part_s", "")]
        print(f"| {name} | " + " | ".join(map(str, cells)) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for each part's log and results.json")
    parser.add_argument("--budget", type=float, default=480, help="seconds for all parts together")
    parser.add_argument("--only", help="comma-separated parts, in the given order")
    parser.add_argument("--small", action="store_true", help="tiny shapes on any device: checks the script")
    parser.add_argument("--part", help=argparse.SUPPRESS)  # one part, in this process
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("WANDB_MODE", "disabled")
    if args.part:
        result = PARTS[args.part][0](args.out, args.small)
        (args.out / f"{args.part}.json").write_text(json.dumps(result))
        return
    names = args.only.split(",") if args.only else list(PARTS)
    unknown = [n for n in names if n not in PARTS]
    if unknown:
        parser.error(f"--only: no part {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    env = f"torch {torch.__version__}"
    if torch.cuda.is_available():
        env += f", {torch.cuda.get_device_name()}"
    print(f"benchmark_gpu: {env}", flush=True)
    print_table(run_parts(args.out, names, args.budget, args.small))


if __name__ == "__main__":
    main()
