"""scripts/estimate_memory.py: its fake-tensor estimate against the peak measured in a real run."""

import functools
import re
import subprocess

import pytest
import torch
from launch import ROOT, launch_env, run_forked

from torchtitan.memory_estimation.torch_internals import check_torch_internals

SCRIPT = str(ROOT / "scripts" / "estimate_memory.py")
DEBUGGING_DOC = ROOT / "docs" / "debugging.md"
# Parameters, optimizer state and activations all weigh: a 15M-parameter model (the vocabulary
# padded to 16k rows) on 4 x 256 tokens (8 x 256 where a pipeline runs 8 micro-batches).
JOB = [
    "--job.config_file",
    str(ROOT / "train_configs" / "debug_model.toml"),
    "--model.vocab_size",
    "16384",
    "--training.seq_len",
    "256",
    "--training.batch_size",
    "4",
]
GIB = 2**30


def run(kind: str, argv: list[str], ngpu: int = 1) -> subprocess.CompletedProcess:
    """`kind` "script": scripts/estimate_memory.py; "torchrun": torchrun. Forked from launch.py's fork
    server (the tests run about 25 commands), which imports the script once; torchrun's ranks are
    counted by torchrun, not NGPU."""
    if kind == "script":
        return run_forked("script", SCRIPT, argv, launch_env(NGPU=str(ngpu)))
    return run_forked("module", "torch.distributed.run", argv, launch_env())


def rows(stdout: str, columns: int) -> list[list[float]]:
    """The last `columns` numbers of each table row."""
    families = ("llama3", "qwen3", "deepseek_v3")  # qwen3 starts qwen3_moe's rows too
    lines = [line.split() for line in stdout.splitlines() if line.startswith(families)]
    return [[float(x) for x in words[-columns:]] for words in lines]


@functools.cache
def script_output(ngpu: int, *args: str) -> str:
    """The script is deterministic: a command line is run once (the 1-process estimate and the PP 2
    ZBV one on 8 micro-batches serve two tests each)."""
    result = run("script", [*JOB, *args], ngpu)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    return result.stdout


def estimate(ngpu: int, *args: str, how: str = "") -> list[list[float]]:
    """A row per pipeline rank (one without PP): (params, grads, optimizer, activations, peak) in
    GiB; `how` must be in the note on how they were obtained."""
    stdout = script_output(ngpu, *args)
    assert how in stdout.splitlines()[-1], stdout
    return rows(stdout, 5)


def measure(nproc: int, *args: str) -> list[float]:
    """Each rank's measured peak in GiB."""
    torchrun = [f"--nproc_per_node={nproc}", "--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0"]
    result = run("torchrun", [*torchrun, SCRIPT, "--measure", *JOB, *args])
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    return [row[0] for row in rows(result.stdout, 1)]


PP2 = ["--parallelism.pipeline_parallel_degree", "2"]
CP2 = ["--parallelism.context_parallel_degree", "2"]
ZBV = [*PP2, "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"]
DEEPSEEK_V3 = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel"]
MTP1 = ["--model.mtp_layers", "1"]
EIGHT_MICROBATCHES = ["--training.batch_size", "8", "--parallelism.pipeline_parallel_microbatches", "8"]


def test_torch_internals_the_estimator_relies_on_are_there():
    """A torch upgrade that moves or reshapes one of them fails here, naming it, rather than as a
    wrong estimate."""
    check_torch_internals()


