"""The chunked gated delta rule (torchtitan/models/qwen3_5/delta_rule.py) equals its token-by-token
recurrence within 1e-12 in float64: T not a multiple of the chunk, a starting state, the final state too;
and a sequence split at any point, the first part's final state carried into the second, equals the
whole. (Key heads repeated to the value heads are the layer's: the rule takes one k per v head.)"""

import pytest
import torch
import torch.nn.functional as F

from torchtitan.models.qwen3_5.delta_rule import (
    chain_states,
    chunk_gated_delta_rule,
    piece_maps,
    recurrent_gated_delta_rule,
)

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


# Document starts of a packed row of 150 tokens: at a chunk's first token (64), mid-chunk (10, 100),
# at a chunk's last token (127), two in one chunk (10, 40), and the row's first token (0).
STARTS = [0, 10, 40, 64, 100, 127]


def packed_inputs(length: int = 150) -> tuple[torch.Tensor, ...]:
    """`inputs`, with g = -inf at each document's first token (the state reset)."""
    q, k, v, g, beta = inputs(length)
    g = g.clone()
    g[:, STARTS] = float("-inf")
    return q, k, v, g, beta


@pytest.mark.parametrize("rule", [recurrent_gated_delta_rule, chunk_gated_delta_rule])
def test_a_reset_starts_each_document_from_a_zero_state(rule):
    """g = -inf at a document's first token: the packed row equals each document run alone (from a zero
    state, whatever the starting state given), within 1e-12 in float64; the last state is the last
    document's."""
    state = torch.randn(B, H, DK, DV, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out, last = rule(*packed_inputs(), initial_state=state)
    bounds = [*STARTS, 150]
    for start, end in zip(bounds[:-1], bounds[1:]):
        alone, alone_state = rule(*(x[:, start:end] for x in inputs(150)))
        assert (out[:, start:end] - alone).abs().max() < 1e-12, (start, end)
    assert (last - alone_state).abs().max() < 1e-12


def test_resets_have_the_recurrences_gradients_and_no_nan():
    """Backward through the resets: finite everywhere, the recurrence's gradients within 1e-10, and none
    reaching g at a reset (nothing depends on it)."""
    grads = []
    for rule in (recurrent_gated_delta_rule, chunk_gated_delta_rule):
        q, k, v, raw_g, beta = (x.clone().requires_grad_() for x in inputs(150))
        starts = torch.zeros(150, dtype=torch.bool)
        starts[STARTS] = True
        g = raw_g.masked_fill(starts[None, :, None], float("-inf"))
        out, state = rule(q, k, v, g, beta)
        assert torch.isfinite(out).all() and torch.isfinite(state).all()
        (out.square().sum() + state.square().sum()).backward()
        grads.append([x.grad for x in (q, k, v, raw_g, beta)])
        assert all(torch.isfinite(x).all() for x in grads[-1])
        assert (raw_g.grad[:, STARTS] == 0).all()
    for got, expected in zip(*grads):
        assert (got - expected).abs().max() < 1e-10


# Pieces of a 150-token row (no length a multiple of 64), with resets inside pieces and a piece (at 100)
# starting at a document's first token.
PIECE_BOUNDS = [[0, 150], [0, 75, 150], [0, 37, 100, 101, 150], [0, 64, 129, 150]]


def chained(q, k, v, g, beta, bounds):  # noqa: ANN001, ANN201
    """Each piece from a zero state (piece_maps), chained (chain_states) and corrected: the whole row's
    outputs and last state."""
    pieces = [
        piece_maps(*(x[:, a:e] for x in (q, k, v, g, beta)), chunk_size=16)
        for a, e in zip(bounds, bounds[1:])
    ]
    starts = chain_states(
        torch.stack([p[2] for p in pieces], dim=1), torch.stack([p[3] for p in pieces], dim=1)
    )
    outs = [
        o0 + torch.einsum("bthk,bhkv->bthv", a_out, starts[:, i])
        for i, (o0, a_out, _, _) in enumerate(pieces)
    ]
    last = pieces[-1][3] @ starts[:, -1] + pieces[-1][2]
    return torch.cat(outs, dim=1), last


@pytest.mark.parametrize("bounds", PIECE_BOUNDS)
def test_pieces_from_zero_states_chained_equal_the_whole(bounds):
    """Context parallelism's form: any split into pieces, each from a zero state and corrected by the
    chained states, equals the whole row (Hv > Hk: one key head repeated to the three value heads; resets
    at 10, 40, 64, 100, 127) within 1e-12, outputs and last state; the gradients through the maps equal
    the whole's within 1e-10."""
    q, k, v, raw_g, beta = inputs(150)
    q, k = q[:, :, :1].expand(-1, -1, H, -1), k[:, :, :1].expand(-1, -1, H, -1)
    results = []
    for run in (chunk_gated_delta_rule, lambda *x: chained(*x, bounds)):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, raw_g, beta)]
        starts = torch.zeros(150, dtype=torch.bool)
        starts[STARTS[1:]] = True
        g = leaves[3].masked_fill(starts[None, :, None], float("-inf"))
        out, state = run(leaves[0], leaves[1], leaves[2], g, leaves[4])
        (out.square().sum() + state.square().sum()).backward()
        results.append((out, state, [x.grad for x in leaves]))
    (out, state, grads), (whole, whole_state, whole_grads) = results[1], results[0]
    assert (out - whole).abs().max() < 1e-12
    assert (state - whole_state).abs().max() < 1e-12
    for got, expected in zip(grads, whole_grads):
        assert (got - expected).abs().max() < 1e-10
