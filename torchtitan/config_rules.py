"""Every rule that ties options together, stated once: the parallel layout against the world size and
the model, the pipeline split, the batch arithmetic, the learning-rate schedule, what needs CUDA, float8.

Torch-free: the preflight (torchtitan/reliability/preflight.py) runs these checks before any worker
starts, and train.py and the scripts run them again with what only a worker knows (the device). Each
raises a ConfigError naming the first bad option and the fix."""

import math
import os

from torchtitan.config.options import (
    ConfigError,
    JobConfig,
    LRSchedulerConfig,
    OptimizerConfig,
    TrainingConfig,
)
from torchtitan.config.paths import resolve_path
from torchtitan.errors import torchao_missing
from torchtitan.models import MODEL_SPECS, flavor_args, model_spec
from torchtitan.models.spec import ModelArgs
from torchtitan.parallelisms.parallel_dims import ParallelDims
from torchtitan.parallelisms.pipeline_layout import (
    SPLIT_BACKWARD_SCHEDULES,
    V_SCHEDULES,
    num_microbatches,
    stage_layers,
)


def parallel_dims_of(job_config: JobConfig, world_size: int) -> ParallelDims:
    """The job's parallel degrees, checked against the number of processes."""
    parallelism = job_config.parallelism
    return ParallelDims(
        dp_shard=parallelism.data_parallel_shard_degree,
        world_size=world_size,
        dp_replicate=parallelism.data_parallel_replicate_degree,
        tp=parallelism.tensor_parallel_degree,
        pp=parallelism.pipeline_parallel_degree,
        enable_loss_parallel=parallelism.enable_loss_parallel,
        ep=parallelism.expert_parallel_degree,
        cp=parallelism.context_parallel_degree,
    )


def gradient_accumulation_steps(training_config: TrainingConfig, parallel_dims: ParallelDims) -> int:
    """Micro-batches per optimizer step: training.global_batch_size / (batch_size x DP degree)."""
    per_pass = training_config.batch_size * parallel_dims.dp_degree
    global_batch_size = training_config.global_batch_size
    if global_batch_size == -1:
        return 1
    if global_batch_size < per_pass or global_batch_size % per_pass:
        raise ConfigError(
            f"training.global_batch_size: {global_batch_size} is not a multiple of batch_size x DP "
            f"degree = {training_config.batch_size} x {parallel_dims.dp_degree}; use -1 or a multiple of "
            f"{per_pass}"
        )
    if global_batch_size > per_pass and parallel_dims.pp_enabled:
        raise ConfigError(
            "training.global_batch_size: gradient accumulation is not supported with pipeline parallelism; "
            "raise parallelism.pipeline_parallel_microbatches and training.batch_size instead"
        )
    return global_batch_size // per_pass


