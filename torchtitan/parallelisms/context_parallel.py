"""Context parallelism: every sequence split over the cp ranks, attention over the whole sequence by
all-gathering keys and values (the Llama 3 paper's method; torchtitan's since 2026).

A sequence of S tokens is cut into 2 x CP chunks of S / (2 CP); rank r holds chunks r and 2 CP - 1 - r,
so every rank does the same causal attention work (an early chunk sees few keys, a late one many). With
block_causal a token's work is its position in its document, which head-tail pairing does not balance
(the ranks holding a long document's end do most of it: 7x the idlest rank's on average at 128K tokens
on CP 8, docs/performance.md), so each chunk is cut into pieces and each row's pieces are dealt out by
their work, the same number to each rank, the largest first to the rank with least
(`sequence_layouts`): every rank computes the same layouts from the batch's documents. The train step
takes each rank's tokens and labels from the batch (`shard_sequence`); each attention module rotates
its queries and keys by their true positions, gathers the keys and values of every rank (before GQA
repeats them: kv heads only) and attends with each query piece's true offset (lower-right causal,
within documents with block_causal); autograd reduce-scatters the keys' and values' gradients back.
Multi-head latent attention gathers its compressed latents and rotated RoPE key instead, and expands
every head's keys and values from them on each rank (LatentGather).
The loss is each rank's mean over its tokens, and FSDP averages the gradients over dp_shard x cp,
which gives the gradient of the mean over the whole global batch."""

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention.bias import CausalBias, causal_lower_right
from torch.utils._python_dispatch import _disable_current_modes

from torchtitan.models.decoder import repeat_kv
from torchtitan.models.documents import (
    Documents,
    document_positions,
    flex_attention,
    in_autocast_dtype,
    uses_flex_attention,
)

# block_causal: each of the 2 x CP chunks is cut into up to this many pieces for dealing out (measured:
# 1.004x between ranks on average at 128K tokens on CP 8, docs/performance.md), none shorter than
# FlexAttention's 128-token blocks (a shorter piece would fill its blocks partly, on CUDA).
PIECES_PER_CHUNK = 8
MIN_PIECE = 128


def chunk_ids(cp_degree: int, cp_rank: int) -> tuple[int, int]:
    """The two chunks of the 2 x CP a rank holds: an early one and its mirror."""
    return cp_rank, 2 * cp_degree - 1 - cp_rank


def load_balanced_positions(
    seq_len: int, cp_degree: int, cp_rank: int, device: torch.device | None = None
) -> torch.Tensor:
    """The positions (0..seq_len-1) of a rank's tokens, in the order it holds them (causal)."""
    return layout_positions(causal_layout(seq_len, cp_degree), cp_rank, device)


# A sequence's split over the cp ranks: the size of its pieces, and each rank's pieces (indices, in
# sequence order).
Layout = tuple[int, list[list[int]]]


def causal_layout(seq_len: int, cp_degree: int) -> Layout:
    chunk = seq_len // (2 * cp_degree)
    return chunk, [list(chunk_ids(cp_degree, rank)) for rank in range(cp_degree)]


