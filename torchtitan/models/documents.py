"""Packed documents (`model.attn_mask_type = "block_causal"`): each token attends only to the earlier
tokens of its own document, and RoPE counts its position from the document's start.

The text data path packs documents back to back into windows, each ending with its EOS; the documents
are found again from the token ids the model is given (`find_documents`), so every text data path,
validation, evaluation and generation get the same mask without the loader carrying anything new. A
window that starts inside a document starts a document at its first token. Chat data cannot be split at
EOS (Qwen3's <|im_end|> ends every turn of a conversation): its batches carry each token's position in its
conversation, and the documents are found from those (`documents_from_positions`) instead.

Attention never builds a sequence x sequence mask: on CPU each document segment attends on its own
(CPU flash attention, causal), so a masked block costs nothing and memory stays linear in the
sequence; on CUDA FlexAttention runs with a block mask built from the document ids (whole masked
blocks skipped), with the CPU path as its reference."""

import functools
from typing import Any

import torch
import torch.nn.functional as F


@functools.cache
def _compiled_flex_attention() -> Any:
    """FlexAttention, fast only compiled: compiled once for every model, on first use (importing it
    and torch.compile's machinery takes seconds, which a causal or CPU run need not pay)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


@functools.cache
def _compiled_create_block_mask() -> Any:
    """create_block_mask compiled, so that the mask is made block by block, never as a seqlen x seqlen
    tensor."""
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask)


def find_documents(tokens: torch.Tensor, eos_id: int, bos_id: int | None) -> torch.Tensor:
    """(bs, seqlen) int64: each token's document, counted from 0 in each row. A document ends with its
    EOS (the next token starts the next one), and a BOS starts one."""
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    starts[:, 1:] = tokens[:, :-1] == eos_id
    if bos_id is not None:
        starts[:, 1:] |= tokens[:, 1:] == bos_id
    return starts.long().cumsum(1)


def documents_from_positions(positions: torch.Tensor) -> torch.Tensor:
    """(bs, seqlen) int64: each token's document, counted from 0 in each row, from its position in its
    document (a document starts where the position is 0)."""
    return (positions == 0).long().cumsum(1) - 1


def document_positions(ids: torch.Tensor) -> torch.Tensor:
    """(bs, seqlen) int64: each token's position in its document, from `find_documents`."""
    index = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    first = torch.ones_like(ids, dtype=torch.bool)
    first[:, 1:] = ids[:, 1:] != ids[:, :-1]
    return index - torch.where(first, index, 0).cummax(1).values


class Documents:
    """What block-causal attention needs of a batch: the document ids of its whole sequences, and what is
    derived from them once per forward for every layer (FlexAttention's block masks on CUDA, context
    parallelism's layout) in `cache`."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids
        self.cache: dict[Any, Any] = {}

    def block_mask(self, query_positions: torch.Tensor | None = None, key: str = "all") -> Any:
        """The block mask of queries at `query_positions` of the sequence (default: every position),
        cached under `key`."""
        if ("block mask", key) not in self.cache:
            self.cache["block mask", key] = block_causal_mask(self.ids, query_positions)
        return self.cache["block mask", key]


def uses_flex_attention(device: torch.device) -> bool:
    """FlexAttention on CUDA; on the CPU (no FlexAttention backward) attention per document segment."""
    return device.type == "cuda"


def prepare_block_mask(documents: Documents) -> None:
    """FlexAttention's block mask of the whole sequences, made when the model's forward finds its
    documents: made inside a compiled block it broke the block's graph (it compiles on its own), and
    every layer reuses it."""
    if uses_flex_attention(documents.ids.device):
        documents.block_mask()


def block_causal_mask(ids: torch.Tensor, query_positions: torch.Tensor | None = None) -> Any:
    """FlexAttention's mask (a BlockMask): the query at position p sees key k of the same row when both
    are in one document and k <= p; blocks of 128 x 128 with no such pair are skipped. The queries are
    every position, or those at `query_positions` (bs, queries): a context-parallel rank's pieces."""
    from torch.nn.attention.flex_attention import create_block_mask

    bs, seqlen = ids.shape
    positions = query_positions
    if positions is None:
        positions = torch.arange(seqlen, device=ids.device).expand(bs, seqlen)

    def same_document_causal(b, h, q, k):  # noqa: ANN001, ANN202
        p = positions[b, q]
        return (ids[b, p] == ids[b, k]) & (k <= p)

    # On the CPU, where only the tests make it, eagerly.
    make = _compiled_create_block_mask() if ids.is_cuda else create_block_mask
    return make(same_document_causal, bs, None, positions.shape[1], seqlen, device=ids.device)


def in_autocast_dtype(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Under autocast, attention runs in autocast's dtype, as SDPA would (Qwen3's fp32 q/k norms make q
    and k fp32 while v is bf16)."""
    if torch.is_autocast_enabled(tensors[0].device.type):
        dtype = torch.get_autocast_dtype(tensors[0].device.type)
        return tuple(t.to(dtype) for t in tensors)
    return tensors


def flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any) -> torch.Tensor:
    """Compiled FlexAttention in autocast's dtype; (bs, heads, seqlen, head_dim) in, (bs, seqlen, heads,
    head_dim) out."""
    q, k, v = in_autocast_dtype(q, k, v)
    if torch.compiler.is_compiling():  # in a compiled block: part of its graph
        from torch.nn.attention.flex_attention import flex_attention as attend
    else:
        attend = _compiled_flex_attention()
    return attend(q, k, v, block_mask=block_mask).transpose(1, 2)


def block_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents
) -> torch.Tensor:
    """Attention of (bs, heads, seqlen, head_dim) queries, keys and values (kv heads already repeated)
    within each document, causal; returns (bs, seqlen, heads, head_dim)."""
    if uses_flex_attention(q.device):
        return flex_attention(q, k, v, documents.block_mask())
    return _segment_attention(q, k, v, documents.ids)


@torch.compiler.disable
def _segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The CPU path: SDPA (causal) on each document segment of each row. The segments' bounds are read
    on the host, so dynamo leaves this out of a compiled block."""
    rows = []
    for b, row_ids in enumerate(ids):
        bounds = [0, *(torch.nonzero(row_ids[1:] != row_ids[:-1]).flatten() + 1).tolist(), ids.shape[1]]
        segments = [
            F.scaled_dot_product_attention(
                q[b : b + 1, :, start:end],
                k[b : b + 1, :, start:end],
                v[b : b + 1, :, start:end],
                is_causal=True,
            )
            for start, end in zip(bounds[:-1], bounds[1:])
        ]
        rows.append(torch.cat(segments, dim=2))
    return torch.cat(rows).transpose(1, 2)