def check_parallelism(job_config: JobConfig, parallel_dims: ParallelDims, model_args: ModelArgs) -> None:
    """Tensor parallelism must split the heads (linear attention's key and value heads too) and the
    sequence; the AC option must parse."""
    tp = parallel_dims.tp
    n_kv_heads = model_args.n_kv_heads or model_args.n_heads
    heads = {"attention heads": model_args.n_heads, "kv heads": n_kv_heads}
    if getattr(model_args, "linear_n_value_heads", None) is not None:  # Gated DeltaNet's (Qwen3.5)
        heads |= {"linear-attention key heads": model_args.linear_n_key_heads}
        heads |= {"value heads": model_args.linear_n_value_heads}
    if any(count % tp for count in heads.values()):
        counts = [f"{count} {what}" for what, count in heads.items()]
        raise ConfigError(
            f"parallelism.tensor_parallel_degree: {tp} does not divide the model's {', '.join(counts[:-1])} "
            f"and {counts[-1]}; choose a common divisor"
        )
    seq_len, cp = job_config.training.seq_len, parallel_dims.cp
    if cp > 1 and seq_len % (2 * cp):
        raise ConfigError(
            f"training.seq_len: {seq_len} is not divisible by 2 x context_parallel_degree = {2 * cp} (each "
            "context-parallel rank holds two of 2 x CP equal chunks of every sequence); change one of them"
        )
    if (seq_len // cp) % tp:
        split = f"{seq_len} / context_parallel_degree {cp}" if cp > 1 else str(seq_len)
        raise ConfigError(
            f"training.seq_len: {split} is not divisible by tensor_parallel_degree {tp} (sequence "
            "parallelism splits each rank's tokens); change one of them"
        )
    option = job_config.activation_checkpoint.selective_ac_option
    digits = option.isascii() and option.isdigit() and len(option) <= 9  # no "²", no 4300-digit int()
    if option != "op" and not (digits and int(option) >= 1):
        raise ConfigError(
            f"activation_checkpoint.selective_ac_option: expected 'op' or a positive integer, got {option!r}"
        )


def check_context_parallel(job_config: JobConfig, parallel_dims: ParallelDims, model_args: ModelArgs) -> None:
    """What context parallelism cannot split: Gated DeltaNet's pieces shorter than its conv's halo (the
    previous piece's last kernel - 1 inputs; the shortest piece is a chunk, seq_len / (2 x CP)); latent
    attention (deepseek_v3) with TP, whose sequence-parallel latents would be gathered over tp inside
    wkv_b and over cp before it, in two orders (parallelisms/context_parallel.py's LatentGather)."""
    cp, halo = parallel_dims.cp, getattr(model_args, "linear_conv_kernel", 1) - 1
    if parallel_dims.cp_enabled and job_config.training.seq_len // (2 * cp) < halo:
        raise ConfigError(
            f"parallelism.context_parallel_degree: {cp} cuts training.seq_len {job_config.training.seq_len} "
            f"into chunks of fewer than the {halo} tokens {job_config.model.name}'s linear-attention conv "
            f"reads back; use seq_len >= {2 * cp * halo} or a lower degree"
        )
    latent_attention = getattr(model_args, "kv_lora_rank", None) is not None
    if parallel_dims.cp_enabled and parallel_dims.tp_enabled and latent_attention:
        raise ConfigError(
            f"parallelism.context_parallel_degree: {job_config.model.name}'s latent attention gathers its "
            "latents over the cp ranks, which tensor parallelism's sequence-parallel latents do not compose "
            "with yet; use tensor_parallel_degree 1 with context parallelism (or context_parallel_degree 1)"
        )


def check_mtp(job_config: JobConfig) -> None:
    """Multi-token prediction needs a family that has it (its spec's `mtp`)."""
    model = job_config.model
    if model.mtp_layers and not model_spec(model).mtp:
        families = ", ".join(name for name, spec in MODEL_SPECS.items() if spec.mtp)
        raise ConfigError(
            f"model.mtp_layers: {model.name} has no multi-token prediction; use 0, or a model.name that "
            f"has it ({families})"
        )


def check_tied_pipeline(job_config: JobConfig, model_args: ModelArgs) -> None:
    """A tied embedding table would be both the first stage's and the last's: two copies whose
    gradients nothing sums, so it is refused rather than trained wrong."""
    if model_args.tie_word_embeddings:
        model = job_config.model
        raise ConfigError(
            f"parallelism.pipeline_parallel_degree: {model.name} {model.flavor} ties its embeddings to the "
            "output layer, which the first and last pipeline stages cannot share; use "
            "pipeline_parallel_degree 1 or an untied flavor"
        )


def check_moe(job_config: JobConfig, parallel_dims: ParallelDims, model_args: ModelArgs) -> None:
    """A dense model has no expert parallelism nor [moe] option set (it would be ignored silently).
    Expert parallelism splits a mixture-of-experts model's experts evenly; what such a model cannot run
    with yet: TP without FSDP (its layers' gradients are summed over the tp ranks by FSDP), and its
    auxiliary losses under PP with replicas alone (the stages pass their statistics on through FSDP's
    unit, parallelisms/pipeline.py)."""
    name = job_config.model.name
    if not model_spec(job_config.model).moe:
        if parallel_dims.ep_enabled:
            raise ConfigError(
                f"parallelism.expert_parallel_degree: {name} has no experts to split; use 1 (or a "
                "mixture-of-experts model.name such as qwen3_moe)"
            )
        if moe_options := sorted(key for key in job_config.explicit if key.startswith("moe.")):
            families = ", ".join(family for family, spec in MODEL_SPECS.items() if spec.moe)
            raise ConfigError(
                f"{moe_options[0]}: {name} has no experts, so [moe] options do nothing for it; remove it, "
                f"or use a mixture-of-experts model.name ({families})"
            )
        return
    if model_args.top_k > model_args.num_experts:
        raise ConfigError(
            f"model.flavor: {name} {job_config.model.flavor} routes each token to {model_args.top_k} of "
            f"{model_args.num_experts} experts; top_k must be at most num_experts"
        )
    if model_args.num_experts % parallel_dims.ep:
        raise ConfigError(
            f"parallelism.expert_parallel_degree: {parallel_dims.ep} does not divide the "
            f"{model_args.num_experts} experts of {name} {job_config.model.flavor}; choose a divisor"
        )
    if parallel_dims.tp_enabled and not parallel_dims.fsdp_enabled:
        raise ConfigError(
            f"parallelism.tensor_parallel_degree: {name}'s experts are not tensor-parallel: each tp rank "
            "routes its own tokens and FSDP sums their gradients, so TP needs data_parallel_shard_degree "
            "> 1 or context_parallel_degree > 1 with it; use FSDP (data_parallel_shard_degree -1) or "
            "tensor_parallel_degree 1"
        )
    ddp = parallel_dims.dp_replicate_enabled and not parallel_dims.fsdp_enabled
    moe = job_config.moe
    for option, coef in (
        ("aux_loss_weight", moe.aux_loss_weight),
        ("sequence_aux_loss_weight", moe.sequence_aux_loss_weight),
    ):
        if parallel_dims.pp_enabled and coef and ddp:
            raise ConfigError(
                f"moe.{option}: {name}'s auxiliary loss under pipeline parallelism needs FSDP or no "
                "data parallelism, not replicas alone (DDP); use data_parallel_shard_degree instead of "
                f"data_parallel_replicate_degree, or balance with moe.{option} 0 and "
                "moe.bias_update_rate (e.g. 0.001)"
            )


def check_routing_and_latents(job_config: JobConfig, model_args: ModelArgs) -> None:
    """A flavour's group-limited routing (DeepSeek-V3's n_group, topk_group) must split the experts into
    equal groups of 2 or more (a group scores by its best two), and keep no more groups than there are,
    enough for top_k experts; multi-head latent attention's rope slice must fit its head and have pairs to
    rotate. Torch-free, so the preflight refuses a bad flavour before any worker starts."""
    where = f"model.flavor: {job_config.model.name} {job_config.model.flavor}"
    if hasattr(model_args, "n_group"):  # one group (n_group 1) is no limit, but topk_group must be 1
        n_group, experts, topk_group = model_args.n_group, model_args.num_experts, model_args.topk_group
        if n_group < 1 or experts % n_group or experts // n_group < 2:
            raise ConfigError(
                f"{where} splits {experts} experts into n_group {n_group} groups; n_group must divide the "
                "experts with at least 2 per group (a group scores by its best two)"
            )
        if not 1 <= topk_group <= n_group:
            raise ConfigError(
                f"{where} keeps topk_group {topk_group} of n_group {n_group} expert groups; keep between 1 "
                "and n_group"
            )
        if topk_group * experts // n_group < model_args.top_k:
            raise ConfigError(
                f"{where} routes each token to top_k {model_args.top_k} experts of topk_group {topk_group} "
                f"groups of {experts // n_group}; keep more groups or route to fewer experts"
            )
    rope_dim = getattr(model_args, "qk_rope_head_dim", None)
    if rope_dim is not None and (rope_dim < 2 or rope_dim % 2 or model_args.qk_nope_head_dim < 0):
        raise ConfigError(
            f"{where} has qk_rope_head_dim {rope_dim} and qk_nope_head_dim {model_args.qk_nope_head_dim}; "
            "the rope slice needs an even number of features (2 or more) and the head's other features "
            "none or more"
        )


def check_pipeline(job_config: JobConfig, n_layers: int) -> None:
    """Compiled blocks cannot split their backward; the layers and the batch must split evenly."""
    schedule = job_config.parallelism.pipeline_parallel_schedule
    if job_config.training.compile and schedule in SPLIT_BACKWARD_SCHEDULES:
        raise ConfigError(
            f"parallelism.pipeline_parallel_schedule: {schedule} cannot run compiled blocks; "
            "set training.compile = false or pick GPipe, 1F1B, Interleaved1F1B or LoopedBFS"
        )
    num_microbatches(job_config, len(stage_layers(job_config, n_layers)))


def check_validation(job_config: JobConfig, parallel_dims: ParallelDims) -> None:
    """No count of 0, a validation batch that divides over the DP ranks, and no V schedule evaluating
    (any batch size evaluates under a pipeline: train_step.py runs it in the training batch's shape)."""
    validation = job_config.validation
    for option in ("steps", "batch_size", "global_batch_size"):
        if getattr(validation, option) == 0:
            raise ConfigError(f"validation.{option}: 0 evaluates nothing; use -1 or a positive number")
    schedule = job_config.parallelism.pipeline_parallel_schedule
    if validation.enable and parallel_dims.pp_enabled and schedule in V_SCHEDULES:
        raise ConfigError(
            f"validation.enable: torch's pipeline evaluation (schedule.eval) cannot run {schedule} "
            "(its V-shaped stages expect a backward); pick another schedule or set validation.enable = false"
        )
    validation_batch_size(job_config, parallel_dims.dp_degree)


def validation_batch_size(job_config: JobConfig, dp_degree: int) -> int:
    """Sequences per rank in a validation batch: validation.global_batch_size over the DP ranks, else
    validation.batch_size, else training.batch_size."""
    validation = job_config.validation
    if validation.global_batch_size != -1:
        if validation.batch_size != -1:
            raise ConfigError(
                "validation.global_batch_size: set it or validation.batch_size, not both; set one to -1"
            )
        if validation.global_batch_size % dp_degree:
            raise ConfigError(
                f"validation.global_batch_size: {validation.global_batch_size} is not a multiple of the "
                f"data-parallel degree {dp_degree}; use a multiple, or -1"
            )
        return validation.global_batch_size // dp_degree
    return job_config.training.batch_size if validation.batch_size == -1 else validation.batch_size


def check_chat(job_config: JobConfig, parallel_dims: ParallelDims) -> None:
    """Chat data carries its conversations' bounds as positions, which block_causal attention reads (on
    every layout); a whole validation pass, which chat data does not have yet, is refused."""
    if not job_config.chat.enable:
        return
    if job_config.model.attn_mask_type != "block_causal":
        raise ConfigError(
            "chat.enable: conversations are packed as documents; set model.attn_mask_type = block_causal"
        )
    if job_config.validation.enable:
        check_chat_validation(job_config)


def check_chat_validation(job_config: JobConfig) -> None:
    """Chat data never ends (chat_data.py): its evaluation is a number of global batches (train.py's
    validation, scripts/evaluate.py)."""
    if job_config.chat.enable and job_config.validation.steps == -1:
        raise ConfigError(
            "validation.steps: -1 (a whole pass) is not supported on chat data yet; set the number of "
            "global batches to evaluate (the same ones each time)"
        )


def mixture_sources(training_config: TrainingConfig) -> list[tuple[str, float]]:
    """training.mixture as (source, weight) pairs: 'source:weight' items, the weight 1 when left out.
    Sources are told apart by their real path, so that one folder given twice (through a symlink, with a
    trailing slash) is not read as two; a dataset name (no local path) by its name."""
    if training_config.mixture and training_config.dataset_path is not None:
        raise ConfigError(
            "training.mixture: set either training.mixture or training.dataset_path (a mixture names its "
            "files itself); remove one"
        )
    sources: list[tuple[str, float]] = []
    real_paths: dict[str, str] = {}  # a source's real path (its name when it is none) -> the source
    for item in training_config.mixture:
        source, sep, weight_text = item.rpartition(":")
        if not sep or not source:
            source, weight_text = item, "1"
        try:
            weight = float(weight_text)
        except ValueError:
            raise ConfigError(
                f"training.mixture: {item!r} has weight {weight_text!r}, not a number; write 'source:weight'"
            ) from None
        if not math.isfinite(weight) or weight < 0:
            raise ConfigError(f"training.mixture: {item!r} has weight {weight_text}; weights must be >= 0")
        if source in real_paths.values():
            raise ConfigError(f"training.mixture: {source!r} is listed twice; give each source once")
        local = resolve_path(source)
        real = os.path.realpath(local) if os.path.exists(local) else source
        if real in real_paths:
            raise ConfigError(
                f"training.mixture: {real_paths[real]!r} and {source!r} are the same data ({real}); "
                "give each source once"
            )
        real_paths[real] = source
        sources.append((source, weight))
    if sources and not any(weight > 0 for _, weight in sources):
        raise ConfigError("training.mixture: every weight is 0; give at least one source a positive weight")
    total = sum(weight for _, weight in sources)
    if not math.isfinite(total):
        raise ConfigError(
            f"training.mixture: the weights add up to {total}, more than a float holds; scale them down "
            "(only their ratios matter)"
        )
    return sources


def check_lr_schedule(lr_scheduler_config: LRSchedulerConfig, total_steps: int) -> None:
    decay_ratio = lr_scheduler_config.decay_ratio
    if decay_ratio is None:
        return
    if decay_ratio > 1:
        raise ConfigError(f"lr_scheduler.decay_ratio: must be between 0 and 1, got {decay_ratio}")
    if lr_scheduler_config.warmup_steps + round(total_steps * decay_ratio) > total_steps:
        raise ConfigError(
            "lr_scheduler: warmup_steps + decay_ratio * training.steps exceeds training.steps; "
            "lower warmup_steps or decay_ratio"
        )


def check_optimizer(optimizer_config: OptimizerConfig) -> None:
    if optimizer_config.name == "Muon" and optimizer_config.muon_momentum >= 1:
        raise ConfigError(
            f"optimizer.muon_momentum: {optimizer_config.muon_momentum} does not forget old gradients; set "
            "it below 1 (0.95 is Muon's usual)"
        )


def check_hf_export(job_config: JobConfig) -> None:
    """checkpoint.last_save_in_hf exports the last step's save: there must be one, and a model that
    Hugging Face's has a place for (not routing biases being trained), said before training, not
    after it."""
    if not job_config.checkpoint.last_save_in_hf:
        return
    if not job_config.checkpoint.enable_checkpoint:
        raise ConfigError(
            "checkpoint.last_save_in_hf: exports the last step's checkpoint, and checkpointing is off; "
            "set checkpoint.enable_checkpoint true"
        )
    spec = model_spec(job_config.model)
    if spec.moe and not spec.hf_expert_bias and job_config.moe.bias_update_rate > 0:
        raise ConfigError(
            f"checkpoint.last_save_in_hf: moe.bias_update_rate = {job_config.moe.bias_update_rate} trains "
            f"routing biases that Hugging Face's {job_config.model.name} model has no place for, so the "
            "export would be refused after training; set moe.bias_update_rate 0, or leave last_save_in_hf "
            "off and export with scripts/convert_dcp_to_hf.py --drop-expert-bias"
        )


def check_device(job_config: JobConfig, parallel_dims: ParallelDims, device_type: str) -> None:
    """Options that need CUDA (or CUDA and more)."""
    if job_config.parallelism.enable_async_tensor_parallel and not (
        device_type == "cuda" and job_config.training.compile and parallel_dims.tp_enabled
    ):
        raise ConfigError(
            "parallelism.enable_async_tensor_parallel: needs CUDA, training.compile = true and "
            f"tensor_parallel_degree > 1 (here: {device_type}, compile {job_config.training.compile}, "
            f"tp {parallel_dims.tp}); set it to false"
        )
    if job_config.profiling.enable_memory_snapshot and device_type != "cuda":
        raise ConfigError(
            f"profiling.enable_memory_snapshot: memory snapshots record the CUDA allocator, and this run is "
            f"on {device_type}; set it to false (profiler traces, enable_profiling, work on any device)"
        )


def check_float64(job_config: JobConfig, parallel_dims: ParallelDims) -> None:
    """training.float64 is upcast where Llama's dense model and the plain loss upcast; data-parallel
    wrappers, autocast and the chunked loss would compute in their own dtypes."""
    training = job_config.training
    if training.float64 and (
        job_config.model.name not in ("llama2", "llama3")
        or parallel_dims.world_size > 1
        or training.mixed_precision_param != "float32"
        or training.loss_chunk_tokens
    ):
        raise ConfigError(
            "training.float64: runs Llama on one process with mixed_precision_param float32 and "
            f"loss_chunk_tokens 0 (here: {job_config.model.name}, world size {parallel_dims.world_size}, "
            f"{training.mixed_precision_param}, {training.loss_chunk_tokens}); set those, or float64 false"
        )


# Float8 matmuls (torch._scaled_mm) need Ada (8.9) or Hopper (9.0) tensor cores, or newer.
FLOAT8_MIN_CUDA_CAPABILITY = (8, 9)


def check_float8(
    job_config: JobConfig,
    parallel_dims: ParallelDims | None = None,
    device_type: str | None = None,
    cuda_capability: tuple[int, int] | None = None,
    torchao_installed: bool | None = None,
) -> None:
    """The [float8] options against each other, the layout, the device and torchao's presence; each
    fact is checked only when known (None: not known by the caller, e.g. the preflight has no
    torch). `cuda_capability`: the lowest (major, minor) of the GPUs this job runs on."""
    float8 = job_config.float8
    if not float8.enable_float8_linear:
        return
    if float8.enable_fsdp_float8_all_gather and float8.recipe_name != "tensorwise":
        raise ConfigError(
            f"float8.enable_fsdp_float8_all_gather: torchao all-gathers float8 weights with the tensorwise "
            f"recipe only, and float8.recipe_name is {float8.recipe_name}; set one of them differently"
        )
    if float8.precompute_float8_dynamic_scale_for_fsdp and not float8.enable_fsdp_float8_all_gather:
        raise ConfigError(
            "float8.precompute_float8_dynamic_scale_for_fsdp: precomputes the scales of float8 "
            "all-gathers, and float8.enable_fsdp_float8_all_gather is false; set it to false too"
        )
    all_gather = float8.enable_fsdp_float8_all_gather
    if all_gather and parallel_dims is not None and not parallel_dims.fsdp_enabled:
        raise ConfigError(
            "float8.enable_fsdp_float8_all_gather: needs FSDP (a data_parallel_shard_degree or "
            f"context_parallel_degree above 1, here {parallel_dims.dp_shard} and {parallel_dims.cp}); set it "
            "to false"
        )
    if device_type is not None and device_type != "cuda":
        raise ConfigError(
            "float8.enable_float8_linear: float8 matmuls need a CUDA GPU of compute capability "
            f"{float8_capability_name()} or newer (H100, H200, L4, L40S), and this run is on {device_type}; "
            "set it to false"
        )
    if cuda_capability is not None and tuple(cuda_capability) < FLOAT8_MIN_CUDA_CAPABILITY:
        raise ConfigError(
            "float8.enable_float8_linear: float8 matmuls need a CUDA GPU of compute capability "
            f"{float8_capability_name()} or newer (H100, H200, L4, L40S), and this one is "
            f"{cuda_capability[0]}.{cuda_capability[1]}; set it to false"
        )
    if torchao_installed is False:
        raise ConfigError(torchao_missing())


def float8_capability_name() -> str:
    return ".".join(map(str, FLOAT8_MIN_CUDA_CAPABILITY))


def check_layout(
    job_config: JobConfig,
    world_size: int,
    device_type: str | None = None,
    cuda_capability: tuple[int, int] | None = None,
) -> ParallelDims:
    """The job's parallel degrees, once every rule above holds for them (the device rules only when
    `device_type` is known: the preflight runs before torch can tell; `cuda_capability`: the GPU's)."""
    parallel_dims = parallel_dims_of(job_config, world_size)
    model_args = flavor_args(job_config.model)
    check_parallelism(job_config, parallel_dims, model_args)
    check_moe(job_config, parallel_dims, model_args)
    check_routing_and_latents(job_config, model_args)
    check_context_parallel(job_config, parallel_dims, model_args)
    check_mtp(job_config)
    if parallel_dims.pp_enabled:
        check_tied_pipeline(job_config, model_args)
        check_pipeline(job_config, model_args.n_layers)
    gradient_accumulation_steps(job_config.training, parallel_dims)
    check_validation(job_config, parallel_dims)
    check_chat(job_config, parallel_dims)
    check_lr_schedule(job_config.lr_scheduler, job_config.training.steps)
    check_optimizer(job_config.optimizer)
    check_hf_export(job_config)
    check_float64(job_config, parallel_dims)
    if device_type is not None:
        check_device(job_config, parallel_dims, device_type)
    check_float8(job_config, parallel_dims, device_type, cuda_capability)
    return parallel_dims