def sequence_layouts(seq_len: int, cp_degree: int, document_ids: torch.Tensor | None = None) -> list[Layout]:
    """Head-tail chunks for causal attention (one layout, every row's); with the (bs, seq_len) ids of
    block_causal documents, one layout per row (a row's pieces do not depend on the rows beside it, so
    pipeline micro-batches deal as the whole batch), its pieces dealt out by their attention work (the
    sum of each token's position in its document, plus one), the largest first to the rank with least
    among those short of their share (ties to the lowest piece and rank): integer sums, so every rank
    deals the same."""
    if document_ids is None:
        return [causal_layout(seq_len, cp_degree)]
    chunk = seq_len // (2 * cp_degree)
    pieces_per_chunk = PIECES_PER_CHUNK
    while pieces_per_chunk > 1 and (chunk % pieces_per_chunk or chunk // pieces_per_chunk < MIN_PIECE):
        pieces_per_chunk //= 2
    piece, n_pieces = chunk // pieces_per_chunk, 2 * cp_degree * pieces_per_chunk
    rows_work = (document_positions(document_ids.cpu()) + 1).view(-1, n_pieces, piece).sum(2).tolist()
    layouts = []
    for work in rows_work:
        loads, held, share = [0] * cp_degree, [[] for _ in range(cp_degree)], n_pieces // cp_degree
        for p in sorted(range(n_pieces), key=lambda p: -work[p]):
            rank = min((r for r in range(cp_degree) if len(held[r]) < share), key=loads.__getitem__)
            loads[rank] += work[p]
            held[rank].append(p)
        layouts.append((piece, [sorted(pieces) for pieces in held]))
    return layouts


def layout_positions(layout: Layout, cp_rank: int, device: torch.device | None = None) -> torch.Tensor:
    """The positions of a rank's tokens, in the order it holds them."""
    piece, held = layout
    return torch.cat([torch.arange(p * piece, (p + 1) * piece, device=device) for p in held[cp_rank]])


def rows_positions(layouts: list[Layout], cp_rank: int, device: torch.device | None = None) -> torch.Tensor:
    """(rows, rank's tokens): each row's positions of a rank's tokens (one row: every row's)."""
    return torch.stack([layout_positions(layout, cp_rank, device) for layout in layouts])


def shard_sequence(tensor: torch.Tensor, cp_mesh: DeviceMesh, layouts: list[Layout]) -> torch.Tensor:
    """This rank's tokens of a (batch, seq_len) tensor (input ids or labels)."""
    positions = rows_positions(layouts, cp_mesh.get_local_rank(), tensor.device)
    return tensor.gather(1, positions.expand(tensor.shape[0], -1))


def cached_layouts(documents: Documents | None, seq_len: int, cp_degree: int) -> list[Layout]:
    """The sequence's layouts, computed once per forward (its documents' cache) for every layer."""
    if documents is None:
        return [causal_layout(seq_len, cp_degree)]
    key = ("cp layouts", cp_degree)
    if key not in documents.cache:
        documents.cache[key] = sequence_layouts(seq_len, cp_degree, documents.ids)
    return documents.cache[key]


def gather_sequence(x: torch.Tensor, cp_mesh: DeviceMesh, layouts: list[Layout]) -> torch.Tensor:
    """Every rank's pieces of x (bs, rank's tokens, ...), in sequence order; autograd reduce-scatters
    the gradient back."""
    gathered = funcol.all_gather_single(x.contiguous(), gather_dim=1, group=cp_mesh)
    rows = [gathered] if len(layouts) == 1 else gathered.split(1)
    in_order = []
    for row, (piece, held) in zip(rows, layouts):
        pieces = row.split(piece, dim=1)  # rank by rank, each rank's in the order it holds them
        where = {p: i for i, p in enumerate(p for rank_pieces in held for p in rank_pieces)}
        in_order.append(torch.cat([pieces[where[p]] for p in range(len(pieces))], dim=1))
    return torch.cat(in_order) if len(in_order) > 1 else in_order[0]


class ContextParallelAttention(nn.Module):
    """The model's CausalAttention for a rank's pieces of each sequence, attending to the keys of the
    whole sequence: (bs, rank's tokens, heads, head_dim) in and out, like the module it replaces. The
    keys and values are this rank's, gathered here, or with `keys_gathered` already the whole sequence's
    (MLA's, expanded from its gathered latents: LatentGather)."""

    def __init__(self, cp_mesh: DeviceMesh, keys_gathered: bool = False) -> None:
        super().__init__()
        self.cp_mesh, self.keys_gathered = cp_mesh, keys_gathered

    def forward(
        self, xq: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor, documents: Documents | None = None
    ) -> torch.Tensor:
        cp_degree, cp_rank = self.cp_mesh.size(), self.cp_mesh.get_local_rank()
        layouts = cached_layouts(documents, xq.shape[1] * cp_degree, cp_degree)
        keys, values = xk, xv
        if not self.keys_gathered:
            keys, values = (gather_sequence(t, self.cp_mesh, layouts) for t in (xk, xv))
        n_rep = xq.shape[2] // xk.shape[2]
        # MLA's values are narrower than its queries and keys, which the fused kernels refuse: padded
        # with zeros, which add zeros to the output's extra features, cut off after.
        v_dim = values.shape[-1]
        if v_dim != xq.shape[-1]:
            values = F.pad(values, (0, xq.shape[-1] - v_dim))
        k, v = (repeat_kv(t, n_rep).transpose(1, 2) for t in (keys, values))
        # Each piece's queries see every key up to their own last position (of their own document).
        rows_ends = [[(p + 1) * piece for p in held[cp_rank]] for piece, held in layouts]
        if documents is None:
            out = chunked_causal_attention(xq.transpose(1, 2), k, v, rows_ends[0])
        else:
            out = chunked_document_attention(xq.transpose(1, 2), k, v, rows_ends, documents)
        return out[..., :v_dim] if v_dim != xq.shape[-1] else out


class LatentGather(nn.Module):
    """Multi-head latent attention's LatentKeys under CP (models/deepseek_v3/model.py): each rank's
    normed latents and rotated RoPE key (rotated by their true positions: apply_cp's hook), gathered
    into the whole sequence's in sequence order by one all-gather of kv_lora_rank + qk_rope_head_dim
    features per token, which the model's wkv_b then expands into every head's keys and values on each
    rank (not n_heads x (qk_head_dim + v_head_dim) features gathered: docs/composability.md). They
    travel in the dtype wkv_b's matmul takes them in (autocast's: the same rounding it would do), and
    autograd reduce-scatters their gradients back to the ranks that hold their tokens."""

    def __init__(self, cp_mesh: DeviceMesh) -> None:
        super().__init__()
        self.cp_mesh = cp_mesh

    def forward(
        self, latent: torch.Tensor, k_pe: torch.Tensor, documents: Documents | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cp_degree = self.cp_mesh.size()
        layouts = cached_layouts(documents, latent.shape[1] * cp_degree, cp_degree)
        latent, k_pe = in_autocast_dtype(latent, k_pe)
        rank, rope_dtype = latent.shape[-1], k_pe.dtype
        both = torch.cat([latent, k_pe.flatten(2).to(latent.dtype)], -1)  # one collective, not two
        latent, k_pe = gather_sequence(both, self.cp_mesh, layouts).split([rank, both.shape[-1] - rank], -1)
        return latent, k_pe.unsqueeze(2).to(rope_dtype)


def chunked_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ends: list[int]
) -> torch.Tensor:
    """Causal attention of equal chunks of queries, q (bs, heads, len(ends) x chunk, head_dim), on the keys
    and values of the whole sequence (bs, heads, seq_len, head_dim): chunk i's queries are positions
    ends[i] - chunk .. ends[i] - 1, and query p sees keys 0..p (lower-right causal). Returns
    (bs, len(ends) x chunk, heads, head_dim).

    On CUDA, SDPA with its lower-right causal bias per chunk, which keeps the fused kernels. On CPU, CPU
    flash attention per chunk on its own block (causal) and on the keys before it (all visible), merged
    by their log-sum-exps: no queries x keys mask is made and kept for backward, and the output is kept
    once (as the model's output projection's input too)."""
    q, k, v = in_autocast_dtype(q, k, v)
    chunk = q.shape[2] // len(ends)
    if q.device.type == "cpu":
        return _CpuChunkedCausalAttention.apply(q, k, v, _chunk_parts(ends, chunk))
    outputs = [
        F.scaled_dot_product_attention(
            q[:, :, i * chunk : (i + 1) * chunk],
            k[:, :, :end],
            v[:, :, :end],
            attn_mask=lower_right_bias(chunk, end),
        )
        for i, end in enumerate(ends)
    ]
    return torch.cat(outputs, dim=2).transpose(1, 2)


def chunked_document_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows_ends: list[list[int]], documents: Documents
) -> torch.Tensor:
    """chunked_causal_attention within documents (block_causal): each row's pieces end at its own
    `rows_ends`, and query p sees the keys of its own document up to p (`documents`: the ids of the
    whole sequences). On CPU each piece is cut where a document starts and each segment attends as a
    causal chunk does, to its own block and to its document's keys before it; on CUDA FlexAttention with
    the documents' block mask for the rank's query positions."""
    q, k, v = in_autocast_dtype(q, k, v)
    piece = q.shape[2] // len(rows_ends[0])
    if not uses_flex_attention(q.device):
        return _document_chunked_attention(q, k, v, rows_ends, documents.ids)
    positions = torch.stack(
        [torch.cat([torch.arange(end - piece, end, device=q.device) for end in ends]) for ends in rows_ends]
    )
    return flex_attention(q, k, v, documents.block_mask(positions, key="cp"))


