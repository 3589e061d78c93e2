"""The decoder every family builds on, and its family-independent parts: pre-norm blocks of attention
and a feed-forward, RMSNorm, the SwiGLU MLP, causal (block-causal) attention over GQA heads.

Written to be built on the meta device, parallelised (FSDP, TP, PP), materialised with `to_empty` and
then initialised with `Decoder.init_weights`, which gives the same weights for a seed whatever the
parallelism (see `torchtitan.models.init`). A family (torchtitan/models/<family>/model.py) subclasses
`Decoder` with its blocks (`build_block`) and its RoPE table (`_precompute_freqs_cis`); the model names
its own blocks and pipeline ends (`blocks`, `sharding_units`, `drop_outside`, ...), so the parallelisms
ask it rather than knowing each family's extras (multi-token prediction's depths, torchtitan/models/mtp.py).
"""

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.documents import (
    Documents,
    block_causal_attention,
    document_positions,
    find_documents,
    prepare_block_mask,
)
from torchtitan.models.init import normal_, ones_, seeded_init, trunc_normal_
from torchtitan.models.spec import ModelArgs


def upcast(x: torch.Tensor) -> torch.Tensor:
    """`x` in the precision norms, RoPE and the loss compute in, whatever the matmuls' (bf16 under
    autocast): torch's default dtype, float32, or float64 under training.float64 (train.py sets it)."""
    return x.to(torch.get_default_dtype())


def rotations(freqs_cis: torch.Tensor, seqlen: int) -> torch.Tensor:
    """The rotations of a sequence's tokens: the table's first `seqlen` rows, or the per-token rotations
    (bs, seqlen, .) the model looked up for positions within documents."""
    return freqs_cis[:seqlen] if freqs_cis.ndim == 2 else freqs_cis


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Share each kv head with `n_rep` consecutive query heads (GQA)."""
    if n_rep == 1:
        return x
    bs, seqlen, n_kv_heads, head_dim = x.shape
    return (
        x[:, :, :, None, :]
        .expand(bs, seqlen, n_kv_heads, n_rep, head_dim)
        .reshape(bs, seqlen, n_kv_heads * n_rep, head_dim)
    )


class CausalAttention(nn.Module):
    """Causal scaled dot-product attention over (bs, seqlen, heads, head_dim) queries, keys and values,
    each kv head serving n_heads / n_kv_heads consecutive query heads (GQA); returns the same layout.
    With `documents` (block_causal) each token attends within its document only.

    A module of its own so that context parallelism can put in its place one that attends to the keys
    of the whole sequence (torchtitan/parallelisms/context_parallel.py)."""

    def forward(
        self, xq: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor, documents: Documents | None = None
    ) -> torch.Tensor:
        n_rep = xq.shape[2] // xk.shape[2]
        keys, values = repeat_kv(xk, n_rep), repeat_kv(xv, n_rep)
        # (bs, n_heads, seqlen, head_dim) layout for SDPA.
        xq, keys, values = (t.transpose(1, 2) for t in (xq, keys, values))
        if documents is not None:
            return block_causal_attention(xq, keys, values, documents)
        return F.scaled_dot_product_attention(xq, keys, values, is_causal=True).transpose(1, 2)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in float32 (`upcast`)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(upcast(x)).type_as(x) * self.weight

    def reset_parameters(self) -> None:
        ones_(self.weight)

    def init_weights(self) -> None:
        self.reset_parameters()


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def init_weights(self, init_std: float) -> None:
        trunc_normal_(self.w1.weight, std=0.02)
        for linear in (self.w2, self.w3):
            trunc_normal_(linear.weight, std=init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attention(norm(x)), then h + feed_forward(norm(h)).

    `attention(x, freqs_cis, documents=)` and `feed_forward(x)` are the family's; each has
    `init_weights(init_std)`."""

    def __init__(self, layer_id: int, model_args: ModelArgs, attention: nn.Module, feed_forward: nn.Module):
        super().__init__()
        self.attention = attention
        self.feed_forward = feed_forward
        self.attention_norm = RMSNorm(model_args.dim, eps=model_args.norm_eps)
        self.ffn_norm = RMSNorm(model_args.dim, eps=model_args.norm_eps)
        # Smaller init for the projections that write into the residual stream, so its
        # variance does not grow with depth.
        depth = layer_id + 1 if model_args.depth_init else model_args.n_layers
        self.weight_init_std = 0.02 / (2 * depth) ** 0.5

    def init_weights(self) -> None:
        self.attention_norm.init_weights()
        self.ffn_norm.init_weights()
        self.attention.init_weights(self.weight_init_std)
        self.feed_forward.init_weights(self.weight_init_std)

    def forward(
        self, x: torch.Tensor, freqs_cis: torch.Tensor, documents: Documents | None = None
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis, documents=documents)
        return h + self.feed_forward(self.ffn_norm(h))


