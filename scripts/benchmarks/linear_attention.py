"""benchmark.py's linear-attention rows (Qwen3.5, issue 65): a Gated DeltaNet layer's time per token at
1K to 8K tokens beside a gated full-attention layer of the same width (linear cost: flat; attention's
grows with the sequence), and the hybrid debug model's step against the same model with every layer
full attention, at 8K."""

import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial

import torch

from scripts.benchmarks.attention import step

LENGTHS = (1024, 2048, 4096, 8192)
LINEAR, FULL = "linear_attention", "full_attention"


def _best_cpu_seconds(run: Callable[[], None], repeats: int = 3) -> float:
    run()  # warm-up
    seconds = []
    for _ in range(repeats):
        start = time.process_time()
        run()
        seconds.append(time.process_time() - start)
    return min(seconds)


def _layer_step(mixer: torch.nn.Module, x: torch.Tensor, freqs_cis: torch.Tensor) -> None:
    mixer(x, freqs_cis).sum().backward()
    mixer.zero_grad(set_to_none=True)


def part_linear_attention(tmp: str) -> dict:
    """The Qwen3.5 debug flavour's width (fp32, one thread): one layer of each kind, forward + backward on
    1 x T tokens for each T of LENGTHS, best CPU time of 3; then the whole debug model (3 Gated DeltaNet
    blocks, 1 attention) and the same with every block attention, one step on 1 x 8192 tokens."""
    from torchtitan.models import MODEL_SPECS
    from torchtitan.models.qwen3_5 import qwen3_5_configs

    torch.set_num_threads(1)
    spec = MODEL_SPECS["qwen3_5"]
    args = replace(qwen3_5_configs["debugmodel"], vocab_size=2048, max_seq_len=max(LENGTHS))
    result: dict = {}
    for kind in (LINEAR, FULL):
        model = spec.build(replace(args, n_layers=1, layer_types=(kind,)))
        model.init_weights(0)
        mixer = model.layers["0"].attention
        for length in LENGTHS:
            x = torch.randn(
                1, length, args.dim, generator=torch.Generator().manual_seed(0), requires_grad=True
            )
            result[f"{kind}_{length}"] = _best_cpu_seconds(partial(_layer_step, mixer, x, model.freqs_cis))
    tokens = torch.randint(
        0, args.vocab_size, (1, max(LENGTHS) + 1), generator=torch.Generator().manual_seed(0)
    )
    for name, types in (("hybrid", None), ("all_attention", (FULL,) * args.n_layers)):
        model = spec.build(replace(args, layer_types=types))
        model.init_weights(0)
        result[name] = _best_cpu_seconds(partial(step, model, tokens), repeats=2)
    return result


def linear_attention_rows(run_part: Callable[..., dict], add: Callable[..., None]) -> None:
    r = run_part("linear_attention")
    setup = "Qwen3.5 debug width (dim 256), fp32, 1 thread, forward + backward, best CPU time"
    short, long = LENGTHS[0], LENGTHS[-1]
    per_token = {kind: [r[f"{kind}_{n}"] / n for n in LENGTHS] for kind in (LINEAR, FULL)}
    growth = per_token[LINEAR][-1] / per_token[LINEAR][0]
    detail = ", ".join(f"{n}: {t * 1e6:.1f}" for n, t in zip(LENGTHS, per_token[LINEAR]))
    add(
        f"Gated DeltaNet time per token: {long // 1024}K / {short // 1024}K",
        growth,
        "<= 1.3",
        growth <= 1.3,
        f"us per token {detail} ({setup})",
        r,
    )
    attention_growth = per_token[FULL][-1] / per_token[FULL][0]
    detail = ", ".join(f"{n}: {t * 1e6:.1f}" for n, t in zip(LENGTHS, per_token[FULL]))
    add(
        f"gated attention time per token: {long // 1024}K / {short // 1024}K",
        attention_growth,
        "(reported)",
        True,
        f"us per token {detail} ({setup})",
        r,
    )
    ratio = r["hybrid"] / r["all_attention"]
    add(
        f"Qwen3.5 hybrid step / all attention, {long // 1024}K",
        ratio,
        "(reported)",
        True,
        f"{r['hybrid']:.2f} vs {r['all_attention']:.2f} s (debug model, 4 blocks, 3 Gated DeltaNet; {setup})",
        r,
    )
