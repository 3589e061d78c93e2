"""benchmark_gpu.py's side-by-side train.py parts (issue 60): DeepSeek-V3 at the 671B flavour's width
(and torchtitan 0.3.0's deepseek_v3 at the same shape), the 1B recipe with one MFU lever changed at a
time, and packed conversations against pre-training data. Every variant runs train.py's main() in the
same process one after the other (dynamo reset between them), so that each row's ratio to its
baseline is measured on the same machine in the same call."""

import contextlib
import gc
import json
import os
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import torch

from scripts.benchmarks.gpu_train import LLAMA_1B, ROOT, train_figures
from torchtitan.models import MODEL_SPECS

LEVER_STEPS = 20  # the window logged is steps 11-20: compile is out of it


def setup() -> dict:
    """What a figure was measured on."""
    cuda = torch.cuda.is_available()
    return {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__}


def side_by_side(
    out: Path,
    name: str,
    variants: dict[str, tuple[list[str], Callable[[], contextlib.AbstractContextManager] | None, tuple]],
    small: bool,
    steps: int = LEVER_STEPS,
) -> dict:
    """Each variant (argv, a context to run it in or None, its --small extra options) through
    train.py in this process, the first one the baseline: its figures and its ratios to the baseline
    (tokens/s, MFU, memory). Compiled code, dynamo's counters and the allocator's cache are reset
    between variants, so that each compiles and counts its own graphs, and its memory is its own."""
    rows: dict = {}
    for variant, (argv, context, small_extra) in variants.items():
        release_gpu()  # train.py leaves the collector off: the last variant's cycles go here
        torch._dynamo.utils.counters.clear()
        try:
            with context() if context else contextlib.nullcontext():
                row = train_figures(out, f"{name}_{variant}", argv, small, None, steps, small_extra)
        except (Exception, SystemExit) as e:  # one lever failing (a backend refusing) leaves the others
            rows[variant] = {
                "failed": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            }
            continue
        base = rows[next(iter(variants))] if rows else row
        if "tps" not in base:
            rows[variant] = row  # no baseline to compare with
            continue
        row["tps_ratio"] = round(row["tps"] / base["tps"], 3)
        if row["mfu_pct"] is not None and base["mfu_pct"]:
            row["mfu_ratio"] = round(row["mfu_pct"] / base["mfu_pct"], 3)
        row["memory_ratio"] = round(row["memory_gib"] / base["memory_gib"], 3) if base["memory_gib"] else None
        rows[variant] = row
    return {**setup(), "baseline": next(iter(variants)), "rows": rows}


# DeepSeek-V3 at the 671B flavour's width: dim 7168, 128 heads of MLA (q LoRA 1536, kv latent 512, qk
# 128 + 64, v 128), dense SwiGLU 18432, experts of 2048 with a shared one, top 8 of 8 groups (4 kept),
# sigmoid scores, scale 2.5, YaRN 40; cut to 2 layers, the first dense, the second a MoE. The expert
# count is cut to what one GPU holds with fp32 weights, gradients and AdamW (16 bytes a parameter):
# 32 experts (4 a group, so the group-limited top 8 still chooses among 16) on a 141 GB H200, 4.08 B
# parameters, ~65 GB of state; 16 on an 80 GB H100 (2 a group: the top 8 of 4 groups is all of them,
# only the group choice routes), 3.37 B, ~54 GB. The released vocabulary's 129,280 rows (2.0 GB of
# embedding and output each in fp32) with the bundled tokenizer's ids. Active parameters per token:
# all but the unchosen experts, whatever the count (the 671B's per-token compute in these 2 layers).
DSV3_LAYERS, DSV3_DENSE = 2, 1


def dsv3_experts() -> int:
    """32 experts where the GPU has over 100 GiB (H200), else 16 (H100)."""
    if torch.cuda.is_available() and torch.cuda.get_device_properties(0).total_memory > 100 * 2**30:
        return 32
    return 16


def dsv3_width_flavor(experts: int) -> str:
    """Register the 671B flavour at 2 layers and `experts` experts (a flavour of this process only)."""
    flavors = MODEL_SPECS["deepseek_v3"].flavors
    name = f"671B-{DSV3_LAYERS}layers-{experts}experts"
    flavors[name] = replace(
        flavors["671B"], n_layers=DSV3_LAYERS, first_k_dense_replace=DSV3_DENSE, num_experts=experts
    )
    return name


