"""Multi-token prediction (MTP, DeepSeek-V3 paper §2.2): `model.mtp_layers` = D extra depths after the
main model, depth k predicting the token k+1 ahead (the main model predicts the next one).

Depth k at position i takes the previous depth's hidden state there (the main model's last block output
for k = 1, before the final norm) and the embedding of token i+k (the shared embedding table), each
RMS-normed (hnorm, enorm), concatenates them (embedding first, as DeepSeek's `eh_proj` weights expect),
projects them back to `dim` (eh_proj) and runs one transformer block of the family (layer index
n_layers + k - 1: a mixture of experts for DeepSeek-V3), whose output feeds depth k+1 and, normed by
the depth's own norm (DeepSeek's shared_head.norm), the shared output head. Its target at i is token
i+k+1. Every depth attends causally (within documents, with RoPE from each document's start) like
the main blocks.

The shift is taken on the host, on whole sequences, before context parallelism shares their tokens out
and before the pipeline splits the batch (`mtp_targets`, torchtitan/objective/mtp.py): depth k's input
tokens and targets travel beside the batch's, sharded like them, so no rank needs another's tokens. A
target that is not in the token's own document, or lies beyond the window, is IGNORE_INDEX: a document's
last k+1 positions and the window's have none at depth k, and positions without a target only ever feed
later positions of their own document (which have none either), so what a document learns is what it
would learn alone.
"""

import torch
from torch import nn

from torchtitan.models.decoder import Decoder, RMSNorm, upcast
from torchtitan.models.init import trunc_normal_


class MTPLayer(nn.Module):
    """One MTP depth: `eh_proj(cat(enorm(embedding), hnorm(hidden)))`, then `block` (the family's); its
    `norm` (DeepSeek's shared_head.norm) is applied by the model before the shared output head. HF names
    (DeepSeek-V3's layer n_layers + k - 1): enorm, hnorm, eh_proj, shared_head.norm and the block's."""

    def __init__(self, block: nn.Module, dim: int, eps: float) -> None:
        super().__init__()
        self.enorm = RMSNorm(dim, eps=eps)
        self.hnorm = RMSNorm(dim, eps=eps)
        self.eh_proj = nn.Linear(2 * dim, dim, bias=False)
        self.block = block
        self.norm = RMSNorm(dim, eps=eps)

    def init_weights(self) -> None:
        for norm in (self.enorm, self.hnorm, self.norm):
            norm.init_weights()
        trunc_normal_(self.eh_proj.weight, std=0.02)
        self.block.init_weights()

    def forward(
        self, embeddings: torch.Tensor, hidden: torch.Tensor, freqs_cis: torch.Tensor, documents: object
    ) -> torch.Tensor:
        """The depth's block output (before `norm`) from the shifted tokens' embeddings and the previous
        depth's hidden states, (bs, seqlen, dim) each."""
        h = self.eh_proj(torch.cat([self.enorm(embeddings), self.hnorm(hidden)], dim=-1))
        return self.block(h, freqs_cis, documents)


class MTPTransformer(Decoder):
    """The shared decoder with `model_args.mtp_layers` MTP depths (`mtp`, a ModuleDict of MTPLayer
    keyed "0".."D-1"; None without them, and on pipeline stages before the last).

    forward(tokens, mtp_embeddings=None, *, mtp_tokens=None, ...): without `mtp_tokens` (and on a model
    without depths) the plain decoder's. With them ((bs, seqlen, D) ids: `mtp_targets`' inputs) the
    stage holding the embeddings looks the batch's and the shifted tokens up together (one lookup); a
    stage without the final norm returns (hidden states, shifted embeddings) for the next stage (a
    pipeline sends the embeddings on as an activation, so the one table gets their gradient back); the
    last returns (main output, depth 1's, ..., depth D's): logits, or with `skip_output` the normed
    hidden states the chunked loss projects."""

    def __init__(self, model_args) -> None:  # noqa: ANN001 (any family's arguments with mtp_layers)
        super().__init__(model_args)
        args, self.mtp = model_args, None
        if args.mtp_layers:
            blocks = [self.build_block(args.n_layers + k, args) for k in range(args.mtp_layers)]
            self.mtp = nn.ModuleDict(
                {str(k): MTPLayer(block, args.dim, args.norm_eps) for k, block in enumerate(blocks)}
            )

    def init_extra_weights(self) -> None:
        for layer in self.depths():
            layer.init_weights()

    def depths(self) -> list[MTPLayer]:
        """The depths held (none on a pipeline stage before the last)."""
        return list(self.mtp.values()) if self.mtp is not None else []

    def blocks(self) -> list[tuple[nn.Module, str, int]]:
        """The main blocks, then each depth's (layer n_layers + k - 1)."""
        n_layers = self.model_args.n_layers
        return super().blocks() + [(layer, "block", n_layers + k) for k, layer in enumerate(self.depths())]

    def sharding_units(self) -> list[nn.Module]:
        """The main blocks, then each depth whole (its norms and projection with its block)."""
        return super().sharding_units() + self.depths()

    def head_norms(self) -> list[str]:
        """The final norm and each depth's `norm`, which the shared output layer projects too."""
        return super().head_norms() + [f"mtp.{k}.norm" for k in range(len(self.depths()))]

    def token_wise_modules(self) -> list[str]:
        """Each depth's input norms and projection, which run on each token alone."""
        names = ("enorm", "hnorm", "eh_proj")
        return [f"mtp.{k}.{name}" for k in range(len(self.depths())) for name in names]

    def drop_outside(self, layers: range, is_first: bool, is_last: bool) -> None:
        """The depths belong to the last stage, with the final norm."""
        super().drop_outside(layers, is_first, is_last)
        if not is_last:
            self.mtp = None

    def forward(
        self,
        tokens: torch.Tensor,
        mtp_embeddings: torch.Tensor | None = None,
        skip_output: bool = False,
        document_ids: torch.Tensor | None = None,
        mtp_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if mtp_tokens is None and mtp_embeddings is None:
            return super().forward(tokens, skip_output=skip_output, document_ids=document_ids)
        documents, freqs_cis = self.attention_inputs(tokens, document_ids)
        if self.tok_embeddings is not None:
            looked_up = self.tok_embeddings(torch.cat([tokens.unsqueeze(-1), mtp_tokens], dim=-1))
            h, mtp_embeddings = looked_up[:, :, 0], looked_up[:, :, 1:].contiguous()
        else:
            h = tokens
        for layer in self.layers.values():
            h = layer(h, freqs_cis, documents)
        if self.norm is None:  # a pipeline stage before the last: the embeddings travel on
            # A copy when passed through: the split-backward schedules detach a stage's outputs in place,
            # which neither a view nor the stage's input may be.
            return h, mtp_embeddings if self.tok_embeddings is not None else mtp_embeddings.clone()
        outputs, hidden = [self.norm(h)], h
        for k, layer in enumerate(self.mtp.values()):
            hidden = layer(mtp_embeddings[:, :, k], hidden, freqs_cis, documents)
            outputs.append(layer.norm(hidden))
        if skip_output or self.output is None:
            return tuple(outputs)
        return tuple(upcast(self.output(out)) for out in outputs)
