"""What the performance figures rest on: the FLOPs counted per token, the peak table, the 1B recipe,
no host-device sync in a training step that does not log."""

import collections
import traceback
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from launch import ROOT, TINY_JOB, run_train_in_process
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from scripts.benchmarks.gpu_kernels import part_moe_grouped_mm
from scripts.benchmarks.moe import qwen3_moe_like_deepseek_v3
from torchtitan.metrics import MetricLogger, peak_flops
from torchtitan.metrics import flops_per_token as flops_per_token_fn
from torchtitan.models import MODEL_SPECS
from torchtitan.models.deepseek_v3 import deepseek_flops_per_token, deepseek_v3_configs
from torchtitan.models.deepseek_v3.model import Transformer as DeepSeekV3Transformer
from torchtitan.models.llama import ModelArgs, llama3_configs
from torchtitan.models.llama.model import Transformer
from torchtitan.models.qwen3_moe import moe_flops_per_token


def test_flops_per_token_matches_the_flops_torch_counts():
    """6N + attention equals the matmul FLOPs of a real forward + backward (GQA, SwiGLU, output
    layer; the embedding lookup and norms do none). The attention term is 11% of the total here."""
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=64)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    batch, seq = 2, 64
    tokens = torch.randint(0, args.vocab_size, (batch, seq + 1))
    # The math backend runs attention as matmuls, which the counter sees (unmasked, as the formula).
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    per_token = flops_per_token_fn(
        model.num_params(exclude_embedding=True), args.n_layers, args.n_heads, args.dim // args.n_heads, seq
    )
    assert counter.get_total_flops() / (batch * seq) == pytest.approx(per_token, rel=5e-3)


def test_deepseek_v3_flops_are_its_active_parameters_and_mla_attention():
    """DeepSeek-V3's debug flavour, counted by hand: per token, 6 FLOPs per weight it multiplies by (MLA's
    five projections, the dense SwiGLU, the router, 2 of the 8 routed experts and the shared one, the
    output layer, the norms' weights) and MLA's attention at its head sizes (48 for scores, 32 for the
    values); and that equals the FLOPs of a real forward + backward, the grouped expert matmuls counted
    as the rows they multiply (the routed experts' 6 idle of 8 are not run)."""
    args = replace(deepseek_v3_configs["debugmodel"], vocab_size=128, max_seq_len=64)
    dim, vocab, seq = 256, 128, 64
    attention = dim * 64 + 64 * 4 * 48 + dim * (32 + 16) + 32 * 4 * (32 + 32) + 4 * 32 * dim  # wq_a..wo
    dense, expert = 3 * dim * 512, 3 * dim * 128
    sparse = dim * 8 + 2 * expert + expert  # router, 2 routed experts, the shared one
    norms = 3 * (dim + dim + 64 + 32) + dim  # per block: 2 norms, q_norm, kv_norm; the final norm
    active = 3 * attention + dense + 2 * sparse + dim * vocab + norms
    by_hand = 6 * active + 6 * 3 * 4 * (48 + 32) * seq
    with torch.device("meta"):
        model = DeepSeekV3Transformer(args)
    per_token = deepseek_flops_per_token(args, model.num_params(exclude_embedding=True), seq)
    assert per_token == by_hand

    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    batch = 2
    tokens = torch.randint(0, vocab, (batch, seq + 1))
    # The grouped matmuls, by their shapes: (rows, in) x (experts, out, in) or (experts, in, out) is 2 FLOPs
    # per row, input and output feature; the weight gradient (rows, a) x (rows, b) -> (experts, a, b).
    formulas = {
        torch.ops.torchtitan.grouped_mm: lambda x, w, *_, **__: 2 * x[0] * w[1] * w[2],
        torch.ops.torchtitan.grouped_mm_weight_grad: lambda a, b, *_, **__: 2 * a[0] * a[1] * b[1],
    }
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False, custom_mapping=formulas) as counter:
        F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    # Exactly, but for the norms' weights (6 FLOPs each in the formula, none the counter sees: 0.16%).
    assert counter.get_total_flops() / (batch * seq) == per_token - 6 * norms


def test_the_benchmarks_qwen3_moe_has_deepseek_v3s_active_parameters():
    """benchmark.py's DeepSeek-V3 step-time row divides by a Qwen3-MoE of the same active parameters: the
    same matmul weights per token (MLA's five projections as GQA's four, the shared expert as a third
    routed one); only the norms' weights differ (q_norm and kv_norm against the per-head q and k norms)."""
    qwen3_moe_args = replace(qwen3_moe_like_deepseek_v3(), vocab_size=128, max_seq_len=64)
    deepseek_args = replace(deepseek_v3_configs["debugmodel"], vocab_size=128, max_seq_len=64)
    active = []
    for name, args, flops in (
        ("qwen3_moe", qwen3_moe_args, moe_flops_per_token),
        ("deepseek_v3", deepseek_args, deepseek_flops_per_token),
    ):
        with torch.device("meta"):
            model = MODEL_SPECS[name].build(args)
        active.append(flops(args, model.num_params(exclude_embedding=True), 0) / 6)
    assert active[1] - active[0] == 3 * ((64 + 32) - (32 + 32))  # per layer: q_norm + kv_norm, q + k norms


