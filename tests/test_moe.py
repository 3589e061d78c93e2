"""The mixture-of-experts feed-forward (torchtitan/models/moe.py; DeepSeek-V3's blocks compiled here too,
the rest in test_deepseek_v3.py), Qwen3-MoE against transformers' Qwen3MoeForCausalLM, its Hugging Face
conversion and the balancing (torchtitan/objective/load_balance.py) on one process. Layouts are
test_parity.py's, resume test_moe_resume.py's."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from one_process import load_balance, one_process_step
from safetensors.torch import load_file

from scripts import convert_dcp_to_hf, convert_hf_to_dcp
from torchtitan.checkpoint.load import read_model_weights
from torchtitan.config.options import MoEConfig
from torchtitan.models import MODEL_SPECS
from torchtitan.models.deepseek_v3 import deepseek_v3_configs
from torchtitan.models.moe import GroupedExperts, MoE, grouped_mm
from torchtitan.models.qwen3_5_moe import qwen3_5_moe_configs
from torchtitan.models.qwen3_moe import moe_flops_per_token, qwen3_moe_configs
from torchtitan.models.spec import flops_per_token

ARGS = replace(qwen3_moe_configs["debugmodel"], vocab_size=300, max_seq_len=32)


def routed_by_hand(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token through each of its chosen experts on its own, weighted: what MoE.forward computes."""
    tokens = x.reshape(-1, x.shape[-1])
    _, experts, weights = moe.route(tokens)
    ex = moe.experts
    rows = []
    for token, chosen, w in zip(tokens, experts, weights):
        out = torch.zeros_like(token)
        for e, we in zip(chosen.tolist(), w):
            out = out + we * (ex.w2[e] @ (F.silu(ex.w1[e] @ token) * (ex.w3[e] @ token)))
        rows.append(out)
    return torch.stack(rows).view_as(x)


def moe_layer(**kwargs) -> MoE:
    moe = MoE(dim=16, hidden_dim=24, num_experts=4, top_k=2, **kwargs)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.3)
        moe.expert_bias.zero_()
        moe.tokens_per_expert.zero_()
    return moe


