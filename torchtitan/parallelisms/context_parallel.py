"""Context parallelism: every sequence split over the cp ranks, attention over the whole sequence by
all-gathering keys and values (the Llama 3 paper's method; torchtitan's since 2026).

A sequence of S tokens is cut into 2 x CP chunks of S / (2 CP); rank r holds chunks r and 2 CP - 1 - r,
so every rank does the same causal attention work (an early chunk sees few keys, a late one many). The
train step takes each rank's tokens and labels from the batch (`shard_sequence`); each attention module
rotates its queries and keys by their true positions, gathers the keys and values of every rank (before
GQA repeats them: kv heads only) and attends with each query chunk's true offset (lower-right causal);
autograd reduce-scatters the keys' and values' gradients back. The loss is each rank's mean over its
tokens, and FSDP averages the gradients over dp_shard x cp, which gives the gradient of the mean over
the whole global batch."""

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention.bias import CausalBias, causal_lower_right
from torch.utils._python_dispatch import _disable_current_modes

from torchtitan.models.llama.model import repeat_kv


def chunk_ids(cp_degree: int, cp_rank: int) -> tuple[int, int]:
    """The two chunks of the 2 x CP a rank holds: an early one and its mirror."""
    return cp_rank, 2 * cp_degree - 1 - cp_rank


def load_balanced_positions(
    seq_len: int, cp_degree: int, cp_rank: int, device: torch.device | None = None
) -> torch.Tensor:
    """The positions (0..seq_len-1) of a rank's tokens, in the order it holds them."""
    chunk = seq_len // (2 * cp_degree)
    return torch.cat(
        [torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in chunk_ids(cp_degree, cp_rank)]
    )


def shard_sequence(tensor: torch.Tensor, cp_mesh: DeviceMesh) -> torch.Tensor:
    """This rank's tokens of a (batch, seq_len) tensor (input ids or labels)."""
    positions = load_balanced_positions(
        tensor.shape[1], cp_mesh.size(), cp_mesh.get_local_rank(), tensor.device
    )
    return tensor.index_select(1, positions)


class ContextParallelAttention(nn.Module):
    """The model's CausalAttention for a rank's two chunks of each sequence, attending to the keys of the
    whole sequence: (bs, 2 chunks, heads, head_dim) in and out, like the module it replaces."""

    def __init__(self, cp_mesh: DeviceMesh) -> None:
        super().__init__()
        self.cp_mesh = cp_mesh

    def forward(
        self, xq: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor, documents: None = None
    ) -> torch.Tensor:
        # block_causal with context parallelism is refused first (config_rules.check_attention_mask).
        assert documents is None, "block_causal does not run with context parallelism yet"
        cp_degree, chunk = self.cp_mesh.size(), xq.shape[1] // 2
        keys, values = (self._gather_sequence(t, cp_degree) for t in (xk, xv))
        n_rep = xq.shape[2] // xk.shape[2]
        k, v = (repeat_kv(t, n_rep).transpose(1, 2) for t in (keys, values))
        # Each chunk's queries see every key up to their own last position.
        ends = [(c + 1) * chunk for c in chunk_ids(cp_degree, self.cp_mesh.get_local_rank())]
        return chunked_causal_attention(xq.transpose(1, 2), k, v, ends)

    def _gather_sequence(self, x: torch.Tensor, cp_degree: int) -> torch.Tensor:
        """Every rank's chunks of x (bs, 2 chunks, kv heads, head_dim), in sequence order."""
        gathered = funcol.all_gather_single(x.contiguous(), gather_dim=1, group=self.cp_mesh)
        held = gathered.chunk(2 * cp_degree, dim=1)  # rank r's two chunks at 2r and 2r + 1
        order = [2 * c if c < cp_degree else 2 * (2 * cp_degree - 1 - c) + 1 for c in range(2 * cp_degree)]
        return torch.cat([held[i] for i in order], dim=1)


def chunked_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ends: list[int]
) -> torch.Tensor:
    """Causal attention of equal chunks of queries, q (bs, heads, len(ends) x chunk, head_dim), on the keys
    and values of the whole sequence (bs, heads, seq_len, head_dim): chunk i's queries are positions
    ends[i] - chunk .. ends[i] - 1, and query p sees keys 0..p (lower-right causal). Returns
    (bs, len(ends) x chunk, heads, head_dim).

    On CUDA, SDPA with its lower-right causal bias per chunk, which keeps the fused kernels. On CPU, CPU
    flash attention per chunk on the keys before its block (all visible) and on the block (causal),
    merged by their log-sum-exps, into one output: no queries x keys mask is made and kept for backward,
    and the output is kept once (as the model's output projection's input too). Under autocast it runs
    in autocast's dtype, as SDPA would (Qwen3's fp32 q/k norms make q and k fp32, v is bf16)."""
    if torch.is_autocast_enabled(q.device.type):
        dtype = torch.get_autocast_dtype(q.device.type)
        q, k, v = (t.to(dtype) for t in (q, k, v))
    if q.device.type == "cpu":
        return _CpuChunkedCausalAttention.apply(q, k, v, ends)
    chunk = q.shape[2] // len(ends)
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


