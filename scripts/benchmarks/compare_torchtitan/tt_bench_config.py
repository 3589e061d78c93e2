"""torchtitan 0.3.0 config registry for the side-by-side throughput run.

Used as `--module tt_bench_config --config llama3_1b_bench` (torchtitan's ConfigManager imports a
fully-qualified module and calls the named function, which returns a Trainer.Config).

The model is Llama 3.2 1B's shape with UNTIED embeddings at Llama 3's vocabulary (128256 rows),
matching our recipe train_configs/llama3_1b.toml (dim 2048, 16 layers, 32 heads, 8 kv heads,
FFN 8192 = 1.5x multiplier rounded to 256, rope theta 500000, no RoPE scaling).
torchtitan's own "1B" flavor ties the embeddings (and uses Llama 3.1 RoPE scaling), so it is
rebuilt here from torchtitan's own building blocks.

Knobs (environment variables, read when the config function runs):
  TT_ATTN      sdpa (default: F.scaled_dot_product_attention(is_causal=True), cuDNN > flash
               priority, as our trainer's SDPA causal attention) | flex (torchtitan 0.3.0's
               default for llama3: FlexAttention with a block-causal BlockMask, compiled with
               max_autotune + coordinate descent -- long first compile).
  TT_STEPS     training steps (default 20)
  TT_DATA      jsonl file with {"text": ...} lines (default assets/corpus/kjv/train.jsonl)
  TT_TOKENIZER HF tokenizer folder with tokenizer.json (default assets/tokenizer/kjv_bpe_hf)
  TT_TINY=1    CPU smoke-test shape (2 layers, dim 256, 4 heads, 2 kv heads, seq 256, batch 2)
"""

import json
import os
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.components.validate import Validator
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.models.common import (
    ComplexRoPE,
    Embedding,
    Linear,
    RMSNorm,
    compute_ffn_hidden_dim,
)
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.common.config_utils import get_attention_config
from torchtitan.models.llama3 import _build_llama3_layers
from torchtitan.models.llama3.model import Llama3Model
from torchtitan.tools.logging import logger
from torchtitan.tools.profiler import Profiler
from torchtitan.trainer import Trainer

VOCAB_SIZE = 128256

# Same initialisers as torchtitan's llama3 flavors (torchtitan/models/llama3/__init__.py).
_NORM_INIT = {"weight": nn.init.ones_}
_EMBEDDING_INIT = {"weight": partial(nn.init.normal_, std=1.0)}


def _output_linear_init(dim: int):
    s = dim**-0.5
    return {
        "weight": partial(nn.init.trunc_normal_, std=s, a=-3 * s, b=3 * s),
        "bias": nn.init.zeros_,
    }


def _model(
    *,
    dim: int,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int,
    vocab_size: int,
    attn: str,
    ffn_dim_multiplier: float | None,
    multiple_of: int,
) -> Llama3Model.Config:
    layers = _build_llama3_layers(
        fuse_qkv=True,  # torchtitan's default for every llama3 flavor (one wqkv GEMM)
        n_layers=n_layers,
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        hidden_dim=compute_ffn_hidden_dim(
            dim, multiple_of=multiple_of, ffn_dim_multiplier=ffn_dim_multiplier
        ),
        rope=ComplexRoPE.Config(
            dim=dim // n_heads,
            max_seq_len=131072,  # update_from_config shrinks it to training.seq_len
            theta=500000,
            scaling="none",  # our 1B has no Llama 3.1 RoPE scaling
        ),
        attn_backend="flex",
    )
    if attn == "sdpa":
        # torchtitan 0.3.0's get_attention_config() refuses "sdpa" for language models only
        # because it cannot apply per-document masks; the trainer supports a maskless inner
        # attention (no masks built, positions still feed RoPE; SDPA runs is_causal=True).
        for layer in layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    elif attn != "flex":
        layers_inner = get_attention_config(attn)  # flex_flash / varlen: torchtitan's own
        for layer in layers:
            layer.attention.inner_attention = layers_inner
    return Llama3Model.Config(
        dim=dim,
        vocab_size=vocab_size,
        enable_weight_tying=False,
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab_size, embedding_dim=dim, param_init=_EMBEDDING_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab_size, param_init=_output_linear_init(dim)),
        layers=layers,
    )


