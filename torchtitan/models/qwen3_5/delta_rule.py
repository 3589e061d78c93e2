"""The gated delta rule of Gated DeltaNet (Yang et al. 2025; Qwen3.5's and Qwen3-Next's linear-attention
layers), in PyTorch: the CPU path and the reference for any kernel.

Per head, with a state S (dk x dv), a decay alpha_t = exp(g_t) (g_t <= 0) and a write strength beta_t in
(0, 1): S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, and the output o_t = S_t^T q_t (q
already scaled). `recurrent_gated_delta_rule` runs it token by token; `chunk_gated_delta_rule` runs a
chunk of C tokens at once, as fla's kernels and transformers' torch fallback do:

Within a chunk starting from S0, gamma_i is the cumulative log decay up to token i and Gamma_ij =
exp(gamma_i - gamma_j) (j <= i). Each token writes u_j = beta_j (v_j - S'_j^T k_j), S'_j the state it
sees after its decay; unrolled, (I + A) U = beta V - (beta e^gamma K) S0 with A_jm = beta_j Gamma_jm
k_j.k_m strictly below the diagonal, so U = u - w S0 with u = (I + A)^-1 beta V and w = (I + A)^-1 beta
e^gamma K (a unit lower-triangular solve, independent of S0). Then O = (Q e^gamma) S0 + (Q K^T . Gamma,
causal) U and the chunk's last state S_C = e^gamma_C S0 + (K e^(gamma_C - gamma))^T U: only that last
step is sequential over the chunks. Tokens past the end (the last chunk padded) have beta = 0 and g = 0:
they neither write nor decay the state.

A g of -inf (alpha = 0) resets the state: the token sees none of what came before, as at the start of a
packed document. The recurrence takes it as it is; the chunks would meet -inf - -inf in gamma_i - gamma_j,
so there each -inf counts as 0 in gamma, and every decay across it (Gamma_ij, e^gamma_i, e^(gamma_C -
gamma_j)) is set to exactly 0 from a count of the resets before each token of its chunk: no NaN, in value
or gradient, and with no reset the arithmetic is unchanged."""

import torch
import torch.nn.functional as F