class Decoder(nn.Module):
    """Decoder returning float logits (no loss): embeddings, `layers`, final norm, output.

    `layers` is a ModuleDict keyed by layer id, and `tok_embeddings`, `norm` and `output` may
    be set to None, so a pipeline stage keeps the FQNs of the full model. Each family subclasses it
    with its own blocks (`build_block`) and RoPE (`_precompute_freqs_cis`); with
    `model_args.tie_word_embeddings` the output layer's weight is the embedding table (one parameter,
    `tok_embeddings.weight`).
    """

    def __init__(self, model_args: ModelArgs):
        super().__init__()
        self.model_args = model_args
        self.tok_embeddings = nn.Embedding(model_args.vocab_size, model_args.dim)
        # Not persistent: recomputed by init_weights, so not part of checkpoints.
        self.register_buffer("freqs_cis", self._precompute_freqs_cis(), persistent=False)
        self.layers = nn.ModuleDict(
            {str(layer_id): self.build_block(layer_id, model_args) for layer_id in range(model_args.n_layers)}
        )
        self.norm = RMSNorm(model_args.dim, eps=model_args.norm_eps)
        self.output = nn.Linear(model_args.dim, model_args.vocab_size, bias=False)
        if model_args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # What block_causal attention derives from the documents, made before the blocks (outside
        # compiled code); context parallelism replaces it (parallelisms/context_parallel.py).
        self.prepare_documents = prepare_block_mask

    def _apply(self, fn, recurse: bool = True) -> "Decoder":
        """Conversions (`to_empty`, `to`) replace each module's parameters one by one, which would
        untie a tied output layer: tie it again."""
        super()._apply(fn, recurse)
        if (
            self.model_args.tie_word_embeddings
            and self.tok_embeddings is not None
            and self.output is not None
        ):
            self.output.weight = self.tok_embeddings.weight
        return self

    @staticmethod
    def build_block(layer_id: int, model_args: ModelArgs) -> nn.Module:
        """The family's block of layer `layer_id`."""
        raise NotImplementedError

    @classmethod
    def from_model_args(cls, model_args: ModelArgs) -> "Decoder":
        return cls(model_args)

    def _precompute_freqs_cis(self, device: torch.device | None = None) -> torch.Tensor:
        """The family's RoPE table (max_seq_len, head_dim // 2), complex."""
        raise NotImplementedError

    def init_weights(self, seed: int = 0, buffer_device: torch.device | None = None) -> None:
        """Initialise every parameter once and recompute `freqs_cis` on `buffer_device`.

        The values depend only on `seed` and each parameter's FQN and shape, so they are the
        same for any FSDP/TP/PP layout. Call after `to_empty`.
        """
        if buffer_device is None:
            buffer_device = next(self.parameters()).device
        self.freqs_cis = self._precompute_freqs_cis(buffer_device)
        with seeded_init(self, seed):
            if self.tok_embeddings is not None and not self.model_args.tie_word_embeddings:
                normal_(self.tok_embeddings.weight)
            for layer in self.layers.values():
                layer.init_weights()
            self.init_extra_weights()
            if self.norm is not None:
                self.norm.init_weights()
            if self.output is not None:
                # A tied table is initialised once, here, with transformers' initializer_range (0.02):
                # a token's final hidden state starts near its own embedding, whose logit is
                # dim * std, so the untied std (dim**-0.5, a logit of sqrt(dim)) would start far too high.
                tied = self.model_args.tie_word_embeddings
                final_out_std = 0.02 if tied else self.model_args.dim**-0.5
                cutoff_factor = 3
                trunc_normal_(
                    self.output.weight,
                    std=final_out_std,
                    a=-cutoff_factor * final_out_std,
                    b=cutoff_factor * final_out_std,
                )

    def init_extra_weights(self) -> None:
        """A subclass's modules beyond the shared shape (multi-token prediction's), under init_weights'
        seeded init."""

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Parameters held by this module (a PP stage counts its own); global sizes for DTensors.
        `exclude_embedding` leaves out the embedding table unless it is tied to the output layer."""
        num = sum(p.numel() for p in self.parameters())
        if exclude_embedding and self.tok_embeddings is not None and not self.model_args.tie_word_embeddings:
            num -= self.tok_embeddings.weight.numel()
        return num

    def attention_inputs(
        self, tokens: torch.Tensor, document_ids: torch.Tensor | None
    ) -> tuple[Documents | None, torch.Tensor]:
        """What every block's attention takes: with block_causal the documents (found in `tokens` unless
        `document_ids` are given) and each token's rotations, counted from its document's start; else
        None and the table."""
        if self.model_args.attn_mask_type != "block_causal":
            return None, self.freqs_cis
        if document_ids is None:
            document_ids = find_documents(tokens, self.model_args.eos_id, self.model_args.bos_id)
        documents = Documents(document_ids)
        self.prepare_documents(documents)
        return documents, self.freqs_cis[document_positions(document_ids)]

    def forward(
        self, tokens: torch.Tensor, skip_output: bool = False, document_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """tokens: (bs, seqlen) ids, or hidden states on a stage without `tok_embeddings`.

        Returns float logits (bs, seqlen, vocab), or hidden states on a stage without `output` or
        with `skip_output` (the loss then projects them itself: objective/chunked_cross_entropy.py).
        With block_causal the documents are found in `tokens`, or given as `document_ids` (bs, seq_len)
        of the whole sequences where `tokens` are not those (a later pipeline stage's hidden states, a
        context-parallel rank's share), and RoPE counts from each document's start.
        """
        documents, freqs_cis = self.attention_inputs(tokens, document_ids)
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, freqs_cis, documents)
        h = self.norm(h) if self.norm is not None else h
        return upcast(self.output(h)) if self.output is not None and not skip_output else h

    # What the parallelisms ask of a model (a whole one or a pipeline stage), so that none of them
    # knows a family's extras (multi-token prediction's depths override these).

    def blocks(self) -> list[tuple[nn.Module, str, int]]:
        """Every transformer block held, as (its parent, its name there, its layer index), in forward
        order: what TP, EP, CP, activation checkpointing and compile wrap or change in place."""
        return [(self.layers, name, int(name)) for name in self.layers]

    def sharding_units(self) -> list[nn.Module]:
        """The modules FSDP and DDP make units of their own, in forward order (the root holds the
        rest): each block."""
        return list(self.layers.values())

    def head_norms(self) -> list[str]:
        """The names of the norms held whose output the output layer projects (the final norm)."""
        return ["norm"] if self.norm is not None else []

    def token_wise_modules(self) -> list[str]:
        """The names of the modules held outside the blocks and `head_norms` that act on each token
        alone and feed a block (none here)."""
        return []

    def drop_outside(self, layers: range, is_first: bool, is_last: bool) -> None:
        """Make this (meta) model a pipeline stage in place: keep the blocks of `layers`, the
        embeddings if `is_first`, the final norm and output if `is_last`; the rest is deleted or set
        to None, so the kept parameters keep the whole model's FQNs."""
        for layer_id in list(self.layers):
            if int(layer_id) not in layers:
                del self.layers[layer_id]
        if not is_first:
            self.tok_embeddings = None
        if not is_last:
            self.norm = None
            self.output = None