def lower_right_bias(q_len: int, kv_len: int) -> CausalBias:
    """SDPA's lower-right causal bias: a tensor subclass, which cannot be made under a dispatch mode
    (selective activation checkpointing's, fake tensors'), so it is made outside them."""
    with _disable_current_modes():
        return causal_lower_right(q_len, kv_len)


# A query segment: the batch rows and query rows it holds, and the key parts it attends to, each with
# whether causally.
Segment = tuple[slice, slice, list[tuple[slice, bool]]]


class _CpuChunkedCausalAttention(torch.autograd.Function):
    """chunked_causal_attention on CPU, given its query segments. A segment's softmax spans two parts, the
    keys of its own block and the keys before it, each attended by CPU flash attention (output and
    log-sum-exp) and merged by their log-sum-exps. The backward asks each part's flash backward for its
    gradients given the merged output and log-sum-exp, which gives the gradients of the joint softmax
    (the identity ring attention uses)."""

    @staticmethod
    def forward(ctx, q, k, v, segments):  # noqa: ANN001, ANN205
        out = q.new_empty(q.shape[0], q.shape[2], q.shape[1], q.shape[3])  # the model's layout
        lse = q.new_empty(q.shape[:3], dtype=torch.float32)
        for batch, rows, parts in segments:
            merged_out, merged_lse = None, None
            for keys, causal in parts:
                query, key, value = q[batch, :, rows], k[batch, :, keys], v[batch, :, keys]
                part_out, part_lse = _flash_cpu(query, key, value, 0.0, causal)
                if merged_lse is None:
                    merged_out, merged_lse = part_out.float(), part_lse
                    continue
                new_lse = torch.logaddexp(merged_lse, part_lse)
                merged_weight, part_weight = (
                    torch.exp(x - new_lse).unsqueeze(-1) for x in (merged_lse, part_lse)
                )
                merged_out = merged_out * merged_weight + part_out.float() * part_weight
                merged_lse = new_lse
            out.transpose(1, 2)[batch, :, rows] = merged_out
            lse[batch, :, rows] = merged_lse
        ctx.segments = segments
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001, ANN205
        q, k, v, out, lse = ctx.saved_tensors
        grad_out, out = grad_out.transpose(1, 2), out.transpose(1, 2)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for batch, rows, parts in ctx.segments:
            segment_grad, segment_out, segment_lse = (
                t[batch, :, rows].contiguous() for t in (grad_out, out, lse)
            )
            for keys, causal in parts:
                dq_part, dk_part, dv_part = _flash_cpu_backward(
                    segment_grad,
                    q[batch, :, rows],
                    k[batch, :, keys],
                    v[batch, :, keys],
                    segment_out,
                    segment_lse,
                    0.0,
                    causal,
                )
                dq[batch, :, rows] += dq_part
                dk[batch, :, keys] += dk_part
                dv[batch, :, keys] += dv_part
        return dq, dk, dv, None


