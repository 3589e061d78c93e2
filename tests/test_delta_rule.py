"""The chunked gated delta rule (torchtitan/models/qwen3_5/delta_rule.py) equals its token-by-token
recurrence within 1e-12 in float64: T not a multiple of the chunk, a starting state, the final state too;
and a sequence split at any point, the first part's final state carried into the second, equals the
whole. (Key heads repeated to the value heads are the layer's: the rule takes one k per v head.)"""

import pytest
import torch
import torch.nn.functional as F

from torchtitan.models.qwen3_5.delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule

B, H, DK, DV = 2, 3, 8, 16


def inputs(length: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Gated DeltaNet's inputs as its layer makes them, in float64: q and k L2-normed (q scaled by
    dk^-0.5), g = -exp(A) softplus(a + dt) <= 0, beta = sigmoid(b)."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    q = F.normalize(randn(B, length, H, DK), dim=-1) * DK**-0.5
    k = F.normalize(randn(B, length, H, DK), dim=-1)
    v = randn(B, length, H, DV)
    g = -randn(H).exp() * F.softplus(randn(B, length, H) + 1.0)
    beta = torch.sigmoid(randn(B, length, H))
    return q, k, v, g, beta


@pytest.mark.parametrize("length, chunk", [(150, 64), (64, 64), (37, 16), (5, 64)])
def test_chunks_equal_the_recurrence(length, chunk):
    state = torch.randn(B, H, DK, DV, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for initial in (None, state):
        expected, expected_state = recurrent_gated_delta_rule(*inputs(length), initial_state=initial)
        got, got_state = chunk_gated_delta_rule(*inputs(length), initial_state=initial, chunk_size=chunk)
        assert (got - expected).abs().max() < 1e-12
        assert (got_state - expected_state).abs().max() < 1e-12


@pytest.mark.parametrize("split", [1, 63, 64, 100, 149])
def test_a_split_sequence_carried_on_equals_the_whole(split):
    whole, whole_state = chunk_gated_delta_rule(*inputs(150))
    first = [x[:, :split] for x in inputs(150)]
    second = [x[:, split:] for x in inputs(150)]
    out_first, carried = chunk_gated_delta_rule(*first)
    out_second, last = chunk_gated_delta_rule(*second, initial_state=carried)
    assert (torch.cat([out_first, out_second], dim=1) - whole).abs().max() < 1e-12
    assert (last - whole_state).abs().max() < 1e-12


def test_gradients_equal_the_recurrences():
    """Backward through the triangular solves and the scan: the same gradients as token by token."""
    grads = []
    for rule in (recurrent_gated_delta_rule, chunk_gated_delta_rule):
        leaves = [x.clone().requires_grad_() for x in inputs(70)]
        out, state = rule(*leaves)
        (out.square().sum() + state.square().sum()).backward()
        grads.append([x.grad for x in leaves])
    for got, expected in zip(*grads):
        assert (got - expected).abs().max() < 1e-10


def test_equals_transformers_torch_path():
    """transformers' own PyTorch delta rule (Qwen3-Next's, computed in float32; fla not installed), with
    Hv = 2 Hk, its key heads repeated: ours on the same float32 inputs within 1e-5."""
    transformers_rule = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    q, k, v, g, beta = (x.float() for x in inputs(150))
    q, k = q[:, :, :1], k[:, :, :1]  # one key head for the three value heads
    theirs, their_state = transformers_rule.torch_chunk_gated_delta_rule(
        q * DK**0.5,
        k,
        v,
        g,
        beta,
        output_final_state=True,  # it scales q by dk^-0.5 itself
    )
    ours, our_state = chunk_gated_delta_rule(q.expand(-1, -1, H, -1), k.expand(-1, -1, H, -1), v, g, beta)
    assert (ours - theirs).abs().max() < 1e-5
    assert (our_state - their_state).abs().max() < 1e-5
