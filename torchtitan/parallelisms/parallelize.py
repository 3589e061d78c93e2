"""Apply the job's parallelism to a model built on the meta device (any family: torchtitan/models/spec.py).

Each technique is a plain function; `parallelize` composes them in the order PyTorch needs:
tensor parallelism first (it turns parameters into DTensors on the tp mesh), expert and context
parallelism (module swaps), then activation checkpointing and compilation per block, then data
parallelism (FSDP/HSDP over dp_shard x cp, or DDP), which shards the DTensors further.
With pipeline parallelism it is applied to each stage's model.
"""

import contextlib
import functools
from collections import defaultdict
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.checkpoint import SAC_IGNORED_OPS, CheckpointPolicy, create_selective_checkpoint_contexts

from torchtitan.config.options import JobConfig, TrainingConfig
from torchtitan.models import model_spec
from torchtitan.models.decoder import RMSNorm
from torchtitan.models.moe import MoE
from torchtitan.parallelisms.context_parallel import apply_cp
from torchtitan.parallelisms.distributed import device_type
from torchtitan.parallelisms.expert_parallel import apply_ep
from torchtitan.parallelisms.float8 import float8_tensorwise_tp, tp_styles
from torchtitan.parallelisms.parallel_dims import ParallelDims
from torchtitan.parallelisms.vocab_parallel import vocab_parallel

# torch's dtypes by the names the options take (training.mixed_precision_*, checkpoint.export_dtype).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def autocast_context(
    training_config: TrainingConfig, device: torch.device
) -> contextlib.AbstractContextManager:
    """The matmuls in `mixed_precision_param`, everything else in fp32, on every layout: under FSDP/DDP
    the blocks' weights arrive in that dtype already (mixed_precision_policies)."""
    param_dtype = DTYPES[training_config.mixed_precision_param]
    if param_dtype != torch.float32:
        return torch.autocast(device.type, dtype=param_dtype)
    return contextlib.nullcontext()


def loss_skips_output(training_config: TrainingConfig) -> bool:
    """With a chunked loss (training.loss_chunk_tokens) the model stops at its final norm (`skip_output`)
    and the loss projects the hidden states by the output weight itself, a chunk at a time
    (objective/chunked_cross_entropy.py): FSDP then keeps the root's parameters, that weight among
    them, after the forward."""
    return training_config.loss_chunk_tokens > 0


def parallelize(
    model: nn.Module, world_mesh: DeviceMesh | None, parallel_dims: ParallelDims, job_config: JobConfig
) -> nn.Module:
    """`model` (a whole model or a pipeline stage, any family) with the job's parallelisms applied, in
    the order above; still on the meta device."""
    par, spec = job_config.parallelism, model_spec(job_config.model)
    if parallel_dims.tp_enabled:
        apply_tp(
            model,
            world_mesh["tp"],
            spec.block_tp_plan(),
            parallel_dims.loss_parallel_enabled,
            par.enable_async_tensor_parallel,
            float8_tensorwise=float8_tensorwise_tp(job_config),
        )
    if parallel_dims.ep_enabled:
        apply_ep(model, world_mesh["ep"])
    if parallel_dims.cp_enabled:
        apply_cp(model, world_mesh["cp"])
    ac = job_config.activation_checkpoint
    if ac.mode != "none":
        apply_ac(model, ac.mode, ac.selective_ac_option)
    wrapped = parallel_dims.fsdp_enabled or parallel_dims.dp_replicate_enabled
    mp_policy, fp32_policy = mixed_precision_policies(job_config)
    fp32_policy = fp32_policy if wrapped and mp_policy.param_dtype != torch.float32 else None
    # Blocks gathered in bf16 hold their norms as fp32 units of their own, whose FSDP hooks dynamo
    # cannot trace inside a compiled block. DDP gathers nothing: its blocks stay whole in fp32.
    norm_units = (
        fp32_policy is not None and parallel_dims.fsdp_enabled and par.fsdp_gather_dtype == "bfloat16"
    )
    if job_config.training.compile:
        # block_causal's CPU attention reads the documents' bounds on the host (models/documents.py).
        segments_on_host = job_config.model.attn_mask_type == "block_causal" and device_type() == "cpu"
        fullgraph = not norm_units and not parallel_dims.ep_enabled and not segments_on_host
        apply_compile(model, job_config.training.compile_backend, fullgraph=fullgraph)

    if parallel_dims.fsdp_enabled:
        if par.fsdp_reshard_after_forward == "default":
            # With PP each micro-batch would gather the stage's parameters again.
            reshard = False if parallel_dims.pp_enabled else "all_but_last"
        else:
            reshard = par.fsdp_reshard_after_forward == "always"
        apply_fsdp(
            model,
            fsdp_mesh(world_mesh, parallel_dims),
            mp_policy,
            fp32_policy,
            norm_units=norm_units,
            reshard_after_forward=reshard,
            forward_prefetch=par.fsdp_forward_prefetch,
            backward_prefetch=par.fsdp_backward_prefetch,
            keep_root_after_forward=loss_skips_output(job_config.training),
            moe_meshes=parallel_dims.moe_fsdp_meshes(world_mesh) if spec.moe else (None, None),
        )
    elif parallel_dims.dp_replicate_enabled:
        apply_ddp(model, world_mesh["dp_replicate"], mp_policy, fp32_policy)
    return model


