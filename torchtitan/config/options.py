"""Job configuration: every option is declared once, below, and that declaration drives the TOML
parser, the command-line overrides, `--help` and validation (torchtitan/config/parser.py).
"""

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from torchtitan.config.chat_options import ChatConfig
from torchtitan.config.declare import ConfigError, default_of, opt

__all__ = ["ChatConfig", "ConfigError", "JobConfig", "default_of", "opt"]


@dataclass
class JobSectionConfig:
    config_file: str | None = opt(None, "TOML job file to read before the command-line overrides")
    dump_folder: str = opt("./outputs", "Folder for checkpoints, metrics.jsonl, traces and logs")
    description: str = opt("default job", "Free text describing the job, printed at start")
    print_args: bool = opt(False, "Print the resolved configuration at start")


@dataclass
class ModelConfig:
    name: str = opt(
        "llama3",
        "Model family (docs/models.md); its spec is torchtitan/models/__init__.py's MODEL_SPECS entry",
        choices=("llama2", "llama3", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "deepseek_v3"),
    )
    flavor: str = opt(
        "debugmodel",
        "Model size within the family, e.g. debugmodel, 8B, 70B, 405B (llama3); 0.6B, 8B (qwen3)",
    )
    n_layers: int = opt(
        0,
        "Transformer blocks: 0, the flavour's; N, the flavour's width on N blocks (its first dense blocks "
        "kept), e.g. to try a large flavour's layout and memory on a few GPUs, or a fast test",
        min=0,
    )
    tokenizer_path: str = opt(
        "assets/tokenizer/kjv_bpe.tiktoken",
        "tiktoken BPE file (the bundled one, or Llama 3's tokenizer.model), or a Hugging Face "
        "tokenizer.json or a folder holding one and its tokenizer_config.json (e.g. Qwen3's, or the "
        "bundled assets/tokenizer/kjv_bpe_hf); relative paths are resolved from the current folder, "
        "then from the repository root",
    )
    vocab_size: int = opt(
        -1,
        "Rows of the embedding and output layers; -1: those of the Hugging Face folder the run starts from "
        "(checkpoint.initial_load_path; Qwen3's 151936), else the tokenizer's vocabulary. A larger value "
        "pads them, e.g. 128256 to train at Llama 3's real size with the bundled tokenizer (for benchmarks)",
        min=-1,
    )
    attn_mask_type: str = opt(
        "causal",
        "Attention mask: causal (every earlier token of the window), or block_causal (only the earlier "
        "tokens of the same document: packed documents, each ending with EOS, attend within themselves, "
        "RoPE positions restarting at each; docs/attention.md)",
        choices=("causal", "block_causal"),
    )
    mtp_layers: int = opt(
        0,
        "Multi-token prediction depths D (0: off; DeepSeek-V3's is 1): depth k's block predicts the token "
        "k+1 ahead, its loss added to the language model's (docs/objectives.md); families whose spec has mtp",
        min=0,
    )
    mtp_loss_weight: float = opt(
        0.3,
        "lambda: the multi-token prediction loss's weight, times the mean of its depths' losses "
        "(DeepSeek-V3: 0.3 for its first 10T tokens, 0.1 after)",
        min=0.0,
    )


@dataclass
class OptimizerConfig:
    name: str = opt(
        "AdamW",
        "Optimizer; Muon: Muon for the matrices inside the blocks, AdamW (this section's options) for the "
        "other parameters (docs/optimizers.md)",
        choices=("AdamW", "Adam", "Muon"),
    )
    lr: float = opt(8e-4, "Peak learning rate", min=0.0)
    beta1: float = opt(0.9, "Adam beta1", min=0.0)
    beta2: float = opt(0.95, "Adam beta2", min=0.0)
    eps: float = opt(1e-8, "Adam epsilon", min=0.0)
    weight_decay: float = opt(0.1, "Decoupled weight decay", min=0.0)
    implementation: str = opt(
        "foreach",
        "Kernel: for-loop, foreach (multi-tensor) or fused",
        choices=("for-loop", "foreach", "fused"),
    )
    muon_lr: float | None = opt(
        None,
        "Muon's peak learning rate; unset: optimizer.lr (with muon_scale match_rms_adamw, AdamW's rate "
        "carries over)",
        min=0.0,
    )
    muon_momentum: float = opt(0.95, "Muon's momentum, from 0 up to (not including) 1", min=0.0)
    muon_nesterov: bool = opt(True, "Muon: Nesterov momentum")
    muon_weight_decay: float | None = opt(
        None, "Muon's decoupled weight decay; unset: optimizer.weight_decay", min=0.0
    )
    muon_scale: str = opt(
        "match_rms_adamw",
        "How Muon scales the orthogonalised update of a rows x columns matrix: match_rms_adamw "
        "(Moonlight's 0.2 x sqrt(max(rows, columns)): the RMS of AdamW's update) or original (Keller "
        "Jordan's sqrt(max(1, rows / columns)), torch.optim.Muon's default)",
        choices=("match_rms_adamw", "original"),
    )
    muon_ns_steps: int = opt(5, "Newton-Schulz iterations per Muon update", min=1)
    muon_ns_dtype: str = opt(
        "bfloat16",
        "Precision of Muon's Newton-Schulz iterations: bfloat16 (Keller Jordan's and torch.optim.Muon's; "
        "fast on GPUs) or float32 (on CPUs, whose bfloat16 matmuls are several times slower)",
        choices=("bfloat16", "float32"),
    )


