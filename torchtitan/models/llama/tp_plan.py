"""Llama's tensor-parallel plan of a block: which of its modules split how. The parallelisms apply it
(torchtitan/parallelisms/parallelize.py's apply_tp, with the root's plan every family shares) and pick
the style classes, torch's or torchao's float8 ones, so a plan holds no parallel code of its own."""

from collections.abc import Callable

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel

from torchtitan.models.moe import MoE

# A module's (ColwiseParallel, RowwiseParallel, PrepareModuleInput) style classes for its linear layers.
TPStyles = Callable[[nn.Module], tuple[type, type, type]]


def llama_block_plan(block: nn.Module, styles: TPStyles) -> dict:
    """A Llama block's TP plan: the norms on sequence shards; attention and feed-forward gather the
    sequence, run column- then row-wise sharded projections and reduce-scatter back."""
    a_colwise, a_rowwise, a_prepare = styles(block.attention)
    return {
        "attention_norm": SequenceParallel(),
        "attention": a_prepare(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        "attention.wq": a_colwise(),
        "attention.wk": a_colwise(),
        "attention.wv": a_colwise(),
        "attention.wo": a_rowwise(output_layouts=Shard(1)),
        **feed_forward_plan(block, styles),
    }


def feed_forward_plan(block: nn.Module, styles: TPStyles) -> dict:
    """The feed-forward half of any family's block: its norm on sequence shards, then a SwiGLU split
    column- then row-wise. A mixture of experts is not tensor-parallel: each rank routes the tokens of
    its own sequence shard (no collective), with the layer's weights whole (FSDP shards them over tp
    too: their gradients are partial sums there, parallel_dims.moe_fsdp_meshes)."""
    plan = {"ffn_norm": SequenceParallel()}
    if isinstance(block.feed_forward, MoE):
        plan["feed_forward"] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True
        )
        return plan
    f_colwise, f_rowwise, f_prepare = styles(block.feed_forward)
    return {
        **plan,
        "feed_forward": f_prepare(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": f_colwise(),
        "feed_forward.w2": f_rowwise(output_layouts=Shard(1)),
        "feed_forward.w3": f_colwise(),
    }