# ----------------------------------------------------------------------------------------------
# Data: a local jsonl corpus, tokenized once, packed into one token stream (no HF `datasets`).
# Every sample is seq_len consecutive tokens: plain causal attention over the packed window, as in
# our trainer. With SDPA no "positions" are emitted (RoPE then uses positions 0..seq_len-1 by
# slicing its cache, and no mask is built); flex/varlen need positions to build their masks, so
# 0..seq_len-1 is emitted (no per-document reset: the block-causal mask is then plain causal).
# ----------------------------------------------------------------------------------------------


class PackedJsonlDataset(IterableDataset, Stateful):
    def __init__(self, path: str, tokenizer: BaseTokenizer, seq_len: int, emit_positions: bool):
        self.path = path
        self.emit_positions = emit_positions
        self.seq_len = seq_len
        ids: list[int] = []
        n_docs = 0
        with open(path) as f:
            for line in map(str.strip, f):
                if not line:
                    continue
                text = json.loads(line)["text"]
                ids.extend(tokenizer.encode(text, add_bos=True, add_eos=True))
                n_docs += 1
        self.tokens = torch.tensor(ids, dtype=torch.long)
        if self.tokens.numel() < seq_len + 1:
            raise ValueError(f"{path}: {self.tokens.numel()} tokens < seq_len + 1")
        self.max_id = int(self.tokens.max())
        self._pos = 0
        logger.info(
            f"PackedJsonlDataset: {n_docs} documents, {self.tokens.numel():,} tokens, "
            f"max token id {self.max_id} from {path}"
        )

    def __iter__(self):
        L = self.seq_len
        positions = torch.arange(L, dtype=torch.long)
        while True:
            if self._pos + L + 1 > self.tokens.numel():
                self._pos = 0  # loop the corpus
            chunk = self.tokens[self._pos : self._pos + L + 1]
            self._pos += L
            inputs = {"input": chunk[:-1].clone()}
            if self.emit_positions:
                inputs["positions"] = positions.clone()
            yield inputs, chunk[1:].clone()

    def state_dict(self):
        return {"pos": self._pos}

    def load_state_dict(self, state_dict):
        self._pos = state_dict["pos"]


class PackedJsonlDataLoader(ParallelAwareDataloader):
    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        emit_positions: bool = True
        """Emit per-token positions (needed by the flex/varlen masks; not by SDPA)."""

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        tokenizer: BaseTokenizer,
        seq_len: int,
        local_batch_size: int,
        snapshot_every_n_steps: int | None = 1,
        **kwargs,
    ):
        assert config.dataset_path, "dataloader.dataset_path (a jsonl file) is required"
        ds = PackedJsonlDataset(config.dataset_path, tokenizer, seq_len, config.emit_positions)
        super().__init__(
            ds,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            batch_size=local_batch_size,
            num_workers=config.num_workers,
            pin_memory=config.pin_memory,
            snapshot_every_n_steps=snapshot_every_n_steps,
        )


def _loss(vocab_size: int):
    """TT_LOSS=ce (default): plain CrossEntropyLoss on the full logits (lm_head inside the model
    forward; torchtitan's llama3_debugmodel_ce_loss recipe). TT_LOSS=chunked: torchtitan's llama3
    default ChunkedLossWrapper (8 sequence chunks, lm_head applied per chunk inside the loss)."""
    ce = CrossEntropyLoss.Config(global_vocab_size=vocab_size)
    if os.environ.get("TT_LOSS", "ce") == "chunked":
        return ChunkedLossWrapper.Config(loss_fn=ce)
    return ce


