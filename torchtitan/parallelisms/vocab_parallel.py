"""Tensor parallelism's embedding table, sharded along the vocabulary (Megatron's vocabulary-parallel
embedding), whose backward gives each rank the gradient of its own rows.

torch's RowwiseParallel on an nn.Embedding looks the tokens up in the Shard(0) DTensor table, and
DTensor (torch 2.13) has no vocabulary-sharded rule for the lookup's backward: each rank computes the
gradient of the whole table, replicated, and keeps it as the parameter's gradient. FSDP cuts it to
the rank's rows when it reduces; TP alone, PP x TP and DDP x TP held, clipped and stepped on the whole
table's gradient (twice the table's shard at TP 2, eight times at TP 8). Here each rank looks up
the tokens in its own rows (zeros for the others' tokens), and the ranks' outputs are summed as
sequence parallelism splits them; autograd does the rest on the rank's shard.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor


class VocabParallelEmbedding(nn.Embedding):
    """An embedding whose table is a DTensor sharded along the vocabulary over a 1-D tensor-parallel
    mesh (as torch.chunk splits it: ceil(rows / ranks) per rank, the last ranks maybe fewer). Tokens:
    (bs, seqlen), the same on every rank; output: this rank's slice of the sequence (Shard(1))."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        table, mesh = self.weight.to_local(), self.weight.device_mesh
        rows_per_rank = -(-self.num_embeddings // mesh.size())
        ids = tokens - min(mesh.get_local_rank() * rows_per_rank, self.num_embeddings)
        elsewhere = (ids < 0) | (ids >= table.shape[0])
        mine = F.embedding(ids.masked_fill(elsewhere, 0), table).masked_fill(elsewhere.unsqueeze(-1), 0)
        return DTensor.from_local(mine, mesh, [Partial()]).redistribute(placements=[Shard(1)]).to_local()


def vocab_parallel(embedding: nn.Embedding, tp_mesh: DeviceMesh) -> VocabParallelEmbedding:
    """`embedding` (on the meta device) as a VocabParallelEmbedding over `tp_mesh`, its parameter
    sharded; the name of the parameter (`weight`) is unchanged, and so are checkpoints."""
    sharded = VocabParallelEmbedding(embedding.num_embeddings, embedding.embedding_dim, device="meta")
    table = distribute_tensor(embedding.weight, tp_mesh, [Shard(0)])
    sharded.weight = nn.Parameter(table, requires_grad=embedding.weight.requires_grad)
    return sharded
