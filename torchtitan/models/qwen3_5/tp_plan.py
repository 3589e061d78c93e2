"""Qwen3.5's tensor-parallel plan of a block: not written yet (issue 65's next step splits Gated
DeltaNet's value and key heads over the ranks, its conv channels with them). The preflight refuses
tensor parallelism for this family (config_rules.check_parallelism); what calls the plan regardless
stops here, in the same line."""

from torch import nn

from torchtitan.config.options import ConfigError
from torchtitan.models.llama.tp_plan import TPStyles


def qwen3_5_block_plan(block: nn.Module, styles: TPStyles) -> dict:
    raise ConfigError(
        "parallelism.tensor_parallel_degree: qwen3_5 has no tensor-parallel plan yet (issue 65); use 1"
    )
