"""torchtitan 0.3.0 config registry module for DeepSeek-V3 at the 671B flavour's width, 2 layers (1 dense,
1 MoE), side by side with our trainer (benchmark_gpu.py's deepseek_v3_671b_width part):

    run.sh OUT with TT_MODEL=dsv3  ->  tt_bench.py --module tt_dsv3_config --config deepseek_v3_width_bench

torchtitan's registered "671B" flavour is 61 layers and 256 experts (`_671b` in
torchtitan/models/deepseek_v3/__init__.py takes no layer or expert count), so the model is rebuilt with
the same builder it uses (`_build_dsv3_layers`) and its 671B values: dim 7168, 128 heads, q LoRA 1536,
kv latent 512, qk 128 + 64, v 128, dense SwiGLU 18432, experts of 2048 with 1 shared, top 8 of 8
groups (4 kept), sigmoid scores, route_norm, route scale 2.5, YaRN 40 on 4096, vocab 129280, the
load-balancing bias at 1e-3 (make_moe_config's default, = our moe.bias_update_rate 0.001), no
auxiliary loss; n_layers 2, 1 dense, TT_EXPERTS experts (benchmark_gpu.py passes ours: 32 on an H200,
16 on an H100). Differences left, as in NOTES.md for the 1B: bf16 through FSDP2's mixed precision (not
autocast), SDPA with torchtitan's cuDNN-first priority (its 671B recipe uses FlexAttention; ours runs
causal SDPA), the full-logits cross entropy (TT_LOSS=ce, as our run: loss_chunk_tokens 0; torchtitan's
671B recipe chunks), blocks and loss compiled (torchtitan's 671B recipe compiles the loss only), no
activation checkpointing (its recipe: selective), 1 x 4096 tokens a step, fused AdamW lr 2.2e-4.
TT_TINY=1: dim 256, 4 heads, 8 experts (4 groups, 2 kept, top 2), seq 256, vocab 4096, for the CPU.
"""

import os

from tt_bench_config import _config, _loss

from torchtitan.components.optimizer import default_adamw, register_moe_load_balancing_hook
from torchtitan.distributed.pipeline_parallel import pipeline_llm
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.deepseek_v3 import (
    _EMBEDDING_INIT,
    _NORM_INIT,
    _build_dsv3_layers,
    _output_linear_init,
    parallelize_deepseekv3,
)
from torchtitan.models.deepseek_v3.model import DeepSeekV3Model
from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.trainer import Trainer


def _model(tiny: bool, experts: int) -> DeepSeekV3Model.Config:
    vocab = int(os.environ.get("TT_VOCAB", "4096")) if tiny else 129280
    dim = 256 if tiny else 7168
    shape = dict(
        n_layers=2,
        n_dense_layers=1,
        dim=dim,
        n_heads=4 if tiny else 128,
        q_lora_rank=64 if tiny else 1536,
        kv_lora_rank=32 if tiny else 512,
        qk_nope_head_dim=32 if tiny else 128,
        qk_rope_head_dim=16 if tiny else 64,
        v_head_dim=32 if tiny else 128,
        mscale=1.0,
        dense_hidden_dim=512 if tiny else 18432,
        moe_hidden_dim=128 if tiny else 2048,
        num_experts=8 if tiny else experts,
        num_shared_experts=1,
        router_top_k=2 if tiny else 8,
        router_score_func="sigmoid",
        router_num_expert_groups=4 if tiny else 8,
        router_num_limited_groups=2 if tiny else 4,
        router_route_scale=2.5,
        router_route_norm=True,
    )
    layers = _build_dsv3_layers(
        **shape,
        attn_backend="flex",  # replaced below: get_attention_config refuses "sdpa" for language models
        moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(
            dim=shape["qk_rope_head_dim"],
            max_seq_len=4096 * 4,
            theta=10000.0,
            scaling="yarn",
            rope_factor=40.0,
            beta_fast=32.0,
            beta_slow=1.0,
            original_seq_len=4096,
        ),
    )
    for layer in layers:  # maskless causal SDPA, as tt_bench_config's llama (no positions fed)
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return DeepSeekV3Model.Config(
        vocab_size=vocab,
        dim=dim,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_output_linear_init(dim)),
        layers=layers,
        mtp_layers=[],
    )


def deepseek_v3_width_bench() -> Trainer.Config:
    tiny = os.environ.get("TT_TINY", "0") == "1"
    model = _model(tiny, int(os.environ.get("TT_EXPERTS", "32")))
    config = _config(
        model=model,  # _config builds a llama3 ModelSpec around it: replaced below
        seq_len=256 if tiny else 4096,
        batch=2 if tiny else 1,
        steps=int(os.environ.get("TT_STEPS", "20")),
        compile_enable=os.environ.get("TT_COMPILE", "0" if tiny else "1") == "1",
        attn="sdpa",
    )
    config.model_spec = ModelSpec(
        name="deepseek_v3",
        flavor="671B-width-2layers" if not tiny else "tiny-cpu",
        model=model,
        parallelize_fn=parallelize_deepseekv3,
        pipelining_fn=pipeline_llm,
        post_optimizer_build_fn=register_moe_load_balancing_hook,
        state_dict_adapter=DeepSeekV3StateDictAdapter,
    )
    config.loss = _loss(model.vocab_size)
    config.optimizer = default_adamw(lr=2.2e-4)
    return config