def dsv3_argv(small: bool, experts: int) -> list[str]:
    """The 671B recipe's training settings (AdamW fused, bf16 autocast with fp32 reduction, compiled
    blocks, the routing bias alone balancing, 1 x 4096 tokens a step as one of its micro-batches)
    on the bundled corpus and tokenizer, without activation checkpointing (2 layers fit) or
    parallelism."""
    argv = [
        "--job.config_file", str(ROOT / "train_configs" / "deepseek_v3_debug.toml"),
        "--model.vocab_size", "129280", "--model.attn_mask_type", "causal",
        "--moe.aux_loss_weight", "0", "--moe.bias_update_rate", "0.001",
        "--moe.sequence_aux_loss_weight", "0",
        "--optimizer.implementation", "fused", "--optimizer.lr", "2.2e-4",
        "--lr_scheduler.warmup_steps", "10",
        "--training.batch_size", "1", "--training.seq_len", "4096", "--training.global_batch_size", "-1",
        "--training.mixed_precision_param", "bfloat16", "--training.compile", "true",
    ]  # fmt: skip
    if not small:
        argv += ["--model.flavor", dsv3_width_flavor(experts)]
    return argv


def part_deepseek_v3_671b_width(out: Path, small: bool) -> dict:
    """Our DeepSeek-V3 at the 671B width (above), train.py, bf16, compiled: tokens/s, MFU on the active
    parameters (train.py's deepseek_flops_per_token), peak memory, graphs; then torchtitan 0.3.0's
    deepseek_v3 at the same shape and routing (compare_torchtitan/run.sh, TT_MODEL=dsv3), if the wheel
    is in .whl/: its figures and the ratio ours / theirs."""
    experts = dsv3_experts()
    variants = {"ours": (dsv3_argv(small, experts), None, ())}
    result = side_by_side(out, "deepseek_v3_671b_width", variants, small, steps=30)
    result.update(layers=DSV3_LAYERS, dense_layers=DSV3_DENSE, experts=experts, tokens_per_step=4096)
    if small:
        result["flavor"] = "debugmodel (--small)"
    result["torchtitan_dsv3"] = torchtitan_run(
        out / "torchtitan_dsv3", small, {"TT_MODEL": "dsv3", "TT_EXPERTS": str(experts)}
    )
    theirs, ours = result["torchtitan_dsv3"], result["rows"]["ours"]
    if isinstance(theirs, dict) and theirs.get("tps") and ours.get("tps"):
        result["tps_ours_over_torchtitan"] = round(ours["tps"] / theirs["tps"], 3)
    return result


def release_gpu() -> None:
    """Give back what this process's runs hold on the GPU (compiled code, cycles, the allocator's
    cache), so that a process started next has the device to itself."""
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def torchtitan_run(dump: Path, small: bool, env: dict[str, str]) -> dict | str:
    """compare_torchtitan/run.sh with `env`: its summary, or why there is none. Our run's memory
    is released first: the two 4 B-parameter models would not fit on the GPU together."""
    release_gpu()
    if not any((ROOT / ".whl").glob("torchtitan-0.3.0-*.whl")):
        return "not run: no .whl/torchtitan-0.3.0-py3-none-any.whl (see benchmark_gpu.py's docstring)"
    env = {**os.environ, "TT_SITE": "/tmp/torchtitan_site", "TT_STEPS": "30", "TT_TIMEOUT": "200", **env}
    if small:
        env.update(TT_SMOKE="1", TT_STEPS="6")
    runner = Path(__file__).parent / "compare_torchtitan" / "run.sh"
    done = subprocess.run(["bash", str(runner), str(dump)], cwd=ROOT, env=env, timeout=240, check=False)
    summary = dump / "torchtitan_summary.json"
    if not summary.exists():
        return f"failed: exit {done.returncode}, see {dump}/torchtitan.log"
    keep = ("tps", "mfu", "memory_gib", "steps", "exit_code", "tps_median")
    return {k: json.loads(summary.read_text()).get(k) for k in keep}