def mixed_precision_policies(job_config: JobConfig) -> tuple[MixedPrecisionPolicy, MixedPrecisionPolicy]:
    """FSDP's and DDP's part of the one mixed-precision semantics of every layout (docs/numerics.md):
    (the matmul weights' policy, the fp32 one of the norms' and embeddings' units: fp32_units).

    Autocast runs the matmuls in `mixed_precision_param` on every layout (autocast_context)
    and keeps everything else in fp32. FSDP gathers the matmul weights in that dtype, which rounds them
    as autocast would before a matmul, at half the traffic, and the norms' weights and the embeddings
    in fp32, as autocast leaves them (or, with fsdp_gather_dtype float32, gathers the blocks whole in
    fp32 for autocast to round); no unit casts its inputs, so the residual stream stays fp32.
    Casting those too (FSDP's default) gave 3.4x one process's bf16 error: a norm weight near 1 moves
    by less than bf16's step there, and the residual stream is rounded at every block."""
    reduce_dtype = DTYPES[job_config.training.mixed_precision_reduce]
    blocks = MixedPrecisionPolicy(
        param_dtype=DTYPES[job_config.training.mixed_precision_param],
        reduce_dtype=reduce_dtype,
        cast_forward_inputs=False,
    )
    return blocks, MixedPrecisionPolicy(reduce_dtype=reduce_dtype, cast_forward_inputs=False)


def fsdp_mesh(world_mesh: DeviceMesh, parallel_dims: ParallelDims) -> DeviceMesh:
    """The mesh FSDP shards blocks over (dp_shard x cp): a 2-D (replicate, shard) one makes fully_shard do
    HSDP."""
    shard = parallel_dims.fsdp_dim()
    return world_mesh[("dp_replicate", shard) if parallel_dims.dp_replicate_enabled else (shard,)]