from torchtitan.models.qwen3_5 import DELTA_RULE_CHUNK


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule token by token. q, k: (B, T, H, dk); v: (B, T, H, dv); g, beta: (B, T, H); the state
    (B, H, dk, dv), zeros without `initial_state`. Returns the outputs (B, T, H, dv) and the last state."""
    batch, length, heads, dk = k.shape
    state = initial_state if initial_state is not None else k.new_zeros(batch, heads, dk, v.shape[-1])
    outputs = []
    for t in range(length):
        state = state * g[:, t, :, None, None].exp()
        written = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", state, k[:, t]))
        state = state + k[:, t, :, :, None] * written[:, :, None, :]
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(outputs, dim=1), state


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = DELTA_RULE_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule `chunk_size` tokens at a time (module docstring); arguments and results as
    recurrent_gated_delta_rule's."""
    batch, length, heads, dk = k.shape
    dv = v.shape[-1]
    pad = -length % chunk_size
    chunks = (length + pad) // chunk_size

    def by_chunk(x: torch.Tensor) -> torch.Tensor:
        """(B, T, H, ...) -> (B, H, chunks, C, ...), zero-padded past the end."""
        x = x.transpose(1, 2)
        x = F.pad(x, (0, 0, 0, pad)) if x.ndim == 4 else F.pad(x, (0, pad))
        return x.reshape(batch, heads, chunks, chunk_size, *x.shape[3:])

    q, k, v, g, beta = (by_chunk(x) for x in (q, k, v, g, beta))
    resets = torch.isneginf(g)
    gamma = g.masked_fill(resets, 0).cumsum(-1)  # (B, H, chunks, C)
    # Resets in the chunk up to each token: the same count for i and j <= i means none in (j, i].
    segment = resets.cumsum(-1)
    ones = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=k.device)
    causal, strictly = ones.tril(), ones.tril(-1)
    # Gamma_ij for j <= i with no reset in (j, i] (at most 1), else 0; masked before exp (above the
    # diagonal it would overflow).
    joined = causal & (segment[..., :, None] == segment[..., None, :])
    decay = torch.where(joined, gamma[..., :, None] - gamma[..., None, :], float("-inf")).exp()
    # e^gamma_i: how much of the chunk's starting state reaches token i (0 after a reset).
    reached = torch.where(segment == 0, gamma, float("-inf")).exp()
    # e^(gamma_C - gamma_j): how much of token j's write reaches the chunk's last state.
    kept = torch.where(segment == segment[..., -1:], gamma[..., -1:] - gamma, float("-inf")).exp()
    a = (beta[..., :, None] * (k @ k.transpose(-1, -2)) * decay).masked_fill(~strictly, 0)
    lower = a + torch.eye(chunk_size, dtype=a.dtype, device=a.device)
    u = torch.linalg.solve_triangular(lower, beta[..., None] * v, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(lower, (beta * reached)[..., None] * k, upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay  # causal: decay is 0 above the diagonal
    state = initial_state if initial_state is not None else k.new_zeros(batch, heads, dk, dv)
    # Each chunk's tensors by unbind, not by indexing: the backward of x[:, :, c] fills a zero tensor of
    # the whole sequence per chunk, which made the scan quadratic in the sequence's length.
    reads = (q * reached[..., None]).unbind(2)  # what of the chunk's starting state each token reads
    carried = (k * kept[..., None]).transpose(-1, -2).unbind(2)
    last_decay = reached[..., -1:, None].unbind(2)
    outputs = []
    for u_c, w_c, read, scores_c, carried_c, decay_c in zip(
        u.unbind(2), w.unbind(2), reads, scores.unbind(2), carried, last_decay
    ):
        written = u_c - w_c @ state
        outputs.append(read @ state + scores_c @ written)
        state = decay_c * state + carried_c @ written
    out = torch.stack(outputs, dim=2).reshape(batch, heads, chunks * chunk_size, dv)
    return out[:, :, :length].transpose(1, 2), state


def piece_maps(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = DELTA_RULE_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A piece of a sequence run from a zero state, and the linear maps by which a starting state S
    (dk x dv per head) enters it: its outputs are O0 + A_out S and its last state S0_end + M S, so a
    piece computed before its starting state is known (context parallelism: each rank's pieces at once)
    is corrected after. Returns O0 (B, T, H, dv), A_out (B, T, H, dk), S0_end (B, H, dk, dv) and
    M (B, H, dk, dk).

    Why the maps come out of the chunked form: within a chunk the writes are U = u - w S and the output
    and last state are linear in S and U, so every chunk's output and last state are affine in the
    piece's starting state, and composed over the chunks they stay so. A column of the state that no
    token writes (v = 0, so u = 0) carries only the homogeneous part: run with the value widened by dk
    zero columns and the starting state [0 | I], the extra output columns are A_out and the extra state
    columns M, exactly (the same operations on those columns as S's)."""
    batch, _, heads, dk = k.shape
    dv = v.shape[-1]
    widened = torch.cat([v, v.new_zeros(*v.shape[:-1], dk)], dim=-1)
    eye = torch.eye(dk, dtype=v.dtype, device=v.device).expand(batch, heads, dk, dk)
    start = torch.cat([v.new_zeros(batch, heads, dk, dv), eye], dim=-1)
    out, last = chunk_gated_delta_rule(q, k, widened, g, beta, initial_state=start, chunk_size=chunk_size)
    return out[..., :dv], out[..., dv:], last[..., :dv], last[..., dv:]


def chain_states(ends: torch.Tensor, maps: torch.Tensor) -> torch.Tensor:
    """The starting state of each of a sequence's pieces, in order along dim 1, from their zero-state
    last states `ends` (B, P, H, dk, dv) and maps `maps` (B, P, H, dk, dk) (`piece_maps`): the first
    piece starts from zeros, piece p + 1 from M_p S_p + S0_end_p. Returns (B, P, H, dk, dv)."""
    state = torch.zeros_like(ends[:, 0])
    starts = []
    for p in range(ends.shape[1]):
        starts.append(state)
        state = maps[:, p] @ state + ends[:, p]
    return torch.stack(starts, dim=1)
