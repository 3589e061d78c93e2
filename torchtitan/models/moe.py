"""The mixture-of-experts feed-forward any family can use in place of its SwiGLU MLP.

A router scores each token against every expert (in float32, whatever the parameter dtype), the
top-k experts (chosen on the scores plus a balancing bias) each run a SwiGLU on it, and the token's
output is their outputs weighted by its scores for them, plus an optional always-on shared expert
(optionally scaled per token by a sigmoid gate: Qwen2-MoE's, Qwen3-Next's and Qwen3.5's).

Three ways to keep the experts evenly loaded, each optional (torchtitan/objective/load_balance.py runs them):
- the auxiliary loss of the Switch Transformer as transformers' Qwen3-MoE computes it: each forward
  keeps, per layer, how many tokens went to each expert and the sum of their router probabilities;
- DeepSeek-V3's auxiliary-loss-free bias (`expert_bias`, a buffer saved in checkpoints): added to the
  scores for choosing the experts only, and moved after each optimizer step against the load counted
  in `tokens_per_expert`;
- DeepSeek-V3's sequence-wise balance loss (`sequence_balance` in torchtitan/objective/load_balance.py),
  which complements the bias: each forward keeps the same two statistics per layer and per sequence
  (a row of the batch).
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan.models.decoder import FeedForward
from torchtitan.models.init import trunc_normal_


def _training_forward() -> bool:
    """Whether this forward is one whose tokens count: not activation checkpointing's recompute (run
    inside backward), nor a forward without gradients (a pipeline stage's shape inference). A compiled
    recompute runs inside the backward graph, never this code."""
    if torch.compiler.is_compiling():
        return torch.is_grad_enabled()
    return torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1


# torch._grouped_mm as custom ops of ours: torch's own fake kernel for it accepts only bf16 (torch 2.13),
# so torch.compile could not trace a float32 model's experts; these trace in any dtype. The weights'
# transposes happen inside the ops, where the compiler does not see them: the parameters (experts, out,
# in) and their gradients keep one layout, with no transposing copy.
@torch.library.custom_op("torchtitan::grouped_mm", mutates_args=())
def _grouped_mm(
    x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, transpose: bool
) -> torch.Tensor:
    """x (rows, a) times each expert's weight, (experts, b, a) transposed or (experts, a, b) as it is ->
    (rows, b): the rows of expert e end at offsets[e]."""
    return torch._grouped_mm(x, weight.transpose(-2, -1) if transpose else weight, offs=offsets)


@_grouped_mm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, transpose: bool) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[1] if transpose else weight.shape[2])


@torch.library.custom_op("torchtitan::grouped_mm_weight_grad", mutates_args=())
def _grouped_mm_weight_grad(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """(rows, p), (rows, q) -> (experts, p, q): each expert's a_e^T @ b_e."""
    return torch._grouped_mm(a.t(), b, offs=offsets)


@_grouped_mm_weight_grad.register_fake
def _(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return a.new_empty(offsets.shape[0], a.shape[1], b.shape[1])


def _grouped_mm_setup(ctx, inputs: tuple, output: torch.Tensor) -> None:
    x, weight, offsets, ctx.transpose = inputs
    ctx.save_for_backward(x, weight, offsets)


def _grouped_mm_backward(ctx, grad: torch.Tensor) -> tuple:
    x, weight, offsets = ctx.saved_tensors
    grad = grad.contiguous()  # torch._grouped_mm refuses an expanded or strided gradient
    grad_x = _grouped_mm(grad, weight, offsets, not ctx.transpose) if ctx.needs_input_grad[0] else None
    grad_w = None
    if ctx.needs_input_grad[1]:  # y = x W^T: dW = grad^T x; y = x W: dW = x^T grad
        grad_w = (
            _grouped_mm_weight_grad(grad, x, offsets)
            if ctx.transpose
            else _grouped_mm_weight_grad(x, grad, offsets)
        )
    return grad_x, grad_w, None, None


_grouped_mm.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Each expert's rows times its weight: x (rows, in), sorted by expert, the rows of expert e ending
    at offsets[e] (int32, on x's device); weight (experts, out, in) -> (rows, out). One kernel for all
    the experts, with no host sync. torch._grouped_mm needs every stride to be a multiple of 16 bytes:
    `in` and `out` are padded with zeros where they are not (the sums are unchanged)."""
    d_in, d_out = weight.shape[2], weight.shape[1]
    align = 16 // x.element_size()
    pad_in, pad_out = -d_in % align, -d_out % align
    if pad_in or pad_out:
        x = F.pad(x, (0, pad_in))
        weight = F.pad(weight, (0, pad_in, 0, pad_out))
    out = _grouped_mm(x, weight, offsets, True)
    return out[:, :d_out] if pad_out else out


class GroupedExperts(nn.Module):
    """`num_experts` SwiGLU MLPs held as 3-D weights [experts, out, in] (each expert's slice is the
    Hugging Face expert's Linear weight), run on the tokens routed to each."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def init_weights(self, init_std: float) -> None:
        trunc_normal_(self.w1, std=0.02)
        trunc_normal_(self.w2, std=init_std)
        trunc_normal_(self.w3, std=init_std)

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x: (tokens, dim), sorted by expert, `tokens_per_expert[e]` rows for expert e (of the experts
        held here; a tensor on x's device). A grouped GEMM per projection, in the parameters' dtype, or
        autocast's (which does not cover torch._grouped_mm): as a matmul per expert would compute.
        Under expert parallelism the weights are this rank's shard of a DTensor (its experts)."""
        weights = [(w.to_local() if isinstance(w, DTensor) else w) for w in (self.w1, self.w2, self.w3)]
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            x, weights = x.to(dtype), [w.to(dtype) for w in weights]
        w1, w2, w3 = weights
        offsets = torch.cumsum(tokens_per_expert, 0, dtype=torch.int32)
        h = F.silu(grouped_mm(x, w1, offsets)) * grouped_mm(x, w3, offsets)
        return grouped_mm(h, w2, offsets)


class MoE(nn.Module):
    """Top-k routed SwiGLU experts (and an optional shared expert); input and output (bs, seqlen, dim).

    `score_func`: "softmax" (Qwen3-MoE, Mixtral) or "sigmoid" (DeepSeek-V3) router scores;
    `norm_topk_prob`: a token's top-k weights are rescaled to sum to 1; `route_scale`: then multiplied by
    it (DeepSeek-V3's routed_scaling_factor). `n_group` > 1: DeepSeek-V3's group-limited routing, the
    experts in `n_group` equal groups of which a token chooses in the `topk_group` best only, a group
    scored by the sum of its two best (biased) scores: at most `topk_group` nodes' experts per token
    when each node holds whole groups. `shared_gate`: the shared expert's output times
    sigmoid(`shared_expert_gate`(x)), a per-token scalar (Qwen3.5-MoE's, Qwen3-Next's)."""

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        top_k: int,
        score_func: str = "softmax",
        norm_topk_prob: bool = True,
        shared_hidden_dim: int = 0,
        n_group: int = 1,
        topk_group: int = 1,
        route_scale: float = 1.0,
        shared_gate: bool = False,
    ):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.score_func, self.norm_topk_prob = score_func, norm_topk_prob
        self.n_group, self.topk_group, self.route_scale = n_group, topk_group, route_scale
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = GroupedExperts(dim, hidden_dim, num_experts)
        self.shared_expert = FeedForward(dim, shared_hidden_dim) if shared_hidden_dim else None
        self.shared_expert_gate = nn.Linear(dim, 1, bias=False) if shared_gate else None
        # DeepSeek-V3's balancing bias, and the tokens each expert took since the last update.
        self.register_buffer("expert_bias", torch.zeros(num_experts), persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts), persistent=False)
        # With `keep_router_stats`, the last training forward's (assignments per expert, sum of router
        # probabilities per expert): the auxiliary loss's statistics, the second carrying the
        # router's gradient (and holding its graph until the loss takes it).
        self.keep_router_stats = False
        self.router_stats: tuple[torch.Tensor, torch.Tensor] | None = None
        # With `keep_sequence_stats`, the same per sequence (row): (bs, experts) each, the sequence-wise
        # balance loss's statistics (`sequence_balance`).
        self.keep_sequence_stats = False
        self.sequence_stats: tuple[torch.Tensor, torch.Tensor] | None = None

    def init_weights(self, init_std: float) -> None:
        trunc_normal_(self.router.weight, std=0.02)
        self.experts.init_weights(init_std)
        if self.shared_expert is not None:
            self.shared_expert.init_weights(init_std)
        if self.shared_expert_gate is not None:
            trunc_normal_(self.shared_expert_gate.weight, std=0.02)
        with torch.no_grad():
            self.expert_bias.zero_()
            self.tokens_per_expert.zero_()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (tokens, dim) -> (router probabilities (tokens, experts), chosen experts (tokens, k),
        their weights (tokens, k)), in float32."""
        logits = F.linear(x.float(), self.router.weight.float())
        scores = logits.softmax(-1) if self.score_func == "softmax" else logits.sigmoid()
        choice = scores.detach() + self.expert_bias  # the bias chooses; the weights are the scores
        if self.n_group > 1:
            choice = self.limit_to_groups(choice)
        _, experts = torch.topk(choice, self.top_k, dim=-1)
        weights = scores.gather(-1, experts)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        if self.route_scale != 1.0:
            weights = weights * self.route_scale
        probs = scores if self.score_func == "softmax" else scores / scores.sum(-1, keepdim=True)
        return probs, experts, weights

    def limit_to_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """(tokens, experts) choice scores with the experts outside each token's `topk_group` best groups
        set to -inf (a group's score: the sum of its two best)."""
        groups = choice.view(choice.shape[0], self.n_group, -1)
        group_scores = groups.topk(2, dim=-1).values.sum(-1)
        best = group_scores.topk(self.topk_group, dim=-1).indices
        kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return groups.masked_fill(~kept.unsqueeze(-1), float("-inf")).view_as(choice)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seqlen, dim = x.shape
        tokens = x.reshape(-1, dim)
        probs, experts, weights = self.route(tokens)
        if self.keep_sequence_stats and self.training and _training_forward():
            self.sequence_stats = self.sequence_statistics(probs, experts, bs)
        out = self.run_experts(tokens, probs, experts)
        # Each token's weighted sum over its k choices: a fixed order of additions, the same on every
        # device (no scatter-add).
        out = (out.view(-1, self.top_k, dim) * weights.to(out.dtype).unsqueeze(-1)).sum(1)
        if self.shared_expert is not None:
            shared = self.shared_expert(tokens)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(tokens)) * shared
            out = out + shared
        return out.view(bs, seqlen, dim)

    def sequence_statistics(
        self, probs: torch.Tensor, experts: torch.Tensor, bs: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per sequence (row of the batch): its tokens' (token, choice) counts per expert (float32, no
        gradient) and the sums of their router probabilities per expert (with the router's gradient),
        each (bs, experts)."""
        choices = experts.view(bs, -1)
        counts = torch.zeros(bs, self.num_experts, device=probs.device)
        counts.scatter_add_(1, choices, torch.ones_like(choices, dtype=counts.dtype))
        return counts, probs.view(bs, -1, self.num_experts).sum(1)

    def run_experts(self, tokens: torch.Tensor, probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Each (token, choice) pair's expert output, (tokens x k, dim) in (token, choice) order; counts
        the tokens in training. No host sync here (expert parallelism adds one for its all-to-all)."""
        # The pairs grouped by expert; a stable sort keeps tokens in order within one.
        order = torch.argsort(experts.flatten(), stable=True)
        bounds = torch.arange(self.num_experts + 1, device=experts.device)
        counts = torch.diff(torch.searchsorted(experts.flatten()[order], bounds))
        if self.training and _training_forward():
            if self.keep_router_stats:
                self.router_stats = (counts.detach().float(), probs.sum(0))
            with torch.no_grad():
                self.tokens_per_expert += counts
        routed = tokens.repeat_interleave(self.top_k, dim=0)[order]
        return self.experts(routed, counts)[torch.argsort(order)]