class _Mesh:
    """A 1-D device mesh's size and this rank's place in it, all shard_dim_alltoall reads."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self, dim: int) -> int:
        return self._size

    def get_local_rank(self, dim: int) -> int:
        return self._rank


@pytest.mark.parametrize("rows, rank, expected", [(8, 1, 2), (6, 1, 2), (6, 3, 0), (5, 2, 1)])
def test_shard_to_shard_counts_an_all_to_all_not_a_gather(rows, rank, expected):
    """DTensor's Shard(1) -> Shard(0) (Muon dealing stacked matrices over FSDP's ranks) is an all-to-all
    on GPUs, but on the simulation's CPU mesh torch gathers the whole tensor first: on Kimi K2 at 1024
    GPUs that counted 136 GiB for the optimizer step of the first pipeline rank. Simulated, it allocates
    this rank's chunk only (torch.chunk's split of `rows` over 4 ranks)."""
    from torch.distributed.tensor import placement_types

    from torchtitan.memory_estimation.torch_internals import gpu_all_to_all

    local = torch.empty(rows, 3, 2)  # this rank's shard of dimension 2 (8 columns over 4 ranks)
    with gpu_all_to_all():
        out = placement_types.shard_dim_alltoall(local, 2, 0, _Mesh(4, rank), 0)
    assert tuple(out.shape) == (expected, 3, 8)


@pytest.mark.parametrize(
    "nproc, layout",
    [
        (1, []),
        (2, []),
        (2, ["--parallelism.tensor_parallel_degree", "2", "--model.vocab_size", "128256"]),
        # The estimate test_pipeline_ranks_composed_from_two_microbatches_equal_the_whole_step[pp2_zbv]
        # checks against the whole step's: composed from 2 of the 8 micro-batches.
        (2, [*ZBV, *EIGHT_MICROBATCHES]),
        (2, [*CP2, "--training.seq_len", "1024", "--training.batch_size", "1"]),
        (2, [*DEEPSEEK_V3, "--parallelism.expert_parallel_degree", "2", *MTP1]),
        (2, [*DEEPSEEK_V3, *PP2, *MTP1]),
    ],
    ids=[
        "one_process",
        "fsdp2",
        "tp2_llama3_vocab",
        "pp2_zbv",
        "cp2",
        "deepseek_v3_ep2_mtp",
        "deepseek_v3_pp2_mtp",
    ],
)
def test_estimate_is_within_10_percent_of_the_measured_peak(nproc, layout):
    """Pipeline ranks hold different stages and micro-batches: each has its own row. ZBV splits
    backward into input and weight passes, and puts the first and last stages on rank 0. With
    Llama 3's vocabulary the loss-parallel logits weigh most (DTensor works out their global
    shapes on fake tensors: no memory in a real run). Under CP 2 each rank runs 512 of a sequence's
    1024 tokens and gathers the keys and values of all 1024. DeepSeek-V3's debug model at EP 2 (each
    rank 4 of the 8 experts of its 2 sparse layers, the rest FSDP-sharded over both ranks) weighs MLA's
    latent and per-head projections, the shared expert and the rows each rank's experts receive, with a
    multi-token prediction depth (its block, its logits and loss, the shifted targets); on PP 2 its
    stages pass the shifted tokens' embeddings on, and the last outputs the depth's logits too."""
    estimates = estimate(nproc, *layout)
    for params, grads, optimizer, activations, peak in estimates:
        assert abs(params + grads + optimizer + activations - peak) < 0.005
    measured = measure(nproc, *layout)
    assert len(measured) == nproc
    for rank, rank_peak in enumerate(measured):
        peak = estimates[rank * len(estimates) // nproc][-1]
        assert abs(peak - rank_peak) <= 0.10 * rank_peak, (estimates, measured)


def test_extrapolated_depth_equals_the_whole_model():
    """The 6-layer model simulated at 2, 3 and 4 layers and extrapolated, vs all 6 simulated."""
    layout = ["--parallelism.tensor_parallel_degree", "2", "--activation_checkpoint.mode", "selective"]
    layout += ["--activation_checkpoint.selective_ac_option", "op"]
    extrapolated = estimate(4, *layout, how="extrapolated from 2, 3, 4 layers")
    assert extrapolated == estimate(4, *layout, "--full", how="all 6 layers simulated")


def test_extrapolated_pipeline_stages_equal_the_whole_model():
    """Llama 3 8B's 32 layers in two uneven stages (14 + 18): each rank is simulated with 2 + 6,
    3 + 7 and 4 + 8 layers and extrapolated, vs all 32 simulated."""
    layout = ["--model.flavor", "8B", "--training.seq_len", "64", "--training.batch_size", "2", *PP2]
    layout += ["--parallelism.pipeline_parallel_split_points", "layers.14"]
    extrapolated = estimate(2, *layout, how="extrapolated from 8, 10, 12 layers")
    assert len(extrapolated) == 2 and extrapolated[0] != extrapolated[1]
    assert extrapolated == estimate(2, *layout, "--full", how="all 32 layers simulated")


INTERLEAVED = [*PP2, "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]
TP2 = ["--parallelism.tensor_parallel_degree", "2"]


@pytest.mark.parametrize(
    "ngpu, layout",
    [
        (8, [*INTERLEAVED, *TP2, "--activation_checkpoint.mode", "full", "--model.vocab_size", "128256"]),
        (2, ZBV),  # the estimate test_estimate_is_within_10_percent_of_the_measured_peak[pp2_zbv] measures
    ],
    ids=["fsdp2_tp2_pp2_interleaved_full_ac_llama3_vocab", "pp2_zbv"],
)
def test_pipeline_ranks_composed_from_two_microbatches_equal_the_whole_step(ngpu, layout):
    """Each rank runs two of its eight micro-batches and its step is composed from them, vs all
    eight run. Activations, gradients and receive buffers of the micro-batches not run are counted
    from those run; ZBV puts both ends on rank 0 and passes activations between the two stages of
    rank 1 without sending them."""
    layout = [*layout, *EIGHT_MICROBATCHES]
    composed = estimate(ngpu, *layout, how="2 of 2 pipeline ranks simulated on 2 of 8 micro-batches")
    assert len(composed) == 2 and composed[0] != composed[1]
    assert composed == estimate(ngpu, *layout, "--full", how="all 6 layers simulated")


@pytest.mark.parametrize(
    "microbatches, split, how",
    [
        (4, [], "3 of 4 pipeline ranks simulated on 2 of 4"),
        (8, [",".join(f"layers.{i}" for i in range(1, 16))], "4 of 4 pipeline ranks simulated on 2 of 8"),
    ],
    ids=["two_stages_per_rank", "four_stages_per_rank"],
)
def test_ranks_of_a_kind_composed_from_one_equal_their_whole_steps(microbatches, split, how):
    """Llama 3 1B over 4 pipeline ranks (long sequences, so that activations weigh): ranks 1 and 2
    hold alike stages, so rank 2 is composed from rank 1's two micro-batches, though it keeps fewer
    in flight. With four stages per rank and 8 micro-batches, FSDP frees and gathers them in a
    pattern of each rank's own, and rank 2 is simulated for itself."""
    layout = ["--model.flavor", "1B", "--training.seq_len", "4096"]
    layout += ["--training.batch_size", str(microbatches)]
    layout += ["--parallelism.pipeline_parallel_degree", "4", "--parallelism.pipeline_parallel_schedule"]
    layout += ["Interleaved1F1B", "--parallelism.pipeline_parallel_microbatches", str(microbatches)]
    if split:
        layout += ["--parallelism.pipeline_parallel_split_points", *split]
    composed = estimate(4, *layout, how=how)
    assert len({row[-1] for row in composed}) == 4
    assert composed == estimate(4, *layout, "--full", how="all 16 layers simulated")