@dataclass
class LRSchedulerConfig:
    warmup_steps: int = opt(200, "Steps of linear warmup from near 0 to optimizer.lr", min=0)
    decay_ratio: float | None = opt(
        None,
        "Fraction of the steps spent decaying at the end (WSD); unset: decay right after warmup",
        min=0.0,
    )
    decay_type: str = opt("linear", "Shape of the decay", choices=("linear", "sqrt", "cosine"))
    lr_min: float = opt(0.0, "Final learning rate as a fraction of optimizer.lr", min=0.0)


@dataclass
class TrainingConfig:
    dataset: str = opt("kjv", "Named dataset: kjv (bundled), c4 (streamed from the Hugging Face hub)")
    dataset_path: str | None = opt(
        None, "Local file or folder (txt/json/jsonl/parquet) overriding the dataset"
    )
    mixture: list[str] = opt(
        [],
        "Train on several sources instead of dataset/dataset_path, each 'source:weight' (a dataset name, "
        "a local file or folder, or a pre-tokenized folder; weight 1 when left out): every row of every "
        "global batch comes from one source, drawn by weight (docs/datasets.md)",
    )
    shuffle_windows: bool = opt(
        False,
        "Pre-tokenized data (a dataset_path with manifest.json): read its windows in an order seeded by "
        "training.seed, a new one each epoch; off: in order",
    )
    data_workers: int = opt(
        1,
        "Processes per rank that read and tokenize data ahead of the training step, each making some rows "
        "of every batch (at most batch_size of them); 0: on the training thread",
        min=0,
    )
    data_prefetch: int = opt(2, "Batches each data worker prepares ahead", min=1)
    data_timeout_seconds: int = opt(
        60,
        "Stop with exit code 6 when a data worker (with data_workers = 0: the training thread) makes no "
        "batch for this long: it is stalled. Keep it below comm.train_timeout_seconds, so that the stalled "
        "rank, not one left waiting for it, stops first and says why; 0: wait forever",
        min=0,
    )
    batch_size: int = opt(8, "Per-rank batch size (sequences)", min=1)
    seq_len: int = opt(2048, "Sequence length (tokens)", min=1)
    max_norm: float = opt(1.0, "Clip gradients to this global L2 norm; 0 disables clipping", min=0.0)
    steps: int = opt(10000, "Number of optimizer steps to train for", min=1)
    seed: int = opt(0, "Seed for weight init, data-free RNG and dropout-free determinism", min=0)
    deterministic: bool = opt(False, "Use deterministic algorithms (slower, bitwise repeatable)")
    gc_freq: int = opt(50, "Run Python's garbage collector every N steps (automatic GC is disabled)", min=1)
    mixed_precision_param: str = opt(
        "bfloat16",
        "Dtype of the matmuls (autocast, on every layout; FSDP/DDP gather their weights in it); norms, "
        "embeddings, the residual stream and the loss stay fp32 (docs/numerics.md)",
        choices=("bfloat16", "float32"),
    )
    mixed_precision_reduce: str = opt(
        "float32", "Dtype of gradient reduction across data-parallel ranks", choices=("bfloat16", "float32")
    )
    float64: bool = opt(
        False,
        "Train in float64 throughout (parameters, optimizer state, activations, loss): a reference whose "
        "numbers do not depend on the machine's kernels, the stored loss curve's (scripts/loss_curve.py); "
        "Llama on one process, mixed_precision_param float32, loss_chunk_tokens 0",
    )
    global_batch_size: int = opt(
        -1,
        "Sequences per optimizer step over all data-parallel ranks; a multiple of batch_size x DP degree "
        "runs that many micro-batches per step (gradient accumulation); -1: batch_size x DP degree",
        min=-1,
    )
    compile: bool = opt(
        False, "torch.compile each transformer block, and the loss unless it is computed loss-parallel"
    )
    compile_backend: str = opt(
        "inductor",
        "torch.compile's backend with training.compile: inductor (generated kernels), or aot_eager (the "
        "same graphs run by eager kernels: tells an inductor bug from a tracing one, compiles in seconds)",
        choices=("inductor", "aot_eager"),
    )
    loss_chunk_tokens: int = opt(
        0,
        "Project the final hidden states and score them this many tokens at a time, in forward and "
        "backward, so the full logits never exist; with TP each rank scores its vocabulary shard, with "
        "PP the last stage's loss projects (docs/performance.md); 0: project all at once",
        min=0,
    )
    z_loss_weight: float = opt(
        0.0,
        "Weight of the z-loss added to the training loss (PaLM): the mean over the targets of log(Z)^2, Z "
        "the softmax's normaliser, which keeps the logits from drifting (docs/objectives.md); 0: off",
        min=0.0,
    )
    skip_nonfinite_steps: bool = opt(
        False,
        "On a NaN/Inf gradient norm, skip the step (no optimizer step; counted as skipped_steps in "
        "metrics.jsonl) instead of stopping with exit code 3",
    )


