"""Qwen3.5's tensor-parallel plan of a block: the gated attention's as Qwen3's (its wq's rows are whole
heads' [query | gate], so a rank keeps each head's gate with its query); Gated DeltaNet split by key
head, each rank holding whole key heads and the value heads they serve (gated_deltanet.py).

Under Gated DeltaNet the block's input is gathered over the sequence once; in_proj_qkv (its rows grouped
by key head), in_proj_z, in_proj_b and in_proj_a split column-wise, the conv's channels and A_log,
dt_bias by the same heads (Shard(0), `OwnParametersSharded`: the layer reads their local shards); each
value head's norm runs on this rank's heads with its weight replicated (its gradient summed over the
ranks, as Qwen3's q/k norms); out_proj row-wise, reduce-scattered back to the sequence shards. The delta
rule runs on this rank's heads with no collective."""

from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel

from torchtitan.models.llama.tp_plan import TPStyles, feed_forward_plan
from torchtitan.models.qwen3.tp_plan import qwen3_block_plan
from torchtitan.models.qwen3_5.gated_deltanet import GatedDeltaNet


class OwnParametersSharded(ParallelStyle):
    """A module's own parameters (not its children's) split along dim 0 (per channel or head) over the
    tp mesh, then its inputs prepared by `inputs`, if given: torch's styles shard linear layers only."""

    def __init__(self, inputs: ParallelStyle | None = None):
        super().__init__()
        self.inputs = inputs

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(param, device_mesh, [Shard(0)], src_data_rank=self.src_data_rank)
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        if self.inputs is None:
            return module
        self.inputs.src_data_rank = self.src_data_rank
        return self.inputs._apply(module, device_mesh)


def qwen3_5_block_plan(block: nn.Module, styles: TPStyles) -> dict:
    """A block's plan by its token mixer (module docstring)."""
    if not isinstance(block.attention, GatedDeltaNet):
        return qwen3_block_plan(block, styles)
    colwise, rowwise, prepare = styles(block.attention)
    gather = prepare(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None))
    return {
        "attention_norm": SequenceParallel(),
        "attention": OwnParametersSharded(gather),
        **{f"attention.{name}": colwise() for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")},
        "attention.conv1d": OwnParametersSharded(),
        "attention.norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "attention.out_proj": rowwise(output_layouts=Shard(1)),
        **feed_forward_plan(block, styles),
    }