def test_each_simulation_has_a_process_of_its_own():
    """Three pipeline ranks (Llama 3 70B: 26 or 27 layers each) at three depths: nine simulations,
    more than a pool of two hands out one at a time by default (a process reused for another rank
    finds DTensor's caches naming the process groups of the last: "Could not resolve the process
    group"). One GPipe micro-batch: each simulation is the cheapest that runs the tensor-parallel
    blocks of its rank's stage (the pool's hand-out does not depend on the schedule)."""
    layout = ["--model.flavor", "70B", "--training.seq_len", "64", "--training.batch_size", "1"]
    layout += ["--parallelism.pipeline_parallel_degree", "3", "--parallelism.tensor_parallel_degree", "2"]
    layout += ["--parallelism.pipeline_parallel_schedule", "GPipe"]
    layout += ["--parallelism.pipeline_parallel_microbatches", "1"]
    ranks = estimate(6, *layout, how="extrapolated from 8, 11, 14 layers")
    assert len(ranks) == 3 and ranks[0] != ranks[1] != ranks[2]


def test_big_model_estimate_shards_parameters_and_optimizer_state():
    """Llama 3 1B (1.50e9 parameters with Llama 3's vocabulary) over 8 FSDP ranks: each holds an
    eighth of the fp32 parameters, and AdamW two fp32 states of its shard."""
    ((params, grads, optimizer, activations, peak),) = estimate(
        8,
        "--model.flavor",
        "1B",
        "--model.vocab_size",
        "128256",
        "--training.mixed_precision_param",
        "bfloat16",
    )
    shard = 1_498_482_688 * 4 / 8 / GIB
    assert optimizer == pytest.approx(2 * shard, rel=0.01)
    assert shard <= params < shard + 1.5  # plus the gathered bf16 blocks and root
    assert peak == pytest.approx(params + grads + optimizer + activations, abs=0.005)


