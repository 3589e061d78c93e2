"""DeepSeek-V3 on the Llama transformer: multi-head latent attention (MLA) with YaRN RoPE, and
DeepSeekMoE (the shared mixture of experts, torchtitan/models/moe.py) after the first dense layers. The
embeddings, blocks, final norm, output, seeded init, packed documents and pipeline-stage shape are the
shared decoder's (torchtitan/models/decoder.py)."""

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial

from torchtitan.models import decoder
from torchtitan.models.deepseek_v3 import DeepSeekV3ModelArgs
from torchtitan.models.documents import Documents
from torchtitan.models.init import ones_, trunc_normal_
from torchtitan.models.llama import model as llama
from torchtitan.models.moe import MoE
from torchtitan.models.mtp import MTPTransformer


def _correction_dim(rotations: float, dim: int, theta: float, original_seq_len: int) -> float:
    """The feature index (of `dim` rotated ones) whose frequency turns `rotations` times over the
    original context."""
    return dim * math.log(original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))


def rope_frequencies(args: DeepSeekV3ModelArgs, device: torch.device | None = None) -> torch.Tensor:
    """The rope slice's frequencies: plain RoPE's, or YaRN's when `rope_factor` > 1 (transformers'
    `_compute_yarn_parameters` with truncate, term for term so the angles round alike): the high
    frequencies kept, the low ones divided by the factor, a linear ramp between the features that turn
    `beta_fast` and `beta_slow` times over the original context."""
    dim = args.qk_rope_head_dim
    powers = args.rope_theta ** (torch.arange(0, dim, 2, device=device).float() / dim)
    if args.rope_factor <= 1:
        return 1.0 / powers
    fast, slow = (
        _correction_dim(b, dim, args.rope_theta, args.original_seq_len)
        for b in (args.beta_fast, args.beta_slow)
    )
    low, high = max(math.floor(fast), 0), min(math.ceil(slow), dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, device=device).float() - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # the share of each feature's original frequency
    return 1.0 / (args.rope_factor * powers) * (1 - keep) + 1.0 / powers * keep