def _config(
    *, model: Llama3Model.Config, seq_len: int, batch: int, steps: int, compile_enable: bool, attn: str
) -> Trainer.Config:
    from torchtitan.models.llama3 import parallelize_llama, pipeline_llm
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
    from torchtitan.protocols.model_spec import ModelSpec

    flavor = "1B-untied-v128256" if model.dim == 2048 else "tiny-cpu"
    model_spec = ModelSpec(
        name="llama3",
        flavor=flavor,
        model=model,
        parallelize_fn=parallelize_llama,
        pipelining_fn=pipeline_llm,
        post_optimizer_build_fn=None,
        state_dict_adapter=Llama3StateDictAdapter,
    )
    return Trainer.Config(
        # torchtitan's llama3 default loss: 8 sequence chunks, lm_head applied per chunk inside
        # the loss, the per-chunk cross entropy compiled when "loss" is in compile.components.
        loss=_loss(model.vocab_size),
        hf_assets_path=os.environ.get("TT_TOKENIZER", "assets/tokenizer/kjv_bpe_hf"),
        dump_folder=os.environ.get("TT_DUMP", "./outputs/torchtitan_side_by_side"),
        model_spec=model_spec,
        optimizer=default_adamw(lr=3e-4),  # AdamW, implementation="fused" by default
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2, decay_type="cosine", min_lr_factor=0.1),
        training=TrainingConfig(
            local_batch_size=batch,
            global_batch_size=-1,  # = local batch x dp(1): one optimizer step per batch
            seq_len=seq_len,
            steps=steps,
            max_norm=1.0,
            dtype="float32",  # fp32 master weights / grads / optimizer states
            mixed_precision_param="bfloat16",  # bf16 compute via FSDP2's MixedPrecisionPolicy
            mixed_precision_reduce="float32",
            disable_cuda_graphs=os.environ.get("TT_CUDA_GRAPHS", "0") != "1",
        ),
        dataloader=PackedJsonlDataLoader.Config(
            dataset="packed_jsonl",
            dataset_path=os.environ.get("TT_DATA", "assets/corpus/kjv/train.jsonl"),
            emit_positions=attn != "sdpa",
        ),
        metrics=MetricsProcessor.Config(
            log_freq=int(os.environ.get("TT_LOG_FREQ", "1")), disable_color_printing=True
        ),
        parallelism=ParallelismConfig(),  # dp_shard=-1 -> 1 on one GPU
        checkpoint=CheckpointManager.Config(enable=False),
        activation_checkpoint=None,  # mode none
        compile=CompileConfig(enable=compile_enable, components=["model", "loss"]),
        validator=Validator.Config(enable=False),
        profiler=Profiler.Config(enable_profiling=False),
    )


def llama3_1b_bench() -> Trainer.Config:
    tiny = os.environ.get("TT_TINY", "0") == "1"
    attn = os.environ.get("TT_ATTN", "sdpa")
    steps = int(os.environ.get("TT_STEPS", "20"))
    if tiny:
        # CPU bf16 matmuls are emulated (~1 GFLOP/s here): a 128256-row lm_head would take minutes
        # per step, so the smoke test uses TT_VOCAB (default 4096 >= the tokenizer's 2003).
        model = _model(
            dim=256,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            vocab_size=int(os.environ.get("TT_VOCAB", "4096")),
            attn=attn,
            ffn_dim_multiplier=1.5,
            multiple_of=256,
        )
        return _config(
            model=model,
            seq_len=256,
            batch=2,
            steps=steps,
            compile_enable=os.environ.get("TT_COMPILE", "0") == "1",
            attn=attn,
        )
    model = _model(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=VOCAB_SIZE,
        attn=attn,
        ffn_dim_multiplier=1.5,
        multiple_of=256,
    )
    return _config(
        model=model,
        seq_len=2048,
        batch=4,
        steps=steps,
        compile_enable=os.environ.get("TT_COMPILE", "1") == "1",
        attn=attn,
    )