@dataclass
class ValidationConfig:
    enable: bool = opt(False, "Evaluate the loss on held-out data every `freq` steps and at the last step")
    dataset: str = opt(
        "kjv_validation", "Named dataset to evaluate on (kjv_validation: the bundled held-out split)"
    )
    dataset_path: str | None = opt(
        None,
        "Local file or folder (txt/json/jsonl/parquet; a folder's validation split) overriding the dataset",
    )
    freq: int = opt(100, "Evaluate every N steps (and at the last step)", min=1)
    steps: int = opt(
        -1,
        "Global batches per evaluation; -1: the whole dataset once (its incomplete last batch left out)",
        min=-1,
    )
    batch_size: int = opt(-1, "Per-rank batch size (sequences); -1: training.batch_size", min=-1)
    global_batch_size: int = opt(
        -1,
        "Sequences per validation batch over all data-parallel ranks, in place of batch_size: the same "
        "windows, so the same loss, at every DP degree, and a small split fills it on any number of GPUs; "
        "-1: batch_size x DP degree",
        min=-1,
    )


@dataclass
class ParallelismConfig:
    data_parallel_shard_degree: int = opt(
        -1, "FSDP degree; -1 uses all ranks left by the other degrees", min=-1
    )
    data_parallel_replicate_degree: int = opt(
        1, "Replicas of the sharded model (HSDP when the shard degree is also > 1; DDP when it is 1)", min=1
    )
    tensor_parallel_degree: int = opt(
        1, "Tensor (and sequence) parallel degree; must divide the model's attention heads", min=1
    )
    context_parallel_degree: int = opt(
        1,
        "Context-parallel degree: ranks each sequence is split over (load-balanced for causal attention, "
        "keys and values all-gathered); FSDP shards over data_parallel_shard_degree x this "
        "(docs/composability.md)",
        min=1,
    )
    expert_parallel_degree: int = opt(
        1,
        "Expert-parallel degree: ranks a mixture-of-experts layer's experts are split over, borrowed from "
        "data_parallel_shard_degree (which it must divide, as it must the experts); tokens go to their "
        "experts' ranks and back by all-to-all, and the experts are FSDP-sharded over the rest "
        "(docs/moe.md)",
        min=1,
    )
    enable_loss_parallel: bool = opt(
        True, "With TP, compute the loss on vocabulary-sharded logits instead of gathering them"
    )
    enable_async_tensor_parallel: bool = opt(
        False, "Overlap TP communication with matmuls (CUDA and training.compile only)"
    )
    fsdp_reshard_after_forward: str = opt(
        "default",
        "Free gathered parameters after forward: default = every block but the last (none with PP), "
        "always, never (more memory, less communication)",
        choices=("default", "always", "never"),
    )
    fsdp_gather_dtype: str = opt(
        "bfloat16",
        "With bf16 mixed precision, the dtype FSDP/HSDP all-gather the blocks' weights in: bfloat16 (half "
        "the traffic; each norm is then an fp32 unit of its own, which splits a compiled block into "
        "pieces) or float32 (one unit and one compiled graph per block, autocast rounding the matmul "
        "weights inside it; twice the traffic). The same numbers either way (docs/numerics.md)",
        choices=("bfloat16", "float32"),
    )
    fsdp_forward_prefetch: int = opt(
        0, "Blocks whose parameters each block all-gathers ahead in forward; 0: FSDP's implicit one", min=0
    )
    fsdp_backward_prefetch: int = opt(
        0, "Blocks whose parameters each block all-gathers ahead in backward; 0: FSDP's implicit one", min=0
    )
    pipeline_parallel_degree: int = opt(1, "Pipeline-parallel degree: ranks the layers are split over", min=1)
    pipeline_parallel_schedule: str = opt(
        "1F1B",
        "Pipeline schedule (torch.distributed.pipelining); GPipe and 1F1B run one stage per rank, "
        "the others two (ZBVZeroBubble and DualPipeV in a V: rank r holds stages r and 2*pp-1-r)",
        choices=(
            "GPipe",
            "1F1B",
            "Interleaved1F1B",
            "LoopedBFS",
            "InterleavedZeroBubble",
            "ZBVZeroBubble",
            "DualPipeV",
        ),
    )
    pipeline_parallel_microbatches: int | None = opt(
        None, "Micro-batches each rank's batch is split into per step; unset: the number of stages", min=1
    )
    pipeline_parallel_split_points: list[str] = opt(
        [],
        "First layer of each stage after the first, e.g. layers.2,layers.4 (stages = points + 1, "
        "a multiple of the PP degree); empty: split the layers evenly",
    )


