"""benchmark_gpu.py's kernel parts, each in one process, its values and gradients against the CPU path
in fp32: the experts' grouped GEMM against a matmul per expert, block_causal attention (FlexAttention)
against causal SDPA, and context parallel's CUDA attention for each rank's pieces."""

import functools
import time
from pathlib import Path

import torch


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


def part_mla_attention(out: Path, small: bool) -> dict:
    """Multi-head latent attention (DeepSeek-V3's Attention module at the 671B width: dim 7168, 128
    heads, q LoRA 1536, kv latent 512, qk 128 + 64, v 128, YaRN) forward + backward on 1 x 4096 tokens,
    bf16 weights, eager and compiled, against its attention core alone: causal SDPA on the same head
    dims (q and k 192, v 128), by default dispatch and by each backend forced (one that refuses the
    shapes says so), and flash with v padded to 192. Times in ms; each row's ratio to the default
    SDPA core; each SDPA output's error against the default's, which backend ran being the question."""
    from contextlib import nullcontext

    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from torchtitan.models.deepseek_v3 import deepseek_v3_configs
    from torchtitan.models.deepseek_v3.model import Attention, precompute_freqs_cis

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args = deepseek_v3_configs["debugmodel" if small else "671B"]
    seqlen, iters = (256, 1) if small else (4096, 10)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # CPU: bf16 matmuls are emulated
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None

    def timed(fn) -> float:  # noqa: ANN001
        for _ in range(1 if small else 3):
            fn()
        sync()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        return round(1000 * (time.perf_counter() - start) / iters, 3)

    from torchtitan.models.init import seeded_init

    with torch.device(device):
        module = Attention(args)
    with seeded_init(module, seed=0):
        module.init_weights(0.02)
    module.to(dtype)
    freqs = precompute_freqs_cis(args, device)[:seqlen]
    x = torch.randn(1, seqlen, args.dim, device=device, dtype=dtype, requires_grad=True)
    grad_x = torch.randn_like(x)
    result = {"device": str(device), "torch": torch.__version__, "dtype": str(dtype), "seqlen": seqlen}
    result.update(heads=args.n_heads, qk_head_dim=args.head_dim, v_head_dim=args.v_head_dim, dim=args.dim)
    ms = {"mla_module_eager": timed(lambda: module(x, freqs).backward(grad_x))}
    compiled = torch.compile(module)
    ms["mla_module_compiled"] = timed(lambda: compiled(x, freqs).backward(grad_x))

    shape = (1, args.n_heads, seqlen)
    q, k = (torch.randn(*shape, args.head_dim, device=device, dtype=dtype, requires_grad=True) for _ in "qk")
    v = torch.randn(*shape, args.v_head_dim, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(*shape, args.v_head_dim, device=device, dtype=dtype)

    def core(backend: SDPBackend | None):  # noqa: ANN202
        def step() -> torch.Tensor:
            # A fresh context each call: sdpa_kernel's is a generator's, good for one `with` only.
            with sdpa_kernel([backend]) if backend is not None else nullcontext():
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                y.backward(grad)
            return y.detach()

        return step

    def padded_flash() -> torch.Tensor:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            v_pad = F.pad(v, (0, args.head_dim - args.v_head_dim))
            y = F.scaled_dot_product_attention(q, k, v_pad, is_causal=True)[..., : args.v_head_dim]
            y.backward(grad)
        return y.detach()

    reference = core(None)()
    errors = {}
    candidates = {"sdpa_default": core(None), "sdpa_v_padded_flash": padded_flash}
    for backend in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"):
        candidates[f"sdpa_{backend.split('_')[0].lower()}"] = core(getattr(SDPBackend, backend))
    for name, fn in candidates.items():
        try:
            errors[name] = (
                f"{float((fn().float() - reference.float()).abs().max() / reference.abs().max()):.1e}"
            )
            ms[name] = timed(fn)
        except RuntimeError as e:  # a backend that does not take these shapes (or this device)
            ms[name] = f"not run: {str(e).splitlines()[0][:100]}"
    from scripts.benchmarks.gpu_recipes import sdpa_choice

    result["sdpa_backend_default"] = sdpa_choice(tuple(q.shape), args.v_head_dim)
    base = ms["sdpa_default"]
    result["ms"] = ms
    result["ratio_to_sdpa_default"] = {n: round(t / base, 3) for n, t in ms.items() if isinstance(t, float)}
    result["error_vs_sdpa_default"] = errors
    return result
