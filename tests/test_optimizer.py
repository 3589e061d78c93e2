"""Muon on one process: its update against torch.optim.Muon's, and which parameters it takes."""

import pytest
import torch
from launch import ROOT

from torchtitan.config.parser import parse_args
from torchtitan.models import build_model_args, model_spec
from torchtitan.optimizers import Muon, build_optimizer
from torchtitan.optimizers.muon import newton_schulz

SETTINGS = {"momentum": 0.9, "nesterov": True, "ns_steps": 5}


def ours(params: list[torch.Tensor], scale: str = "original", **overrides) -> Muon:
    settings = SETTINGS | {"muon_lr": 0.02, "muon_weight_decay": 0.1, "scale": scale}
    return Muon(params, [], ns_dtype=torch.bfloat16, lr=1e-3, **(settings | overrides))


def torch_muon(params: list[torch.Tensor], **overrides) -> torch.optim.Muon:
    settings = SETTINGS | {"lr": 0.02, "weight_decay": 0.1} | overrides
    return torch.optim.Muon(params, **settings)


def take_steps(optimizers: list[torch.optim.Optimizer], params: list[torch.Tensor], gradients) -> None:
    for gradient in gradients:
        for param in params:
            param.grad = gradient.clone()
        for optimizer in optimizers:
            optimizer.step()


@pytest.mark.parametrize("shape", [(48, 16), (16, 40), (24, 24)], ids=["tall", "wide", "square"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_a_matrix_takes_torch_muons_update(shape, nesterov):
    """Bit for bit, over 3 steps, with torch's scaling rule (and Moonlight's, its own arithmetic)."""
    torch.manual_seed(0)
    start = torch.randn(shape)
    a, b = start.clone(), start.clone()
    gradients = [torch.randn(shape) for _ in range(3)]
    take_steps([torch_muon([a], nesterov=nesterov), ours([b], nesterov=nesterov)], [a, b], gradients)
    assert torch.equal(a, b)

    c, d = start.clone(), start.clone()
    theirs = torch_muon([c], nesterov=nesterov, adjust_lr_fn="match_rms_adamw")
    take_steps([theirs, ours([d], "match_rms_adamw", nesterov=nesterov)], [c, d], gradients)
    assert torch.equal(c, d)


def test_each_expert_takes_torch_muons_update():
    """A 3-D expert weight [experts, out, in]: each expert as torch.optim.Muon would update it alone,
    bit for bit; the empty expert of a step (zero gradient) too."""
    torch.manual_seed(0)
    experts = torch.randn(4, 24, 16)
    ours_weight = experts.clone()
    each = [experts[e].clone() for e in range(4)]
    gradients = [torch.randn(4, 24, 16) for _ in range(3)]
    gradients[1][2] = 0
    optimizer = ours([ours_weight])
    theirs = [torch_muon([w]) for w in each]
    for gradient in gradients:
        ours_weight.grad = gradient.clone()
        optimizer.step()
        for e, (w, torch_optimizer) in enumerate(zip(each, theirs)):
            w.grad = gradient[e].clone()
            torch_optimizer.step()
    assert torch.equal(ours_weight, torch.stack(each))


def test_float32_newton_schulz_orthogonalises():
    """The float32 iterations (CPU runs) give what the bfloat16 ones give, closer: singular values
    near 1 (the quintic's band, 0.5 to 1.5)."""
    torch.manual_seed(0)
    matrix = torch.randn(32, 64)
    singular = torch.linalg.svdvals(newton_schulz(matrix, 5, torch.float32))
    assert singular.min() > 0.5 and singular.max() < 1.5
    bf16 = newton_schulz(matrix, 5).float()
    assert (newton_schulz(matrix, 5, torch.float32) - bf16).abs().max() < 0.02


def test_muon_takes_the_blocks_matrices():
    """Attention and feed-forward projections and expert weights get Muon; the embeddings, output
    layer, norms (Qwen3's per-head ones too) and the router stay with AdamW, with this section's
    AdamW options."""
    recipe = str(ROOT / "train_configs" / "qwen3_moe_debug.toml")
    muon = ["--optimizer.name", "Muon", "--optimizer.muon_lr", "0.02", "--optimizer.lr", "1e-3"]
    job = parse_args(["--job.config_file", recipe, *muon])
    with torch.device("meta"):
        model = model_spec(job.model).build(build_model_args(job, 512))
    optimizer = build_optimizer(model, job.optimizer)
    names = {param: name for name, param in model.named_parameters()}
    muon_group, adamw_group = optimizer.param_groups
    assert (muon_group["muon"], muon_group["lr"]) == (True, 0.02)
    assert (adamw_group["muon"], adamw_group["lr"]) == (False, 1e-3)
    muon_names = {names[p] for p in muon_group["params"]}
    adamw_names = {names[p] for p in adamw_group["params"]}
    assert {"layers.1.feed_forward.experts.w1", "layers.0.attention.wk.weight"} <= muon_names
    assert all(name.startswith("layers.") and "norm" not in name for name in muon_names)
    router = "layers.1.feed_forward.router.weight"
    assert {"tok_embeddings.weight", "output.weight", "norm.weight", router} <= adamw_names
    in_blocks = {n for n in adamw_names if n.startswith("layers.")}
    assert all(n.endswith("norm.weight") or ".router." in n for n in in_blocks)
    assert muon_names | adamw_names == set(names.values())


def test_a_saved_state_resumes_bit_for_bit():
    """load_state_dict of a Muon state (momentum for the matrices, AdamW's moments and step for the
    rest), as a checkpoint resumes it: the next steps are the uninterrupted ones."""
    torch.manual_seed(0)
    start = [torch.randn(24, 16), torch.randn(16)]
    gradients = [[torch.randn(24, 16), torch.randn(16)] for _ in range(4)]

    def build(params: list[torch.Tensor]) -> Muon:
        return Muon(params[:1], params[1:], ns_dtype=torch.bfloat16, lr=1e-3, muon_lr=0.02,
                    muon_weight_decay=0.1, scale="original", **SETTINGS)  # fmt: skip

    def run(optimizer: Muon, params: list[torch.Tensor], steps: list) -> None:
        for step in steps:
            for param, gradient in zip(params, step):
                param.grad = gradient.clone()
            optimizer.step()

    straight = [p.clone() for p in start]
    run(build(straight), straight, gradients)
    first = [p.clone() for p in start]
    optimizer = build(first)
    run(optimizer, first, gradients[:2])
    resumed = build(first)
    resumed.load_state_dict(optimizer.state_dict())
    run(resumed, first, gradients[2:])
    assert all(torch.equal(a, b) for a, b in zip(first, straight))