@contextlib.contextmanager
def sdpa_cudnn_only() -> Iterator[None]:
    """SDPA's cuDNN backend alone on CUDA (flash, memory-efficient and math off, so that a refusal is
    an error, never a silent fallback): a benchmark hook, not a trainer option. Nothing on the CPU."""
    if not torch.cuda.is_available():
        yield
        return
    b = torch.backends.cuda
    saved = (
        b.flash_sdp_enabled(),
        b.mem_efficient_sdp_enabled(),
        b.math_sdp_enabled(),
        b.cudnn_sdp_enabled(),
    )
    b.enable_flash_sdp(False), b.enable_mem_efficient_sdp(False), b.enable_math_sdp(False)
    b.enable_cudnn_sdp(True)
    try:
        yield
    finally:
        for enable, on in zip(
            (b.enable_flash_sdp, b.enable_mem_efficient_sdp, b.enable_math_sdp, b.enable_cudnn_sdp), saved
        ):
            enable(on)


def sdpa_choice(q_shape: tuple[int, ...], v_head_dim: int | None = None) -> str:
    """The backend causal SDPA dispatches to for bf16 queries, keys and values of these shapes
    (keys as queries, values' last dimension v_head_dim) under the current settings, on this
    device: torch._fused_sdp_choice, the dispatcher's own choice."""
    from torch.nn.attention import SDPBackend

    device = "cuda" if torch.cuda.is_available() else "cpu"
    q = torch.empty(q_shape, device=device, dtype=torch.bfloat16)
    v = q if v_head_dim is None else torch.empty(*q_shape[:-1], v_head_dim, device=device, dtype=q.dtype)
    choice = torch._fused_sdp_choice(q, q, v, is_causal=True)
    return next((name for name, b in SDPBackend.__members__.items() if int(b) == choice), str(choice))


def coordinate_descent() -> contextlib.AbstractContextManager:
    import torch._inductor.config as inductor_config

    return inductor_config.patch(coordinate_descent_tuning=True)


def part_mfu_levers_1b(out: Path, small: bool) -> dict:
    """llama1b (the 1B model, causal SDPA, full logits, 4 x 2048 tokens a step, compiled, bf16: the
    47% MFU row) with one lever changed at a time, 20 steps each: SDPA's cuDNN backend alone (train.py
    has no backend option: SDPA's own dispatch picks, recorded as sdpa_backend_default), 2 x 4096
    tokens a step, inductor's coordinate_descent_tuning, the chunked loss (loss_chunk_tokens 2048, as
    the recipe has it). Each row's ratios are to llama1b's."""
    variants = {
        "recipe": (LLAMA_1B, None, ()),
        "sdpa_cudnn": (LLAMA_1B, sdpa_cudnn_only, ()),
        "batch_2x4096": ([*LLAMA_1B, "--training.batch_size", "2", "--training.seq_len", "4096"], None,
                         ("--training.batch_size", "2", "--training.seq_len", "512")),
        "coordinate_descent": (LLAMA_1B, coordinate_descent, ()),
        "chunked_loss_2048": ([*LLAMA_1B, "--training.loss_chunk_tokens", "2048"], None, ()),
    }  # fmt: skip
    result = side_by_side(out, "mfu_levers_1b", variants, small)
    shape = (4, 32, 2048, 64)  # the 1B's attention: batch, heads, tokens, head dim
    result["sdpa_backend_default"] = sdpa_choice(shape)
    with sdpa_cudnn_only():
        result["sdpa_backend_in_sdpa_cudnn"] = sdpa_choice(shape)
    return result


def part_chat_vs_pretrain(out: Path, small: bool) -> dict:
    """The 1B recipe's model and step (block_causal, chunked loss, 4 x 2048 tokens, compiled, bf16)
    on pre-training text (kjv) and on packed conversations (chat.enable, the bundled kjv_chat: 48
    short conversations, several packed whole per window, the loss on the assistant's tokens), both
    with the bundled Hugging Face tokenizer: step time, tokens/s and MFU, chat's ratio to text."""
    base = [
        "--job.config_file", str(ROOT / "train_configs" / "llama3_1b.toml"),
        "--model.tokenizer_path", str(ROOT / "assets" / "tokenizer" / "kjv_bpe_hf"),
        "--model.attn_mask_type", "block_causal", "--training.global_batch_size", "-1",
    ]  # fmt: skip
    chat = [*base, "--chat.enable", "true", "--training.dataset", "kjv_chat"]
    variants = {"pretrain_kjv": (base, None, ()), "chat_kjv_chat": (chat, None, ())}
    return side_by_side(out, "chat_vs_pretrain", variants, small)