@dataclass
class ActivationCheckpointConfig:
    mode: str = opt(
        "none",
        "Recompute activations in backward instead of keeping them: none, full (every block) or "
        "selective (see selective_ac_option)",
        choices=("none", "full", "selective"),
    )
    selective_ac_option: str = opt(
        "2",
        "With mode selective: 'op' keeps matmul, attention and reduce-scatter outputs (every other "
        "matmul's) and recomputes the rest; an integer N checkpoints every N-th block",
    )


@dataclass
class CheckpointConfig:
    enable_checkpoint: bool = opt(False, "Save checkpoints and resume from the latest one")
    folder: str = opt("checkpoint", "Checkpoint folder, inside job.dump_folder")
    interval: int = opt(500, "Save every N steps (and at the last step)", min=1)
    keep_latest_k: int = opt(
        0, "Keep only the newest K checkpoints, deleting older ones in the background; 0 keeps all", min=0
    )
    load_step: int = opt(-1, "Resume from this step's checkpoint; -1: the latest complete one", min=-1)
    async_mode: str = opt(
        "disabled",
        "Save in the background: async copies the state to CPU memory and writes it from another process; "
        "async_with_pinned_mem copies into pinned memory (CUDA only; plain async on CPU)",
        choices=("disabled", "async", "async_with_pinned_mem"),
    )
    model_weights_only: bool = opt(
        False, "At the last step save the model weights only (in export_dtype), e.g. for inference"
    )
    export_dtype: str = opt(
        "float32",
        "Dtype of the weights saved by model_weights_only",
        choices=("float32", "bfloat16", "float16"),
    )
    last_save_in_hf: bool = opt(
        False,
        "After the last step's save, also export it as a Hugging Face folder, {dump_folder}/hf, that "
        "transformers runs as it is (weights, config, generation config, tokenizer; read whole by rank 0)",
    )
    exclude_from_loading: list[str] = opt(
        [],
        "Parts of the checkpoint not to load on resume (they start fresh), e.g. dataloader,optimizer",
        choices=("model", "optimizer", "lr_scheduler", "dataloader", "train_state", "rng"),
    )
    verify_checksums: bool = opt(
        True,
        "Before loading a checkpoint, check each of its files against the size and CRC32 saved with it "
        "(reads the checkpoint once more); false skips this, e.g. for very large checkpoints",
    )
    initial_load_path: str | None = opt(
        None,
        "A checkpoint folder (step-N) or a Hugging Face model folder (config.json and safetensors) whose "
        "model weights start a new run, e.g. to continue pre-training; used only when the run has no "
        "checkpoint of its own",
    )


