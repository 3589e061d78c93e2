"""benchmark_gpu.py's parallelism parts on one GPU: context parallel's attention modules with compiled
blocks on a 1-rank mesh, and train.py at CP 2 and at FSDP 2 as two ranks sharing the GPU over gloo,
each against one process."""

import json
import os
import runpy
from pathlib import Path

import torch

from scripts.benchmarks.gpu_train import COMMON, ROOT
from torchtitan.config.parser import parse_args


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
    return [*argv, "--model.flavor", "1B", "--model.n_layers", "2"]


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