def apply_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    block_plan: Callable[..., dict],
    loss_parallel: bool,
    async_tp: bool,
    float8_tensorwise: bool = False,
) -> None:
    """Megatron-style tensor parallelism with sequence parallelism.

    Between blocks the residual stream is split along the sequence (Shard(1)): norms run on their
    slice, and each attention/feed-forward all-gathers it, runs column-wise then row-wise sharded
    projections (each rank holds a subset of heads / hidden units) and reduce-scatters back. With
    loss parallel the logits stay sharded along the vocabulary for the loss. With
    `float8_tensorwise` (Float8Linears of the tensorwise recipe) the attention and feed-forward whose
    linear layers are all Float8Linears take torchao's float8 styles, which all-gather their input in
    float8; the root's styles stay plain (its output layer is kept out of float8 by default).
    `block_plan(block, styles)` is the family's plan of a block (its ModelSpec's `tp_plan`), taking
    each module's style classes from `styles(module)`; a tied output layer keeps the embeddings'
    weight (both are sharded along the vocabulary)."""
    if model.tok_embeddings is not None:  # its rows split along the vocabulary, output Shard(1)
        model.tok_embeddings = vocab_parallel(model.tok_embeddings, tp_mesh)
    # The norms before the output layer (the final one, multi-token prediction's depths') on sequence
    # shards; a pipeline stage may lack them, the embeddings or the output.
    root_plan = {name: SequenceParallel() for name in model.head_norms()}
    if model.output is not None:
        root_plan["output"] = ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    parallelize_module(model, tp_mesh, root_plan)
    if model.model_args.tie_word_embeddings and model.tok_embeddings is not None and model.output is not None:
        model.output.weight = model.tok_embeddings.weight  # both Shard(0): one DTensor
    styles = functools.partial(tp_styles, float8_tensorwise=float8_tensorwise)
    for parent, name, _ in model.blocks():
        block = parent.get_submodule(name)
        parallelize_module(block, tp_mesh, block_plan(block, styles))
    # Modules outside the blocks that act on each token alone run on this rank's tokens, as the
    # final norm does (multi-token prediction's input norms and projection).
    local = SequenceParallel(use_local_output=True)
    parallelize_module(model, tp_mesh, {name: local for name in model.token_wise_modules()})
    if async_tp:
        from torch._inductor import config as inductor_config
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group

        # Inductor's micro-pipeline pass splits the matmuls next to TP's collectives into chunks
        # that overlap with them, through symmetric memory on the tp group.
        inductor_config._micro_pipeline_tp = True
        enable_symm_mem_for_group(tp_mesh.get_group().group_name)


# Ops whose outputs selective op AC keeps: the expensive ones to recompute. Every other matmul's
# output is still recomputed, to halve the memory they take.
_SAVE_LIST = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    # Expert parallelism's token exchange: recomputing it would repeat the all-to-all.
    torch.ops._c10d_functional.all_to_all_single.default,
    # Context parallelism's keys and values.
    torch.ops._c10d_functional.all_gather_into_tensor.default,
}


# FSDP marks its hooks' work with record_function. A unit nested in a checkpointed block (the experts
# under EP) runs them there, a different number of times in the recompute than in the forward (its
# parameters are gathered again); they compute nothing, so selective checkpointing may skip them as it
# skips `detach`.
SAC_IGNORED_OPS.update(
    {
        torch.ops.profiler._record_function_enter_new.default,
        torch.ops.profiler._record_function_exit._RecordFunction,
    }
)


def _op_policy() -> Callable:
    mm_count: defaultdict[str, int] = defaultdict(int)

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        # The forward and its recomputation count separately, so both see the same decisions.
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == torch.ops.aten.mm.default:
            mm_count[mode] += 1
        if func in _SAVE_LIST and not (func == torch.ops.aten.mm.default and mm_count[mode] % 2 == 0):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _op_context():
    return create_selective_checkpoint_contexts(_op_policy())


def apply_ac(model: nn.Module, mode: str, selective_ac_option: str) -> None:
    """Activation checkpointing per transformer block: `full` recomputes whole blocks in backward;
    `selective` with "op" saves only the outputs of `_SAVE_LIST` ops, with an integer N checkpoints
    every N-th block (by layer id, so a pipeline split does not change which ones).

    The wrapper adds `_checkpoint_wrapped_module.` to FQNs; init and DCP state dicts drop it. Multi-token
    prediction's blocks count as layers n_layers + k - 1."""
    for parent, name, layer_id in model.blocks():
        block = parent.get_submodule(name)
        if mode == "selective" and selective_ac_option == "op":
            wrapped = checkpoint_wrapper(block, context_fn=_op_context, preserve_rng_state=False)
        elif mode == "full" or (int(layer_id) + 1) % int(selective_ac_option) == 0:
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        else:
            continue
        parent.register_module(name, wrapped)