def lower_right_bias(q_len: int, kv_len: int) -> CausalBias:
    """SDPA's lower-right causal bias: a tensor subclass, which cannot be made under a dispatch mode
    (selective activation checkpointing's, fake tensors'), so it is made outside them."""
    with _disable_current_modes():
        return causal_lower_right(q_len, kv_len)


class _CpuChunkedCausalAttention(torch.autograd.Function):
    """chunked_causal_attention on CPU. A chunk's softmax spans two parts, the keys before its block and
    the block, each attended by CPU flash attention (output and log-sum-exp) and merged by their
    log-sum-exps. The backward asks each part's flash backward for its gradients given the merged output
    and log-sum-exp, which gives the gradients of the joint softmax (the identity ring attention uses)."""

    @staticmethod
    def forward(ctx, q, k, v, ends):  # noqa: ANN001, ANN205
        chunk = q.shape[2] // len(ends)
        out = q.new_empty(q.shape[0], q.shape[2], q.shape[1], q.shape[3])  # the model's layout
        lse = q.new_empty(q.shape[:3], dtype=torch.float32)
        for rows, parts in _chunk_parts(ends, chunk):
            merged_out, merged_lse = None, None
            for keys, causal in parts:
                part_out, part_lse = _flash_cpu(q[:, :, rows], k[:, :, keys], v[:, :, keys], 0.0, causal)
                if merged_lse is None:
                    merged_out, merged_lse = part_out.float(), part_lse
                    continue
                new_lse = torch.logaddexp(merged_lse, part_lse)
                merged_weight, part_weight = (
                    torch.exp(x - new_lse).unsqueeze(-1) for x in (merged_lse, part_lse)
                )
                merged_out = merged_out * merged_weight + part_out.float() * part_weight
                merged_lse = new_lse
            out.transpose(1, 2)[:, :, rows] = merged_out
            lse[:, :, rows] = merged_lse
        ctx.ends = ends
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001, ANN205
        q, k, v, out, lse = ctx.saved_tensors
        grad_out, out = grad_out.transpose(1, 2), out.transpose(1, 2)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        chunk = q.shape[2] // len(ctx.ends)
        for rows, parts in _chunk_parts(ctx.ends, chunk):
            chunk_grad, chunk_out = grad_out[:, :, rows].contiguous(), out[:, :, rows].contiguous()
            chunk_lse = lse[:, :, rows].contiguous()
            for keys, causal in parts:
                dq_part, dk_part, dv_part = _flash_cpu_backward(
                    chunk_grad, q[:, :, rows], k[:, :, keys], v[:, :, keys], chunk_out, chunk_lse, 0.0, causal
                )
                dq[:, :, rows] += dq_part
                dk[:, :, keys] += dk_part
                dv[:, :, keys] += dv_part
        return dq, dk, dv, None


def _chunk_parts(ends: list[int], chunk: int) -> list[tuple[slice, list[tuple[slice, bool]]]]:
    """Each chunk's query rows, and the parts of the keys it attends with whether causally: its own
    block, then the keys before it (all visible) unless it is the first chunk."""
    chunks = []
    for i, end in enumerate(ends):
        parts = [(slice(end - chunk, end), True)]
        if end > chunk:
            parts.append((slice(0, end - chunk), False))
        chunks.append((slice(i * chunk, (i + 1) * chunk), parts))
    return chunks


_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_cpu_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh) -> None:
    """Each attention module attends across the cp ranks and rotates by true positions: RoPE's table
    (the `freqs_cis` argument) is indexed by the rank's positions, from the length of its input."""
    cp_degree, cp_rank = cp_mesh.size(), cp_mesh.get_local_rank()

    def rotate_by_true_positions(module: nn.Module, args: tuple) -> tuple:
        x, freqs_cis = args
        positions = load_balanced_positions(x.shape[1] * cp_degree, cp_degree, cp_rank, freqs_cis.device)
        return x, freqs_cis.index_select(0, positions)

    for block in model.layers.values():
        block.attention.sdpa = ContextParallelAttention(cp_mesh)
        block.attention.register_forward_pre_hook(rotate_by_true_positions)