@pytest.mark.parametrize(
    "name, dtype, peak",
    [
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989e12),
        ("NVIDIA H100 80GB HBM3", torch.float32, 67e12),
        ("NVIDIA H100 PCIe", torch.bfloat16, 756e12),
        ("NVIDIA H100 NVL", torch.bfloat16, 835e12),
        ("NVIDIA H200", torch.bfloat16, 989e12),
        ("NVIDIA H200 NVL", torch.bfloat16, 835e12),
        ("NVIDIA GH200 480GB", torch.bfloat16, 989e12),
        ("NVIDIA B200", torch.bfloat16, 2250e12),
        ("NVIDIA GB200", torch.bfloat16, 2500e12),
        ("NVIDIA GB200", torch.float32, None),
        ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312e12),
        ("AMD Instinct MI300X", torch.bfloat16, 1307.4e12),
        ("NVIDIA H100", torch.bfloat16, None),  # which board? unknown rather than a guess
        ("NVIDIA GeForce RTX 4090", torch.bfloat16, None),
    ],
)
def test_peak_flops_per_device_and_dtype(monkeypatch, name, dtype, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_flops(torch.device("cuda", 0), dtype) == peak


def test_peak_flops_unknown_where_it_would_be_wrong(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert peak_flops(torch.device("cpu"), torch.bfloat16) is None
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # TF32: the FP32 peak no longer applies
    try:
        assert peak_flops(torch.device("cuda", 0), torch.float32) is None
    finally:
        torch.set_float32_matmul_precision(precision)


def test_llama3_1b_has_llama_3_2_1b_shape():
    with torch.device("meta"):
        model = Transformer(replace(llama3_configs["1B"], vocab_size=128256))
    assert model.layers["0"].feed_forward.w1.weight.shape == (8192, 2048)
    # Llama 3.2 1B has 1,235,814,400 parameters with the output layer tied to the embeddings.
    assert model.num_params() == 1_235_814_400 + 128256 * 2048


def test_vocab_size_pads_the_model_or_is_rejected(tmp_path, capsys):
    job = ["--job.config_file", str(ROOT / "train_configs" / "debug_model.toml"), "--job.dump_folder"]
    tiny = ["--training.steps", "1", "--training.seq_len", "16", "--training.batch_size", "1"]
    # The recipe validates the held-out split once (validation.steps -1) at the last step, here in
    # batches of 16 windows rather than training's 1: 10 forwards instead of some 1,400 (12-40 s).
    tiny += ["--checkpoint.enable_checkpoint", "false", "--validation.global_batch_size", "16"]
    assert run_train_in_process(*job, str(tmp_path / "small"), "--model.vocab_size", "100") == 2
    err = capsys.readouterr().err
    assert "model.vocab_size: 100 is smaller than the tokenizer's 2256 tokens" in err
    assert run_train_in_process(*job, str(tmp_path / "padded"), *tiny, "--model.vocab_size", "3000") == 0
    expected = 6 * (4 * 256**2 + 3 * 256 * 768 + 512) + 256 + 2 * 3000 * 256
    assert f"Model llama3 debugmodel: {expected:,} parameters" in capsys.readouterr().out


def test_gpu_benchmark_grouped_gemm_part_on_cpu(tmp_path):
    """scripts/benchmarks/benchmark_gpu.py's expert-layer part, on tiny shapes on the CPU: the grouped
    GEMM gives the per-expert loop's values exactly in float32, and in bf16 errs as the loop does."""
    result = part_moe_grouped_mm(tmp_path, small=True)
    assert result["grouped_fp32_error"] == {"y": 0.0, "dx": 0.0}
    for key in ("y", "dx"):
        assert 0 < result["grouped_bf16_error"][key] < 0.02
        assert result["grouped_bf16_error"][key] == pytest.approx(result["loop_bf16_error"][key], rel=0.5)


# On CUDA each of these waits for the GPU to finish the work queued before it: a scalar read back,
# a tensor copied to the host, or a tensor built from Python values on the device.
SYNCS = ("item", "tolist", "__bool__", "__int__", "__float__", "cpu", "numpy")


def test_steps_that_do_not_log_never_wait_for_the_device(tmp_path, monkeypatch):
    """A Qwen3-MoE step (routing, load balancing, clipping, the stop check) reads nothing back from the
    device unless it logs (every metrics.log_freq steps): the host runs ahead and the GPU never idles.
    On CPU every tensor is a host tensor, so the calls that would sync on CUDA are counted instead,
    except in the optimizer (AdamW keeps its step counts on the host). docs/performance.md lists the
    syncs that remain and why."""
    calls: dict[int, list[str]] = collections.defaultdict(list)
    steps_done = [0]
    step_done = MetricLogger.step_done

    def counting_step_done(self) -> None:
        steps_done[0] += 1
        step_done(self)

    def counting(name, original):
        def wrapper(*args, **kwargs):
            if name != "tensor" or kwargs.get("device") is not None:
                stack = traceback.extract_stack()[:-1]
                if "torch/optim/" not in stack[-1].filename:
                    calls[steps_done[0]].append(f"{name} at {stack[-1].filename}:{stack[-1].lineno}")
            return original(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(MetricLogger, "step_done", counting_step_done)
    for name in SYNCS:
        monkeypatch.setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
    monkeypatch.setattr(torch, "tensor", counting("tensor", torch.tensor))
    job = [*TINY_JOB, "--job.dump_folder", str(tmp_path), "--training.steps", "6", "--metrics.log_freq", "3"]
    qwen3_moe = ["--model.name", "qwen3_moe", "--model.tokenizer_path", "assets/tokenizer/kjv_bpe_hf"]
    assert run_train_in_process(*job, *qwen3_moe, "--moe.bias_update_rate", "0.01") == 0
    # Steps 1, 3 and 6 log; calls counted at k come after step k's update and before step k + 1's.
    assert calls[1] and calls[3]  # the logging steps read the loss and the gradient norm
    assert calls[2] == calls[4] == calls[5] == [], {k: calls[k] for k in (2, 4, 5)}