def apply_compile(model: nn.Module, backend: str = "inductor", fullgraph: bool = True) -> None:
    """Compile each block separately: blocks are identical, so one graph serves them all, and FSDP's
    hooks stay outside the compiled code. Without `fullgraph` a block may compile in pieces: around
    its norms when they are FSDP units of their own (mixed precision), around expert parallelism's
    all-to-all, whose split sizes the host must know.

    A mixture-of-experts layer counts its tokens in forward (a buffer update): activation
    checkpointing's recompute must not count them again, as in eager (moe._training_forward)."""
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    for parent, name, _ in model.blocks():
        parent.register_module(
            name, torch.compile(parent.get_submodule(name), backend=backend, fullgraph=fullgraph)
        )


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    fp32_policy: MixedPrecisionPolicy | None,
    reshard_after_forward: bool | str,
    norm_units: bool = True,
    forward_prefetch: int = 0,
    backward_prefetch: int = 0,
    keep_root_after_forward: bool = False,
    moe_meshes: tuple[DeviceMesh | None, DeviceMesh | None] = (None, None),
) -> None:
    """FSDP2: shard each of the model's sharding_units (its blocks), then the root (embeddings, final norm,
    output).

    With `fp32_policy` (mixed precision: mixed_precision_policies) the fp32_units are units of their
    own with that policy, and the rest takes `mp_policy`; without `norm_units` (fsdp_gather_dtype
    float32) the blocks are gathered whole with `fp32_policy`, their norms inside. The embeddings are
    resharded after forward like a block (FSDP gathers them again for backward, which needs only their
    gradient): kept, their fp32 table would hold 2 GiB more on Llama 3 8B.

    `moe_meshes` (parallel_dims.moe_fsdp_meshes): a mixture-of-experts layer's own unit and its
    experts' under EP, sharded first over their meshes when those are not the block's. The gradients
    of such a unit arrive summed over the ranks that share its tokens (EP's all-to-all, TP's sequence
    shards), so FSDP divides them by the data-parallel degree rather than by its mesh's size: the
    mean over every rank's batch, as for the other weights.

    `reshard_after_forward="all_but_last"` keeps the last block gathered: backward starts with it,
    so gathering it again right away would be wasted communication (FSDP never reshards the root
    after forward by default, for the same reason; `keep_root_after_forward` makes that hold for any
    setting). A prefetch count N makes each block all-gather the next N blocks' parameters (the
    previous N in backward) instead of FSDP's implicit one. Multi-token prediction's depths are units
    after the blocks, each a depth whole (its norms and projection with its block)."""
    blocks = model.sharding_units()
    block_policy = mp_policy if norm_units or fp32_policy is None else fp32_policy
    layer_mesh, expert_mesh = moe_meshes
    for i, block in enumerate(blocks):
        reshard = i < len(blocks) - 1 if reshard_after_forward == "all_but_last" else reshard_after_forward
        for moe in (m for m in block.modules() if isinstance(m, MoE)):
            for module, mesh in ((moe.experts, expert_mesh), (moe, layer_mesh)):
                if mesh is None:
                    continue
                fully_shard(module, mesh=mesh, mp_policy=block_policy, reshard_after_forward=reshard)
                module.set_gradient_divide_factor(float(dp_mesh.size()))
                # Reduce-scatter a sum, then divide (gloo has no pre-multiplied sum). Not over one
                # rank, where torch 2.13 would then divide twice.
                module.set_force_sum_reduction_for_comms(mesh.size(mesh.ndim - 1) > 1)
        for unit in fp32_units(block) if fp32_policy and norm_units else []:
            fully_shard(unit, mesh=dp_mesh, mp_policy=fp32_policy, reshard_after_forward=reshard)
        fully_shard(block, mesh=dp_mesh, mp_policy=block_policy, reshard_after_forward=reshard)
    reshard = True if reshard_after_forward == "all_but_last" else reshard_after_forward
    for unit in fp32_units(model, blocks) if fp32_policy else []:
        fully_shard(unit, mesh=dp_mesh, mp_policy=fp32_policy, reshard_after_forward=reshard)
    root_reshard = None if reshard_after_forward == "all_but_last" else reshard_after_forward
    root_reshard = False if keep_root_after_forward else root_reshard
    root_policy = root_mp_policy(model, mp_policy, fp32_policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=root_policy, reshard_after_forward=root_reshard)
    if forward_prefetch:
        model.set_modules_to_forward_prefetch(blocks[:forward_prefetch])
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 1 + forward_prefetch])
    if backward_prefetch:
        model.set_modules_to_backward_prefetch(blocks[::-1][:backward_prefetch])
        for i, block in enumerate(blocks):
            block.set_modules_to_backward_prefetch(blocks[max(0, i - backward_prefetch) : i][::-1])


