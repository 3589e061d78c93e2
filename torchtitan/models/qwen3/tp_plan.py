"""Qwen3's tensor-parallel plan of a block (Qwen3-MoE's too): Llama's, plus its per-head q/k norms."""

from torch import nn
from torch.distributed.tensor.parallel import SequenceParallel

from torchtitan.models.llama.tp_plan import TPStyles, llama_block_plan


def qwen3_block_plan(block: nn.Module, styles: TPStyles) -> dict:
    """The q/k norms run on this rank's heads, (bs, seqlen, local heads, head_dim) after the
    column-wise wq/wk: as sequence parallelism on dim 2, their weights are replicated DTensors, so
    each rank's partial gradient is summed over the TP group."""
    return {
        **llama_block_plan(block, styles),
        "attention.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "attention.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
    }