def precompute_freqs_cis(args: DeepSeekV3ModelArgs, device: torch.device | None = None) -> torch.Tensor:
    """Complex64 rotations (max_seq_len, qk_rope_head_dim // 2) of the rope slice."""
    t = torch.arange(args.max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(t, rope_frequencies(args, device))
    return torch.polar(torch.ones_like(angles), angles)


class SharedKey(nn.Module):
    """The RoPE key all heads share, (bs, seqlen, qk_rope_head_dim), as it is. A module so that tensor
    parallelism can gather it over the sequence (the TP plan): each rank then uses it for its own heads
    only, so its gradient there is a partial sum, summed over the ranks on the way back."""

    def forward(self, k_pe: torch.Tensor) -> torch.Tensor:
        if isinstance(k_pe, DTensor):
            return k_pe.to_local(grad_placements=[Partial()])
        return k_pe


class LatentKeys(nn.Module):
    """The normed latents (bs, tokens, kv_lora_rank) and rotated shared RoPE key (bs, tokens, 1,
    qk_rope_head_dim) of the tokens this rank's queries attend to, which wkv_b expands into every head's
    keys and values: the rank's own, as they are. A module so that context parallelism can put in its
    place one that gathers them from every cp rank (parallelisms/context_parallel.py's LatentGather):
    the latents travel, kv_lora_rank + qk_rope_head_dim features per token, rather than every head's
    key and value."""

    def forward(
        self, latent: torch.Tensor, k_pe: torch.Tensor, documents: Documents | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return latent, k_pe


class Attention(nn.Module):
    """Multi-head latent attention, causal (or within documents), as transformers' DeepseekV3Attention.

    Queries: wq (q_lora_rank 0) or wq_b(q_norm(wq_a(x))). Keys and values: wkv_a(x) gives a latent of
    kv_lora_rank features, normed by kv_norm and expanded per head by wkv_b into each head's key
    (without position) and value, and a RoPE key that all heads share. RoPE rotates the rope slice of
    each query and the shared key only, as interleaved pairs (a complex rotation, Llama's): transformers'
    rope_interleave=True writes its result de-interleaved, in q and k alike, so the scores are equal and
    HF's weights need no permutation. The softmax scale is head_dim^-0.5 x mscale^2 (YaRN), applied by
    scaling the queries so that the shared attention (SDPA, documents, context parallelism) runs as is.

    Head counts are read from the projected tensors: under tensor parallelism wq(_b), wkv_b and wo are
    split by heads, and the latent projections run on this rank's tokens (the TP plan). The keys'
    sequence is read from the expanded latents: under context parallelism `latent_keys` gathers the
    latents and rotated RoPE keys of the whole sequence, and the queries are this rank's tokens."""

    def __init__(self, model_args: DeepSeekV3ModelArgs):
        super().__init__()
        args = model_args
        self.q_lora_rank, self.kv_lora_rank = args.q_lora_rank, args.kv_lora_rank
        self.nope_dim, self.rope_dim = args.qk_nope_head_dim, args.qk_rope_head_dim
        self.v_dim = args.v_head_dim
        self.head_dim = args.head_dim
        q_out = args.n_heads * args.head_dim
        if self.q_lora_rank:
            self.wq_a = nn.Linear(args.dim, self.q_lora_rank, bias=False)
            self.q_norm = decoder.RMSNorm(self.q_lora_rank, eps=args.norm_eps)
            self.wq_b = nn.Linear(self.q_lora_rank, q_out, bias=False)
        else:
            self.wq = nn.Linear(args.dim, q_out, bias=False)
        self.wkv_a = nn.Linear(args.dim, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_norm = decoder.RMSNorm(self.kv_lora_rank, eps=args.norm_eps)
        self.wkv_b = nn.Linear(self.kv_lora_rank, args.n_heads * (self.nope_dim + self.v_dim), bias=False)
        self.wo = nn.Linear(args.n_heads * self.v_dim, args.dim, bias=False)
        self.shared_key = SharedKey()
        self.latent_keys = LatentKeys()
        self.sdpa = decoder.CausalAttention()
        # SDPA scales by head_dim^-0.5; YaRN's mscale^2 goes on the queries.
        self.query_scale = args.yarn_scale

    def init_weights(self, init_std: float) -> None:
        inputs = (self.wq_a, self.wq_b) if self.q_lora_rank else (self.wq,)
        for linear in (*inputs, self.wkv_a, self.wkv_b):
            trunc_normal_(linear.weight, std=0.02)
        trunc_normal_(self.wo.weight, std=init_std)
        for norm in (self.q_norm, self.kv_norm) if self.q_lora_rank else (self.kv_norm,):
            ones_(norm.weight)

    def forward(
        self, x: torch.Tensor, freqs_cis: torch.Tensor, documents: Documents | None = None
    ) -> torch.Tensor:
        q = self.wq_b(self.q_norm(self.wq_a(x))) if self.q_lora_rank else self.wq(x)
        # The sequence as the projections to heads see it (under TP, gathered).
        bs, seqlen = q.shape[:2]
        q_nope, q_pe = q.view(bs, seqlen, -1, self.head_dim).split([self.nope_dim, self.rope_dim], -1)
        latent, k_pe = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], -1)
        k_pe = self.shared_key(k_pe).unsqueeze(2)  # (bs, seqlen, 1, rope_dim)
        q_pe, k_pe = llama.apply_rotary_emb(q_pe, k_pe, decoder.rotations(freqs_cis, seqlen))
        latent, k_pe = self.latent_keys(self.kv_norm(latent), k_pe, documents)
        kv = self.wkv_b(latent)
        kv = kv.view(bs, kv.shape[1], -1, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], -1)
        q = torch.cat([q_nope, q_pe], -1)
        if self.query_scale != 1.0:
            q = q * self.query_scale
        k = torch.cat([k_nope, k_pe.expand(-1, -1, k_nope.shape[2], -1)], -1)
        output = self.sdpa(q, k, v, documents).contiguous().view(bs, seqlen, -1)
        return self.wo(output)


class Transformer(MTPTransformer):
    """DeepSeek-V3 decoder returning float logits; a block's `attention` is MLA, its `feed_forward`
    Llama's SwiGLU in the first `first_k_dense_replace` layers, a mixture of experts with shared
    experts after (`feed_forward.router.weight`, `experts.w1/w2/w3`, `shared_expert.w1/w2/w3` and
    the `expert_bias` buffer, HF's e_score_correction_bias); `model_args.mtp_layers` multi-token
    prediction depths after them (`mtp`, torchtitan/models/mtp.py), each a block of layer index
    n_layers + k - 1 (a mixture of experts, as DeepSeek-V3's)."""

    @staticmethod
    def build_block(layer_id: int, model_args: DeepSeekV3ModelArgs) -> nn.Module:
        args = model_args
        if args.is_sparse(layer_id):
            feed_forward = MoE(
                args.dim,
                args.moe_hidden_dim,
                args.num_experts,
                args.top_k,
                score_func=args.score_func,
                norm_topk_prob=args.norm_topk_prob,
                shared_hidden_dim=args.moe_hidden_dim * args.n_shared_experts,
                n_group=args.n_group,
                topk_group=args.topk_group,
                route_scale=args.routed_scaling_factor,
            )
        else:
            feed_forward = decoder.FeedForward(args.dim, args.hidden_dim)
        return decoder.TransformerBlock(layer_id, args, Attention(args), feed_forward)

    def _precompute_freqs_cis(self, device: torch.device | None = None) -> torch.Tensor:
        return precompute_freqs_cis(self.model_args, device)