def experts_by_loop(experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The reference: a matmul per expert on its rows."""
    outputs = []
    for rows, w1, w2, w3 in zip(torch.split(x, counts.tolist()), experts.w1, experts.w2, experts.w3):
        outputs.append((F.silu(rows @ w1.T) * (rows @ w3.T)) @ w2.T)
    return torch.cat(outputs)


ROUTINGS = {"uneven": [5, 0, 17, 2], "empty": [0, 0, 0, 0], "one expert": [0, 0, 24, 0]}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim, hidden", [(16, 24), (10, 6)], ids=["aligned", "padded"])
@pytest.mark.parametrize("routing", ROUTINGS)
def test_grouped_experts_equal_a_matmul_per_expert(dtype, dim, hidden, routing):
    """Values and every gradient, whatever the routing; dims that break torch._grouped_mm's 16-byte
    rule (10 and 6 are multiples of neither 4 nor 8) are padded."""
    torch.manual_seed(0)
    experts = GroupedExperts(dim, hidden, num_experts=4).to(dtype)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, 0.3)
    counts = torch.tensor(ROUTINGS[routing])
    x = torch.randn(int(counts.sum()), dim, dtype=dtype)
    grad = torch.randn(int(counts.sum()), dim, dtype=dtype)
    results = []
    for forward in (experts, lambda x, c: experts_by_loop(experts, x, c)):
        experts.zero_grad()
        xi = x.clone().requires_grad_()
        y = forward(xi, counts)
        (y * grad).sum().backward()
        results.append([y, xi.grad, *(p.grad for p in experts.parameters())])
    tolerance = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-2}
    for grouped, loop in zip(*results):
        torch.testing.assert_close(grouped, loop, **tolerance)


def test_grouped_mm_takes_an_expanded_gradient():
    """torch._grouped_mm's own backward refuses a gradient that is not contiguous."""
    weight = torch.randn(2, 6, 10, requires_grad=True)
    grouped_mm(torch.randn(5, 10), weight, torch.tensor([2, 5], dtype=torch.int32)).sum().backward()
    assert weight.grad.shape == weight.shape


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_experts_compute_what_each_token_asks(score_func):
    moe = moe_layer(score_func=score_func, shared_hidden_dim=8)
    x = torch.randn(2, 10, 16)
    expected = routed_by_hand(moe, x) + moe.shared_expert(x)
    torch.testing.assert_close(moe(x), expected, rtol=0, atol=1e-5)
    _, _, weights = moe.route(x.view(-1, 16))
    torch.testing.assert_close(weights.sum(-1), torch.ones(20))  # norm_topk_prob


def test_worst_case_routing_is_exact_and_the_bias_only_chooses():
    """A bias that sends every token to experts 2 and 3: the others get no rows, the weights are still
    the router's scores, and the result is each token's own computation."""
    moe = moe_layer(norm_topk_prob=False)
    x = torch.randn(2, 10, 16)
    with torch.no_grad():
        moe.expert_bias.copy_(torch.tensor([0.0, 0.0, 10.0, 10.0]))
    probs, experts, weights = moe.route(x.view(-1, 16))
    assert experts.sort(-1).values.tolist() == [[2, 3]] * 20
    torch.testing.assert_close(weights, probs.gather(-1, experts))  # no bias in the weights
    out = moe(x)
    torch.testing.assert_close(out, routed_by_hand(moe, x), rtol=0, atol=1e-5)
    assert moe.tokens_per_expert.tolist() == [0, 0, 20, 20]


def test_activation_recompute_counts_tokens_once():
    """Full activation checkpointing runs the forward again in backward: the tokens are counted once."""
    from torch.utils.checkpoint import checkpoint

    moe = moe_layer()
    moe.keep_router_stats = True
    x = torch.randn(2, 10, 16, requires_grad=True)
    checkpoint(moe, x, use_reentrant=False).sum().backward()
    assert moe.tokens_per_expert.sum().item() == 20 * 2
    assert moe.router_stats[0].sum().item() == 20 * 2


# A mixture-of-experts block of each family: Qwen3-MoE's, and DeepSeek-V3's (MLA, YaRN, groups, a shared
# expert, the routed scale).
ONE_MOE_BLOCK = {
    "qwen3_moe": replace(ARGS, n_layers=1, mlp_only_layers=()),
    "deepseek_v3": replace(
        deepseek_v3_configs["debugmodel"], n_layers=1, first_k_dense_replace=0, vocab_size=300, max_seq_len=32
    ),
}


@pytest.mark.parametrize("name", ONE_MOE_BLOCK)
def test_moe_blocks_compile_whole(name):
    """Without expert parallelism an MoE block compiles as one graph (fullgraph: attention, router,
    dispatch, grouped experts, combine, the sequence-wise balance loss's statistics), activation-
    checkpointed too, and trains as eager does; its tokens are counted once, though checkpointing
    recomputes the forward."""
    from torchtitan.parallelisms.parallelize import apply_ac, apply_compile

    args = ONE_MOE_BLOCK[name]
    models = []
    for compiled in (False, True):
        model = MODEL_SPECS[name].build(args)
        model.init_weights(seed=0)
        apply_ac(model, "full", "op")
        if compiled:
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            apply_compile(model, fullgraph=True)
        balance = load_balance(model, MoEConfig(aux_loss_weight=0.0, sequence_aux_loss_weight=0.1))
        tokens = torch.randint(0, args.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        (loss + 0.1 * balance.sequence_aux_loss()).backward()
        models.append(model)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    for eager, compiled in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(compiled.grad, eager.grad, rtol=1e-4, atol=1e-6)
    for eager_layer, compiled_layer in zip(*(m.layers.values() for m in models)):
        counts = [layer.feed_forward.tokens_per_expert for layer in (eager_layer, compiled_layer)]
        assert counts[0].sum() == 2 * 16 * args.top_k and torch.equal(*counts)


def test_flops_count_the_active_experts_only():
    model = MODEL_SPECS["qwen3_moe"].build(ARGS)
    num_params = model.num_params(exclude_embedding=True)
    idle = 3 * (8 - 2) * 3 * 256 * 256  # 3 sparse layers, 6 idle experts of 3 matrices each
    assert moe_flops_per_token(ARGS, num_params, 32) == flops_per_token(num_params - idle, 4, 4, 32, 32)


def hf_moe_model(transformers, args, tied: bool = False):
    config = transformers.Qwen3MoeConfig(
        vocab_size=args.vocab_size, hidden_size=args.dim, num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads, head_dim=args.head_dim,
        intermediate_size=args.hidden_dim, moe_intermediate_size=args.moe_hidden_dim,
        num_experts=args.num_experts, num_experts_per_tok=args.top_k, norm_topk_prob=args.norm_topk_prob,
        decoder_sparse_step=args.decoder_sparse_step, mlp_only_layers=list(args.mlp_only_layers),
        rms_norm_eps=args.norm_eps, rope_theta=args.rope_theta, tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(0)
    hf_model = transformers.Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for p in hf_model.parameters():  # the norms and the router too
            p.normal_(0.0, 0.1 if p.ndim > 1 else 1.0)
    return hf_model


def test_from_hf_matches_transformers_and_round_trips_bit_exact(tmp_path):
    """A random transformers Qwen3MoeForCausalLM saved in the Hub's per-expert layout -> DCP -> ours: the
    same logits and auxiliary loss; -> HF again: the same files."""
    transformers = pytest.importorskip("transformers")
    hf_model = hf_moe_model(transformers, ARGS)
    hf_model.save_pretrained(tmp_path / "hf")
    hf_weights = load_file(tmp_path / "hf" / "model.safetensors")
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in hf_weights
    assert "model.layers.0.mlp.gate_proj.weight" in hf_weights  # the dense layer (mlp_only_layers)

    convert_hf_to_dcp.convert(str(tmp_path / "hf"), str(tmp_path / "dcp"))
    weights = read_model_weights(str(tmp_path / "dcp"))
    model = MODEL_SPECS["qwen3_moe"].build(ARGS)
    assert weights.keys() == model.state_dict().keys()
    model.load_state_dict(weights)
    tokens = torch.randint(0, ARGS.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = hf_model(tokens, output_router_logits=True)
    balance = load_balance(model, MoEConfig())  # keeps the router statistics
    logits = model(tokens)  # a training forward
    aux_loss = balance.aux_loss()
    assert (logits - theirs.logits).abs().max() < 1e-5
    assert abs(aux_loss.item() - theirs.aux_loss.item()) < 1e-6

    convert_dcp_to_hf.convert(str(tmp_path / "dcp"), str(tmp_path / "back"), ARGS, name="qwen3_moe")
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert back.keys() == hf_weights.keys()
    for name, w in hf_weights.items():
        assert torch.equal(back[name], w), name
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, theirs.logits)


def test_to_hf_refuses_a_routing_bias_unless_dropped(tmp_path, capsys):
    """The balancing bias has no place in HF's model: exporting a non-zero one is one line and exit 2
    (nothing written), and --drop-expert-bias exports the rest."""
    import torch.distributed.checkpoint as dcp

    model = MODEL_SPECS["qwen3_moe"].build(ARGS)
    model.init_weights(seed=0)
    with torch.no_grad():
        model.layers["2"].feed_forward.expert_bias[3] = 0.01
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "step-1"))
    tokenizer = str(Path(__file__).resolve().parents[1] / "assets" / "tokenizer" / "kjv_bpe_hf")
    argv = [str(tmp_path / "step-1"), str(tmp_path / "hf"), "--name", "qwen3_moe", "--tokenizer", tokenizer]
    assert convert_dcp_to_hf.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --drop-expert-bias: ") and "\n" not in err, err
    assert not (tmp_path / "hf").exists()
    assert convert_dcp_to_hf.main([*argv, "--drop-expert-bias"]) == 0
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert not any("bias" in name for name in exported)


def test_bias_balancing_moves_against_the_load():
    """After a step, an overloaded expert's bias goes down by the rate and an idle one's up; the counts
    start again from zero."""
    model = MODEL_SPECS["qwen3_moe"].build(ARGS)
    model.init_weights(seed=0)
    balance = load_balance(model, MoEConfig(aux_loss_weight=0.0, bias_update_rate=0.01))
    layer = model.layers["1"].feed_forward
    model(torch.randint(0, ARGS.vocab_size, (2, 16)))
    with torch.no_grad():  # a forward without gradients (a pipeline's shape inference) does not count
        model(torch.randint(0, ARGS.vocab_size, (2, 16)))
    load = layer.tokens_per_expert.clone()
    metrics = balance.step_done()
    expected = 0.01 * torch.sign(load.mean() - load)
    assert torch.equal(layer.expert_bias, expected)
    assert load.sum() == 2 * 16 * 2 and layer.tokens_per_expert.sum() == 0
    assert "aux_loss" not in metrics and metrics["expert_load"] >= 1.0


# Two sparse layers of each family's routing: Qwen3-MoE's softmax probabilities (Qwen3.5-MoE's, beside
# its gated shared expert and Gated DeltaNet), DeepSeek-V3's sigmoid scores (normalised over the experts
# for the loss) in groups.
TWO_MOE_LAYERS = {
    "qwen3_moe": replace(ARGS, n_layers=2, mlp_only_layers=()),
    "qwen3_5_moe": replace(qwen3_5_moe_configs["debugmodel"], n_layers=2, vocab_size=300, max_seq_len=32),
    "deepseek_v3": replace(ONE_MOE_BLOCK["deepseek_v3"], n_layers=2),
}


def sequence_loss_by_hand(layer_inputs: list[tuple[MoE, torch.Tensor]]) -> torch.Tensor:
    """DeepSeek-V3's eqs. 17-20 written out from each layer's router outputs, per sequence b (a row)
    of T tokens: s'_{t,e} the token's scores normalised over all experts (softmax: its probabilities),
    f_e = E / (K T) * #{t : e among t's top-k} (no gradient), P_e = mean_t s'_{t,e}, and the loss
    sum_e f_e P_e; its mean over the sequences, summed over the layers."""
    total = torch.zeros(())
    for moe, x in layer_inputs:
        E, K = moe.num_experts, moe.top_k
        B, T, _ = x.shape
        logits = x.float() @ moe.router.weight.float().T
        if moe.score_func == "softmax":
            s_norm = logits.softmax(-1)
        else:
            s = logits.sigmoid()
            s_norm = s / s.sum(-1, keepdim=True)  # eq. 20: s'_{i,t} = s_{i,t} / sum_j s_{j,t}
        _, chosen, _ = moe.route(x.reshape(-1, x.shape[-1]))
        chosen = chosen.view(B, T, K)
        for b in range(B):
            loss_b = torch.zeros(())
            for e in range(E):
                f = E / (K * T) * sum(int(e in chosen[b, t].tolist()) for t in range(T))  # eq. 18
                P = s_norm[b, :, e].sum() / T  # eq. 19
                loss_b = loss_b + f * P  # eq. 17, without alpha
            total = total + loss_b / B
    return total


@pytest.mark.parametrize("name", TWO_MOE_LAYERS)
def test_sequence_balance_loss_is_deepseek_v3s_equations(name):
    """On a fixed batch of 3 sequences, the sequence-wise balance loss (moe.sequence_aux_loss_weight),
    its router gradients and its logged metric (the mean over the layers) equal eqs. 17-20 computed
    by hand from the routers' outputs; the batch-wise loss of the same routing differs."""
    args = TWO_MOE_LAYERS[name]
    model = MODEL_SPECS[name].build(args)
    model.init_weights(seed=0)
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    assert len(layers) == 2
    inputs = []
    for layer in layers:
        layer.register_forward_pre_hook(lambda module, args: inputs.append((module, args[0])))
    config = MoEConfig(aux_loss_weight=0.0, sequence_aux_loss_weight=1e-4)
    balance = load_balance(model, config)
    tokens = torch.randint(0, args.vocab_size, (3, 12), generator=torch.Generator().manual_seed(4))
    model(tokens)
    loss = balance.sequence_aux_loss()
    routers = [layer.router.weight for layer in layers]
    grads = torch.autograd.grad(loss, routers, retain_graph=True)
    expected = sequence_loss_by_hand(inputs)
    expected_grads = torch.autograd.grad(expected, routers)
    assert expected.item() > 1.0 and abs(loss.item() - expected.item()) < 1e-6, (loss, expected)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert all(layer.sequence_stats is None for layer in layers)  # taken by the loss
    metrics = balance.step_done()
    assert abs(metrics["seq_aux_loss"].item() - expected.item() / 2) < 1e-6
    assert "aux_loss" not in metrics
    # The whole batch pooled as one sequence (a batch-wise loss) is not the mean of the sequences'.
    pooled = sequence_loss_by_hand([(m, x.reshape(1, -1, x.shape[-1])) for m, x in inputs])
    assert abs(pooled.item() - expected.item()) > 1e-3


def test_train_step_adds_the_weighted_sequence_loss_to_each_microbatch():
    """Gradient accumulation over 2 micro-batches: TrainStep's gradients are those of the mean over the
    micro-batches of (language-model loss + alpha x sequence-wise loss), written out here."""
    from torchtitan.config.parser import parse_args
    from torchtitan.datasets.layout import Batch

    args, alpha = TWO_MOE_LAYERS["deepseek_v3"], 0.5
    config = MoEConfig(aux_loss_weight=0.0, sequence_aux_loss_weight=alpha)
    tokens = torch.randint(0, args.vocab_size, (4, 13), generator=torch.Generator().manual_seed(5))
    batches = [Batch.of_windows(tokens[i : i + 2]) for i in (0, 2)]
    grads = []
    for by_hand in (False, True):
        model = MODEL_SPECS["deepseek_v3"].build(args)
        model.init_weights(seed=0)
        if by_hand:
            balance = load_balance(model, config)
            for batch in batches:
                loss = F.cross_entropy(model(batch.inputs).flatten(0, 1), batch.labels.flatten())
                objective = loss + alpha * balance.sequence_aux_loss()
                (objective / 2).backward()
        else:
            weights = ("--moe.aux_loss_weight", "0", "--moe.sequence_aux_loss_weight", str(alpha))
            job = parse_args(["--training.mixed_precision_param", "float32", *weights])
            step = one_process_step(model, job)
            balance = step.objective.balance
            step.forward_backward(iter(batches), microbatches=2)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        metric = balance.step_done()["seq_aux_loss"]
    assert grads[0].keys() == grads[1].keys()
    for name, grad in grads[0].items():
        torch.testing.assert_close(grad, grads[1][name], rtol=0, atol=1e-6, msg=name)
    assert metric > 1.0