def _chunk_parts(ends: list[int], chunk: int) -> list[Segment]:
    """Causal: each chunk is a segment of every batch row, attending to its own block (causally) and the
    keys before it (all visible) unless it is the first chunk."""
    segments = []
    for i, end in enumerate(ends):
        parts = [(slice(end - chunk, end), True)]
        if end > chunk:
            parts.append((slice(0, end - chunk), False))
        segments.append((slice(None), slice(i * chunk, (i + 1) * chunk), parts))
    return segments


def _document_parts(rows_ends: list[list[int]], piece: int, ids: torch.Tensor) -> list[Segment]:
    """block_causal: each piece of each batch row cut where a document starts; a segment attends to its
    own block (causally) and to the keys of its document before the block (all visible)."""
    segments = []
    for b, (ends, row_ids) in enumerate(zip(rows_ends, ids)):
        starts = (torch.arange(len(row_ids)) - document_positions(row_ids[None])[0]).tolist()
        changes = (torch.nonzero(row_ids[1:] != row_ids[:-1]).flatten() + 1).tolist()
        for i, end in enumerate(ends):
            first = end - piece
            bounds = [first, *(p for p in changes if first < p < end), end]
            for a, e in zip(bounds[:-1], bounds[1:]):
                parts = [(slice(a, e), True)]
                if starts[a] < a:
                    parts.append((slice(starts[a], a), False))
                rows = slice(i * piece + a - first, i * piece + e - first)
                segments.append((slice(b, b + 1), rows, parts))
    return segments