def test_tied_qwen3_estimate_counts_the_shared_table_once():
    """Qwen3 0.6B (596,049,920 parameters with its 151,936-row table, tied to the output layer) over 8
    FSDP ranks: AdamW's two fp32 states of each rank's eighth, the table counted once."""
    ((params, grads, optimizer, activations, peak),) = estimate(
        8, "--model.name", "qwen3", "--model.flavor", "0.6B", "--model.vocab_size", "151936"
    )
    shard = 596_049_920 * 4 / 8 / GIB
    assert optimizer == pytest.approx(2 * shard, rel=0.01)
    assert peak == pytest.approx(params + grads + optimizer + activations, abs=0.005)


def test_chunked_loss_estimate_drops_the_logits():
    """training.loss_chunk_tokens on PP 2 x TP 2 (loss parallel): the last stage's estimated peak
    falls by at least the fp32 logits of a micro-batch's vocabulary shard (2 x 256 tokens x 8192),
    which the unfused step holds with their log-softmax and gradient; the first stage's is unchanged."""
    layout = [*PP2, *TP2]
    first, last = estimate(4, *layout)
    chunked_first, chunked_last = estimate(4, *layout, "--training.loss_chunk_tokens", "256")
    assert chunked_first == first
    assert last[-1] - chunked_last[-1] >= 2 * 256 * 8192 * 4 / GIB


def test_moe_estimate_splits_the_experts_and_counts_the_rows_they_receive():
    """Qwen3-MoE's debug model (14,098,944 parameters with the 16k vocabulary; 3 sparse layers of 8
    experts, 2 per token) at EP 2 over 4 FSDP ranks: each rank holds 4 experts of each layer, sharded
    over the other 2 ranks, so AdamW's two fp32 states are of a quarter of the parameters. When its
    experts receive twice the balanced rows (--expert-load 2: 4 x 256 x 2 more per layer), the peak
    grows by at least what each row keeps for backward: its input, its w1 and w3 outputs and their
    gated product (hidden size 256)."""
    layout = ["--model.name", "qwen3_moe", "--model.flavor", "debugmodel"]
    layout += ["--parallelism.expert_parallel_degree", "2"]
    ((params, grads, optimizer, activations, peak),) = estimate(4, *layout, how="balanced routing")
    assert optimizer == pytest.approx(2 * 14_098_944 * 4 / 4 / GIB, rel=0.01)
    assert peak == pytest.approx(params + grads + optimizer + activations, abs=0.005)
    ((*_, loaded_peak),) = estimate(4, *layout, "--expert-load", "2", how="receive 2x balanced")
    assert loaded_peak - peak >= 3 * (4 * 256 * 2) * (256 + 3 * 256) * 4 / GIB


