"""benchmark.py's document-masking rows: block_causal against causal attention on one long
sequence of packed documents, peak memory and step time (model.attn_mask_type, docs/attention.md)."""

import time
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F

MASK_SEQ_LEN = 8192
MASK_DOCUMENTS = (1, 8, 64)  # documents per sequence, of equal length
EOS = 2


def part_attention_mask(tmp: str) -> dict:
    """The debug Llama (fp32, one thread) on one sequence of MASK_SEQ_LEN tokens, forward + backward:
    causal, and block_causal with each count of MASK_DOCUMENTS; the peak of the bytes the CPU
    allocator held over the step (the profiler's memory events) and the best CPU time of 3 steps."""
    from torch.profiler import record_function

    from torchtitan.memory_estimation.measure import cpu_peak
    from torchtitan.models import MODEL_SPECS
    from torchtitan.models.llama import llama3_configs

    torch.set_num_threads(1)
    args = replace(llama3_configs["debugmodel"], vocab_size=2048, max_seq_len=MASK_SEQ_LEN, eos_id=EOS)
    tokens = torch.randint(
        3, args.vocab_size, (1, MASK_SEQ_LEN + 1), generator=torch.Generator().manual_seed(0)
    )
    result = {}
    for name, documents in [("causal", 1), *((f"block_causal_{n}", n) for n in MASK_DOCUMENTS)]:
        model = MODEL_SPECS["llama3"].build(
            replace(args, attn_mask_type="causal" if name == "causal" else "block_causal")
        )
        model.init_weights(0)
        window = tokens.clone()
        window[0, MASK_SEQ_LEN // documents - 1 :: MASK_SEQ_LEN // documents] = EOS  # each ends with EOS

        step(model, window)
        seconds = []
        for _ in range(3):
            start = time.process_time()
            step(model, window)
            seconds.append(time.process_time() - start)
        profiler = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
        )
        with profiler, record_function("measured_step"):
            step(model, window)
        result[name] = {"peak": cpu_peak(profiler, "measured_step"), "seconds": min(seconds)}
    return result


def step(model: torch.nn.Module, window: torch.Tensor) -> None:
    loss = F.cross_entropy(model(window[:, :-1]).flatten(0, 1), window[0, 1:])
    loss.backward()
    model.zero_grad(set_to_none=True)


def attention_mask_rows(run_part: Callable[..., dict], add: Callable[..., None]) -> None:
    r = run_part("attention_mask")
    causal = r["causal"]
    setup = f"debug Llama, 1 x {MASK_SEQ_LEN} tokens, fp32, 1 thread, forward + backward"
    for n in MASK_DOCUMENTS:
        b = r[f"block_causal_{n}"]
        memory, seconds = b["peak"] / causal["peak"], b["seconds"] / causal["seconds"]
        goal = n == 8
        add(
            f"document mask memory: block_causal / causal, {n} documents",
            memory,
            "<= 1.1" if goal else "(reported)",
            not goal or memory <= 1.1,
            f"peak {b['peak'] / 2**20:,.0f} vs {causal['peak'] / 2**20:,.0f} MiB ({setup})",
            b,
        )
        add(
            f"document mask step time: block_causal / causal, {n} documents",
            seconds,
            "<= 1.0" if goal else "(reported)",
            not goal or seconds <= 1.0,
            f"{b['seconds']:.2f} vs {causal['seconds']:.2f} s, CPU time ({setup})",
            b,
        )