@dataclass
class MetricsConfig:
    log_freq: int = opt(10, "Log every N steps (and the first and last)", min=1)
    enable_wandb: bool = opt(False, "Also log to Weights & Biases (WANDB_MODE=offline works without network)")
    enable_color_printing: bool | None = opt(None, "Colour the log; unset: colour only on a terminal")


@dataclass
class ProfilingConfig:
    enable_profiling: bool = opt(False, "Write torch profiler traces of one step in every profile_freq")
    save_traces_folder: str = opt(
        "profile_traces", "Trace folder, inside job.dump_folder (iteration_N/rank{r}_trace.json)"
    )
    profile_freq: int = opt(10, "Profile (and snapshot memory at) every N-th step", min=1)
    enable_memory_snapshot: bool = opt(
        False, "Record CUDA memory history and dump allocator snapshots every profile_freq steps (CUDA only)"
    )
    save_memory_snapshot_folder: str = opt(
        "memory_snapshot", "Memory snapshot folder, inside job.dump_folder"
    )


@dataclass
class CommConfig:
    init_timeout_seconds: int = opt(300, "Timeout for process-group setup and the first step", min=1)
    train_timeout_seconds: int = opt(100, "Timeout of collectives after the first step", min=1)


@dataclass
class MoEConfig:
    aux_loss_weight: float = opt(
        0.001,
        "Mixture-of-experts models: weight of the auxiliary load-balancing loss in the training loss "
        "(Hugging Face's router_aux_loss_coef; Qwen3-MoE's is 0.001); 0: off (docs/moe.md)",
        min=0.0,
        old_names=("aux_loss_coef",),
    )
    bias_update_rate: float = opt(
        0.0,
        "Mixture-of-experts models: DeepSeek-V3's auxiliary-loss-free balancing, each optimizer step moves "
        "every expert's routing bias by this much against its load (DeepSeek-V3: 0.001); 0: off",
        min=0.0,
    )
    sequence_aux_loss_weight: float = opt(
        0.0,
        "Mixture-of-experts models: weight (alpha) of DeepSeek-V3's sequence-wise balance loss, each "
        "sequence's experts balanced within it (DeepSeek-V3: 0.0001); 0: off (docs/moe.md)",
        min=0.0,
        old_names=("sequence_aux_loss_coeff",),
    )


@dataclass
class Float8Config:
    enable_float8_linear: bool = opt(
        False,
        "Train the linear layers with float8 matmuls through torchao (an optional dependency); needs CUDA "
        "with compute capability 8.9 or newer (H100, H200, L4, L40S). Layers named in filter_fqns and "
        "those with a dimension not a multiple of 16 stay in the training dtype",
    )
    recipe_name: str = opt(
        "tensorwise",
        "torchao's scaling recipe: tensorwise (one dynamic scale per tensor: fastest, and float8 "
        "all-gathers for FSDP and TP) or rowwise (a scale per row: more accurate)",
        choices=("tensorwise", "rowwise"),
    )
    enable_fsdp_float8_all_gather: bool = opt(
        False, "With FSDP and the tensorwise recipe, all-gather the weights in float8 (half of bf16's bytes)"
    )
    precompute_float8_dynamic_scale_for_fsdp: bool = opt(
        False,
        "With enable_fsdp_float8_all_gather, compute every weight's float8 scale in one all-reduce after "
        "the optimizer step instead of one small all-reduce per layer",
    )
    filter_fqns: list[str] = opt(
        ["output"],
        "Linear layers kept out of float8: a layer is skipped when one of these names is its fully "
        "qualified name or a dotted part of it (output, wq, attention.wq, layers.0)",
    )


@dataclass
class JobConfig:
    job: JobSectionConfig = field(default_factory=JobSectionConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    activation_checkpoint: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    float8: Float8Config = field(default_factory=Float8Config)
    chat: ChatConfig = field(default_factory=ChatConfig)
    # The options the recipe or the command line set ("section.key"; parse_args), whatever their value:
    # rules refuse those set where they do nothing (the [moe] section on a dense model). Not an option.
    explicit: ClassVar[frozenset[str]] = frozenset()

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {
            s.name: {o.name: getattr(getattr(self, s.name), o.name) for o in fields(s.type)}
            for s in fields(self)
        }
