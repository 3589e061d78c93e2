"""A model family as one record: what `model.name` picks.

A family brings only what is its own: its torch-free arguments and flavours, its model class (built
on the meta device, `init_weights()` on every module), its tensor-parallel plan and its Hugging Face
key map. Everything else (FSDP/HSDP, activation checkpointing, compile, float8, the pipeline split, the
loss, checkpoints) is shared code that works on any family whose model has the shared shape:
`tok_embeddings`, a `layers` ModuleDict of blocks keyed by layer id, `norm` and `output` (each of the
three may be None on a pipeline stage), `init_weights(seed)` and `num_params(exclude_embedding)`.

Importing this module does not import torch: the preflight reads flavours and checks shapes before any
worker starts. The torch parts of a spec are named "module:attribute" and imported on first use.
"""

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol


class ModelArgs(Protocol):
    """What shared code reads of any family's arguments (each family's dataclass has more)."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int | None  # None: same as n_heads
    vocab_size: int
    max_seq_len: int

    @property
    def head_dim(self) -> int: ...

    @property
    def tie_word_embeddings(self) -> bool: ...


def flops_per_token(num_params: int, n_layers: int, n_heads: int, head_dim: int, seq_len: int) -> int:
    """Training FLOPs per token: 6 per parameter (forward + backward) plus attention scores and
    weighted sum, 12 * layers * heads * head_dim * seq_len, not discounted for the causal mask (the
    convention of the PaLM paper, so MFU figures compare with published ones)."""
    return 6 * num_params + 12 * n_layers * n_heads * head_dim * seq_len


def dense_flops_per_token(model_args: ModelArgs, num_params: int, seq_len: int) -> int:
    """`flops_per_token` of a dense decoder; `num_params` are those a token's matmuls use (the
    model's parameters without the embedding table, which is a lookup, unless it is the output's)."""
    return flops_per_token(num_params, model_args.n_layers, model_args.n_heads, model_args.head_dim, seq_len)


def load(reference: str) -> Any:
    """The object a "package.module:attribute" reference names, importing its module."""
    module, _, attribute = reference.partition(":")
    return getattr(importlib.import_module(module), attribute)


@dataclass(frozen=True)
class ModelSpec:
    """One model family. The string fields are "module:attribute" references to torch code:

    - `model`: the nn.Module class, built as `cls(model_args)`;
    - `tp_plan`: `plan(block, styles) -> {submodule FQN: ParallelStyle}`, a block's tensor-parallel
      plan (the family's `tp_plan.py`), building each module's styles from the classes `styles(module)`
      gives, torch's or torchao's float8 ones (the root's embeddings, final norm and output are shared,
      torchtitan/parallelisms/parallelize.py);
    - `hf_adapter`: a module with `MODEL_TYPE` (config.json's "model_type"), `to_hf(state_dict,
      model_args)`, `from_hf(state_dict, hf_config)` and `hf_config(model_args, state_dict,
      max_position_embeddings, dtype)` (config.json less "architectures", `hf_architecture`), between
      our parameter names and layout and the Hugging Face model's, `hf_tensors(config, mtp_layers)`
      (every tensor a folder of that config.json holds, which the reader requires), and optionally
      `skipped(config)`, the folder's tensors it has no place for, and `check_flavor(config,
      model_args, where)`, refusing a folder whose config.json computes otherwise than the flavour
      (torchtitan/models/hf_convert.py)."""

    name: str
    flavors: Mapping[str, ModelArgs]
    model: str
    tp_plan: str
    hf_adapter: str
    hf_architecture: str  # transformers' class name, written to config.json
    # (model arguments, the parameters a token's matmuls use, seq_len) -> training FLOPs per token, for MFU.
    flops_per_token: Callable[[ModelArgs, int, int], int] = dense_flops_per_token
    # Mixture-of-experts feed-forwards (torchtitan/models/moe.py): the loop balances their experts.
    moe: bool = False
    # Hugging Face's model holds the routing bias (`expert_bias`: DeepSeek-V3's e_score_correction_bias),
    # so exports keep it; other families' have no place for it.
    hf_expert_bias: bool = False
    # Multi-token prediction (model.mtp_layers): its model is an MTPTransformer (torchtitan/models/mtp.py)
    # and its arguments have `mtp_layers`.
    mtp: bool = False

    def build(self, model_args: ModelArgs) -> Any:
        """The family's model (an nn.Module) for `model_args`, on the current default device."""
        return load(self.model)(model_args)

    def block_tp_plan(self) -> Callable[..., dict]:
        return load(self.tp_plan)

    def hf(self) -> Any:
        return importlib.import_module(self.hf_adapter)