@torch.compiler.disable
def _document_chunked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows_ends: list[list[int]], ids: torch.Tensor
) -> torch.Tensor:
    """The CPU path with documents, whose bounds are read on the host: dynamo leaves it out of a
    compiled block."""
    segments = _document_parts(rows_ends, q.shape[2] // len(rows_ends[0]), ids.cpu())
    return _CpuChunkedCausalAttention.apply(q, k, v, segments)


_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_cpu_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh, gather_latents: bool = True) -> None:
    """Each attention module attends across the cp ranks and rotates by true positions: RoPE's rotations
    (the `freqs_cis` argument: the table, or with block_causal those of every token of the whole
    sequences) are indexed by the rank's positions, from the length of its input and the documents.
    An attention with a `latent_keys` hook (MLA) gathers its latents rather than its heads' keys and
    values, unless `gather_latents` is off (the benchmark's and the tests' comparison). A linear
    attention (a `sequence` module: Gated DeltaNet) runs its pieces and chains their states instead
    (context_parallel_deltanet.py)."""
    cp_degree, cp_rank = cp_mesh.size(), cp_mesh.get_local_rank()

    def rotate_by_true_positions(module: nn.Module, args: tuple, kwargs: dict) -> tuple:
        x, freqs_cis = args
        layouts = cached_layouts(kwargs.get("documents"), x.shape[1] * cp_degree, cp_degree)
        positions = rows_positions(layouts, cp_rank, freqs_cis.device)
        if freqs_cis.ndim == 2:  # the table, causal: one layout
            return (x, freqs_cis.index_select(0, positions[0])), kwargs
        rows = torch.arange(freqs_cis.shape[0], device=freqs_cis.device)[:, None]
        return (x, freqs_cis[rows, positions]), kwargs

    def prepare_documents(documents: Documents) -> None:
        """The sequences' split over the ranks and, on CUDA, the block mask of the rank's queries, made
        before the blocks (the split is read on the host, the mask compiles on its own)."""
        layouts = cached_layouts(documents, documents.ids.shape[1], cp_degree)
        if uses_flex_attention(documents.ids.device):
            documents.block_mask(rows_positions(layouts, cp_rank, documents.ids.device), key="cp")

    model.prepare_documents = prepare_documents
    for parent, name, _ in model.blocks():  # multi-token prediction's blocks too
        attention = parent.get_submodule(name).attention
        if hasattr(attention, "sequence"):  # linear attention (Gated DeltaNet): its pieces chained
            from torchtitan.parallelisms.context_parallel_deltanet import (
                ContextParallelDeltaNet,
            )  # imports this

            attention.sequence = ContextParallelDeltaNet(cp_mesh)
            continue
        # Multi-head latent attention gathers its latents (LatentGather), its heads expanded after.
        latent = gather_latents and hasattr(attention, "latent_keys")
        if latent:
            attention.latent_keys = LatentGather(cp_mesh)
        attention.sdpa = ContextParallelAttention(cp_mesh, keys_gathered=latent)
        attention.register_forward_pre_hook(rotate_by_true_positions, with_kwargs=True)