def test_pipeline_stages_carrying_the_balancing_losses_are_estimated():
    """DeepSeek-V3's stages pass the router statistics and the sequence-wise loss on beside the
    activations (multi-token prediction's embeddings among them), and their gradients come back: the
    fake pipeline's example tensors must take gradients too (its stage backward failed when the
    batch-wise auxiliary loss was on)."""
    losses = ["--moe.aux_loss_weight", "0.001", "--moe.sequence_aux_loss_weight", "0.0001"]
    ranks = estimate(2, *DEEPSEEK_V3, *PP2, *losses, *MTP1, how="all 3 layers simulated")
    assert len(ranks) == 2
    for params, grads, optimizer, activations, peak in ranks:
        assert params > 0 and grads > 0 and optimizer > 0
        assert peak == pytest.approx(params + grads + optimizer + activations, abs=0.005)


def quoted(figure: str) -> tuple[float, float]:
    """A figure as a recipe's comment quotes it (e.g. "35.0") and the rounding it allows."""
    decimals = len(figure.partition(".")[2])
    return float(figure), 0.5 * 10**-decimals + 1e-9


def test_long_context_recipe_fits_an_80_gb_gpu_as_its_comment_quotes(tmp_path):
    """train_configs/llama3_8b_128k.toml (131072-token sequences, CP 8 x FSDP 8 on 64 GPUs): each rank
    runs 16K tokens of a sequence, and its estimated peak leaves 10 GiB of an 80 GB GPU for what the
    estimate does not count (CUDA context, NCCL buffers, fragmentation); docs/debugging.md quotes it.
    The figures the recipe's comment quotes from scripts/estimate_memory.py, with the command it quotes,
    are what the estimator gives today, to the figures' rounding: the peak, its activations and the peak
    with the chunked loss the comment offers (it had kept 31.8, 28 and 17.3 GiB after the estimator's
    context parallelism gained the gathered keys: 35.0, 32.1 and 20.4). The one recipe cheap enough to
    estimate in a test (about 15 s); the others' figures, minutes each, by hand."""
    recipe = ROOT / "train_configs" / "llama3_8b_128k.toml"
    comment = " ".join(line[1:].strip() for line in recipe.read_text().splitlines() if line.startswith("#"))
    ngpu, command = re.search(
        r"NGPU=(\d+) python scripts/estimate_memory.py (.+?\.toml(?: --\S+ \d+)*)", comment
    ).groups()
    figures = re.search(
        r"Peak per GPU by scripts/estimate_memory.py \([^)]*\): ([\d.]+) GiB, of which ([\d.]+) GiB "
        r"activations.*--training.loss_chunk_tokens (\d+) brings it to ([\d.]+) GiB",
        comment,
    )
    peak, activations, chunk_tokens, chunked_peak = figures.groups()
    chunked = tmp_path / "chunked.toml"
    chunked.write_text(
        recipe.read_text().replace("[training]\n", f"[training]\nloss_chunk_tokens = {chunk_tokens}\n")
    )
    argv = command.split()
    result = run("script", [*argv, "--job.config_file", str(chunked)], int(ngpu))
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert not result.stderr  # torch's warnings that tell the user nothing are filtered
    (params, grads, optimizer, plain_activations, plain_peak), (*_, chunked_estimate) = rows(result.stdout, 5)
    shard = 8_030_261_248 * 4 / 64 / GIB  # fp32 parameters over the 64 FSDP ranks
    assert optimizer == pytest.approx(2 * shard, rel=0.01)
    assert plain_peak == pytest.approx(params + grads + optimizer + plain_activations, abs=0.005)
    assert plain_peak < 70
    doc = re.search(r"llama3_8b_128k\.toml` \([^)]*\) is estimated at (\S+) GiB", DEBUGGING_DOC.read_text())
    assert doc and doc.group(1) == f"{plain_peak:.2f}", (
        f"docs/debugging.md quotes {doc}, the script {plain_peak}"
    )
    for estimate_, figure in (
        (plain_peak, peak),
        (plain_activations, activations),
        (chunked_estimate, chunked_peak),
    ):
        value, rounding = quoted(figure)
        assert abs(estimate_ - value) <= rounding, (figure, result.stdout)
