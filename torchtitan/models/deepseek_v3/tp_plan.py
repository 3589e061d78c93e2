"""DeepSeek-V3's tensor-parallel plan of a block: multi-head latent attention split by heads, its latent
projections sequence-parallel; the feed-forward as any family's (llama/tp_plan.py)."""

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel

from torchtitan.models.llama.tp_plan import TPStyles, feed_forward_plan


def deepseek_v3_block_plan(block: nn.Module, styles: TPStyles) -> dict:
    """MLA under TP: the latent projections (wq_a, wkv_a) and their norms run on this rank's tokens
    (sequence parallel, their weights replicated and their gradients summed over the tp ranks); wq_b and
    wkv_b (or a plain wq, on the block's input) gather the latents over the sequence and split by heads,
    as does wo, which reduce-scatters back; the shared RoPE key is gathered on its own. Gathering the
    latents rather than the block's input moves q_lora_rank + kv_lora_rank + qk_rope_head_dim features
    per token instead of dim (2,112 against 7,168 for 671B) and computes each latent once, not once per
    tp rank."""
    colwise, rowwise, prepare = styles(block.attention)
    sequence_parallel = SequenceParallel(use_local_output=True)
    if block.attention.q_lora_rank:
        queries = {
            "attention.wq_a": sequence_parallel,
            "attention.q_norm": sequence_parallel,
            "attention.wq_b": colwise(input_layouts=Shard(1)),
        }
    else:
        queries = {"attention.wq": colwise(input_layouts=Shard(1))}
    return {
        "attention_norm": SequenceParallel(),
        "attention": prepare(
            input_layouts=(Shard(1), None), desired_input_layouts=(Shard(1), None), use_local_output=True
        ),
        **queries,
        "attention.wkv_a": sequence_parallel,
        "attention.kv_norm": sequence_parallel,
        "attention.wkv_b": colwise(input_layouts=Shard(1)),
        "attention.shared_key": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        ),
        "attention.wo": rowwise(output_layouts=Shard(1)),
        **feed_forward_plan(block, styles),
    }
