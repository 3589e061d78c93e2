"""Context parallelism for Gated DeltaNet (Qwen3.5's linear attention): a rank holds pieces of each
sequence (context_parallel.py's layouts: head-tail chunks, or with block_causal pieces dealt out by
attention work, so a rank's tokens are not one span), and the layer's `sequence` module
(models/qwen3_5/gated_deltanet.py's WholeSequence) is swapped for `ContextParallelDeltaNet`, which runs
those pieces and joins them to the rest of the sequence exactly:

- The delta rule: each piece runs from a zero state, which also gives the linear maps by which its true
  starting state S enters (delta_rule.py's piece_maps: outputs O0 + A_out S, last state S0_end + M S).
  Every rank's (S0_end, M) of every piece is all-gathered, every rank chains them in sequence order
  (chain_states: piece p + 1 starts from M_p S_p + S0_end_p) and corrects its own pieces' outputs.
  All-gather rather than a ring pass: a ring would be 2 CP - 1 dependent sends (a piece needs every
  earlier piece's state, and with block_causal a rank's pieces are dealt out of order, so a rank waits
  on several others in turn); the all-gather is one collective of small tensors (heads x dk x (dk + dv)
  floats per piece, docs/composability.md) and the chain, dk x dk by dk x dv products over at most
  2 CP x 8 pieces, costs each rank little beside its pieces' rule. The backward is autograd's: the
  gathered pieces' gradients are reduce-scattered back to the ranks that computed them.
- The conv: each piece's first 3 tokens read the previous piece's last 3 inputs (the halo), all-gathered
  too (3 x channels per piece), masked where they belong to another document as without CP.
- The resets: g = -inf at the document starts among the rank's tokens, read from the whole sequences'
  document ids; a piece's first token that is no document's first is no reset.
Costs: the rule runs on values widened by dk (piece_maps), about twice its work without CP."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.models.documents import Documents
from torchtitan.models.qwen3_5.delta_rule import chain_states, piece_maps
from torchtitan.models.qwen3_5.gated_deltanet import CausalConv1d, document_starts
from torchtitan.parallelisms.context_parallel import Layout, cached_layouts, gather_sequence, rows_positions


class ContextParallelDeltaNet(nn.Module):
    """A Gated DeltaNet layer's `sequence` for a rank's pieces of each sequence (module docstring):
    the same methods as WholeSequence, on (bs, rank's tokens, ...) tensors."""

    def __init__(self, cp_mesh: DeviceMesh) -> None:
        super().__init__()
        self.cp_mesh = cp_mesh

    def layouts(self, local_len: int, documents: Documents | None) -> list[Layout]:
        return cached_layouts(documents, local_len * self.cp_mesh.size(), self.cp_mesh.size())

    def held(self, layouts: list[Layout], device: torch.device) -> torch.Tensor:
        """(rows, rank's pieces): the sequence index of each of the rank's pieces, row by row."""
        rank = self.cp_mesh.get_local_rank()
        return torch.tensor([held[rank] for _, held in layouts], device=device)

    def gather_pieces(self, x: torch.Tensor, layouts: list[Layout]) -> torch.Tensor:
        """Every piece's x (bs, rank's pieces, ...) from every rank: (bs, pieces, ...) in sequence order."""
        bs, n = x.shape[:2]
        gathered = gather_sequence(x.reshape(bs, n, -1), self.cp_mesh, [(1, held) for _, held in layouts])
        return gathered.view(bs, -1, *x.shape[2:])

    def conv(self, conv1d: CausalConv1d, x: torch.Tensor, documents: Documents | None) -> torch.Tensor:
        bs, length, channels = x.shape
        layouts = self.layouts(length, documents)
        piece, halo = layouts[0][0], conv1d.weight.shape[-1] - 1
        pieces = x.view(bs, -1, piece, channels)
        n = pieces.shape[1]
        tails = self.gather_pieces(pieces[:, :, piece - halo :], layouts)  # (bs, pieces, halo, channels)
        held = self.held(layouts, x.device)
        rows = torch.arange(bs, device=x.device)[:, None]
        # The piece before each of the rank's pieces (zeros before the first).
        halos = F.pad(tails, (0, 0, 0, 0, 1, 0))[rows, held.expand(bs, -1)]
        extended = torch.cat([halos, pieces], dim=2).view(bs * n, halo + piece, channels)
        ids = None
        if documents is not None:
            # Each extended piece's document ids, -1 before the sequence (no document has it).
            positions = (held * piece)[..., None] + torch.arange(piece + halo, device=x.device)
            padded = F.pad(documents.ids, (halo, 0), value=-1)
            ids = padded.gather(1, positions.flatten(1).expand(bs, -1)).view(bs * n, halo + piece)
        return conv1d(extended, ids)[:, halo:].reshape(bs, length, channels)

    def resets(self, documents: Documents) -> torch.Tensor:
        layouts = cached_layouts(documents, documents.ids.shape[1], self.cp_mesh.size())
        positions = rows_positions(layouts, self.cp_mesh.get_local_rank(), documents.ids.device)
        starts = document_starts(documents.ids)
        return starts.gather(1, positions.expand(starts.shape[0], -1))

    def rule(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        documents: Documents | None,
    ) -> torch.Tensor:
        bs, length, heads, dk = k.shape
        dv = v.shape[-1]
        layouts = self.layouts(length, documents)
        piece = layouts[0][0]
        n = length // piece
        by_piece = (t.reshape(bs * n, piece, *t.shape[2:]) for t in (q, k, v, g, beta))
        out, a_out, ends, maps = piece_maps(*by_piece)
        both = torch.cat([ends, maps], dim=-1).view(bs, n, heads, dk, dv + dk)
        gathered = self.gather_pieces(both, layouts)
        starts = chain_states(*gathered.split([dv, dk], dim=-1))  # (bs, pieces, heads, dk, dv)
        rows = torch.arange(bs, device=k.device)[:, None]
        mine = starts[rows, self.held(layouts, k.device).expand(bs, -1)].flatten(0, 1)
        out = out + torch.einsum("bthk,bhkv->bthv", a_out, mine)
        return out.reshape(bs, length, heads, dv)