def apply_ddp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    fp32_policy: MixedPrecisionPolicy | None,
) -> None:
    """Plain data parallelism (replicas only), on FSDP2's machinery: per-block gradient all-reduce
    buckets, and the same mixed precision and accumulation controls as FSDP. Replicas gather nothing,
    so the blocks keep their fp32 weights whole (one unit, one compiled graph each) and autocast rounds
    the matmul weights, as on one process; the root's units are FSDP's. Multi-token prediction's depths
    are units like the blocks."""
    blocks = model.sharding_units()
    for block in blocks:
        replicate(block, mesh=dp_mesh, mp_policy=fp32_policy or mp_policy)
    for unit in fp32_units(model, blocks) if fp32_policy else []:
        replicate(unit, mesh=dp_mesh, mp_policy=fp32_policy)
    replicate(model, mesh=dp_mesh, mp_policy=root_mp_policy(model, mp_policy, fp32_policy))


def fp32_units(module: nn.Module, inner_units: list[nn.Module] | None = None) -> list[nn.Module]:
    """The modules of `module`, outside `inner_units` (units of their own: the model's
    sharding_units), whose weights mixed precision keeps in fp32: the norms, and the embeddings
    unless they are tied to the output layer (the root then keeps the table in fp32)."""
    inside = {id(m) for unit in inner_units or [] for m in unit.modules()}
    units = [m for m in module.modules() if isinstance(m, RMSNorm) and id(m) not in inside]
    embeddings = getattr(module, "tok_embeddings", None)
    if embeddings is not None and not module.model_args.tie_word_embeddings:
        units.append(embeddings)
    return units


def root_mp_policy(
    model: nn.Module, mp_policy: MixedPrecisionPolicy, fp32_policy: MixedPrecisionPolicy | None
) -> MixedPrecisionPolicy:
    """The root's policy (embeddings, final norm, output): fp32 when it holds an embedding table tied to
    the output layer (fp32_units leaves it there), else the matmul weights' one."""
    return fp32_policy if fp32_policy and model.model_args.tie_word_embeddings else mp_policy


def set_grad_all_reduce(model: nn.Module, enabled: bool) -> None:
    """Whether the coming backward all-reduces gradients across replicas (HSDP/DDP).

    With gradient accumulation only the last micro-batch needs to: earlier ones reduce-scatter
    within each replica (keeping gradients sharded) and the partial sums are all-reduced once.
    Pure FSDP still reduce-scatters every micro-batch: skipping that would keep unsharded gradients."""
    if isinstance(model, FSDPModule):
        model.set_requires_all_reduce(enabled)
