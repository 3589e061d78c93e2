"""Multi-token prediction (model.mtp_layers, torchtitan/models/mtp.py), on CPU in fp32: the targets'
shift stays inside documents and the window; the loss per depth of a packed batch, through the train
step (two micro-batches), equals an oracle written here from the model's own modules run on each
document alone; the MTP loss trains the depths and the shared embedding and head. Layouts (FSDP, TP,
EP, PP with two schedules, the chunked loss, compile + AC): scripts/parity_layouts.py's "DeepSeek-V3
MTP" rows; bad options: tests/test_bad_input.py; Hugging Face: tests/test_deepseek_v3.py."""

from dataclasses import replace
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from one_process import one_process_step

from torchtitan.config.parser import parse_args
from torchtitan.datasets.layout import IGNORE_INDEX, Batch
from torchtitan.models import MODEL_SPECS
from torchtitan.models.deepseek_v3 import deepseek_v3_configs
from torchtitan.models.documents import find_documents
from torchtitan.objective.mtp import mtp_targets

VOCAB, SEQ, EOS, DEPTHS, WEIGHT = 300, 32, 7, 2, 0.3
ARGS = replace(
    deepseek_v3_configs["debugmodel"],
    vocab_size=VOCAB,
    max_seq_len=SEQ,
    attn_mask_type="block_causal",
    eos_id=EOS,
    mtp_layers=DEPTHS,
)
X = IGNORE_INDEX
FP32 = ("--training.mixed_precision_param", "float32")


def weight(lam: float) -> tuple[str, ...]:
    """The MTP depths' weight (DeepSeek-V3's lambda) on the command line, the only term beside the
    language model's (no balance loss)."""
    model = ("--model.name", "deepseek_v3", "--model.flavor", "debugmodel")
    return (*model, "--model.mtp_loss_weight", str(lam), "--moe.aux_loss_weight", "0")


def test_targets_stay_inside_documents_and_the_window():
    """Depth k at i: token i+k in, label i+k (token i+k+1) out, only when i+k+1 is in i's document and the
    window; a label the data left untrained (chat prompts) stays untrained."""
    tokens = torch.tensor([[10, 11, 12, EOS, 20, 21, 22, 23]])
    labels = torch.tensor([[11, 12, EOS, 20, 21, X, 23, 24]])
    ids = find_documents(tokens, EOS, None)
    inputs, targets = mtp_targets(tokens, labels, ids, 2)
    assert inputs[0, :, 0].tolist() == [11, 12, 0, 0, 21, 22, 0, 0]
    assert targets[0, :, 0].tolist() == [12, EOS, X, X, X, 23, X, X]
    assert inputs[0, :, 1].tolist() == [12, 0, 0, 0, 22, 0, 0, 0]
    assert targets[0, :, 1].tolist() == [EOS, X, X, X, 23, X, X, X]
    # Without documents (causal) the window is one: only its tail has no target.
    _, targets = mtp_targets(tokens, labels, None, 1)
    assert targets[0, :, 0].tolist() == [12, EOS, 20, 21, X, 23, X, X]


def build() -> torch.nn.Module:
    with torch.device("meta"):
        model = MODEL_SPECS["deepseek_v3"].build(ARGS)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    return model


def packed_batches() -> list[Batch]:
    """Two micro-batches of 2 windows of documents of 1 to 12 tokens (each ending with EOS), the last
    one cut by the window."""
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(2):
        rows = []
        for _ in range(2):
            row = []
            while len(row) <= SEQ:
                length = int(torch.randint(1, 13, (1,), generator=generator))
                row += torch.randint(EOS + 1, VOCAB, (length - 1,), generator=generator).tolist() + [EOS]
            rows.append(row[: SEQ + 1])
        tokens = torch.tensor(rows)
        batches.append(Batch.of_windows(tokens))
    return batches


@torch.no_grad()
def oracle(model: torch.nn.Module, batches: list) -> list[float]:
    """Each depth's mean cross entropy over the targets of every document run alone: the main blocks on
    its tokens (causal, RoPE from 0), then depth k on its first L - k positions, fed the embeddings of its
    tokens k.. and the previous depth's states, scored against its tokens k+1.."""
    sums, counts = [0.0] * DEPTHS, [0] * DEPTHS
    for batch in batches:
        for row, ids in zip(batch.inputs, find_documents(batch.inputs, EOS, None)):
            for doc in ids.unique():
                tokens = row[ids == doc]
                h = model.tok_embeddings(tokens[None])
                for block in model.layers.values():
                    h = block(h, model.freqs_cis[: len(tokens)])
                for k, layer in enumerate(model.mtp.values(), start=1):
                    n = len(tokens) - k  # positions with a token k ahead
                    if n < 2:  # none with a target k + 1 ahead
                        break
                    x = torch.cat(
                        [layer.enorm(model.tok_embeddings(tokens[None, k:])), layer.hnorm(h[:, :n])], -1
                    )
                    h = layer.block(layer.eh_proj(x), model.freqs_cis[:n])
                    logits = model.output(layer.norm(h))[0, : n - 1]
                    sums[k - 1] += F.cross_entropy(logits, tokens[k + 1 :], reduction="sum").item()
                    counts[k - 1] += n - 1
    return [s / c for s, c in zip(sums, counts)]


def test_packed_loss_per_depth_equals_documents_alone():
    model = build()
    job = parse_args(
        ["--training.batch_size", "2", "--training.global_batch_size", "4", *FP32, *weight(WEIGHT)]
    )
    step = one_process_step(model, job)
    assert step.grad_accum_steps == 2
    batches = packed_batches()
    expected = oracle(model, batches)
    step.forward_backward(iter(batches))
    metrics = step.objective.step_done()
    got = [metrics[f"mtp_loss_{k}"].item() for k in range(1, DEPTHS + 1)]
    assert max(abs(a - b) for a, b in zip(got, expected)) < 1e-6, (got, expected)
    # The depths, the shared embedding table and head all get the MTP loss's gradient.
    for name in ("mtp.1.eh_proj.weight", "mtp.1.block.attention.wq_a.weight", "mtp.1.norm.weight"):
        assert model.get_parameter(name).grad.abs().sum() > 0, name
    assert step.objective.step_done()["mtp_loss_1"] == 0  # restarted


def test_the_weight_scales_the_depths_gradient():
    """lambda = 0 leaves the depths without gradient; the language model's logged loss is the same."""
    grads, losses = {}, {}
    for lam in (0.0, WEIGHT):
        model = build()
        job = parse_args(
            ["--training.batch_size", "2", "--training.global_batch_size", "2", *FP32, *weight(lam)]
        )
        step = one_process_step(model, job)
        losses[lam] = step.forward_backward(iter(packed_batches()))
        grads[lam] = model.get_parameter("mtp.0.eh_proj.weight").grad
    assert grads[0.0].abs().sum() == 0 and grads[WEIGHT].abs().sum() > 0
    assert losses[0.0] == losses[WEIGHT]


def test_context_parallel_ranks_get_their_shifted_tokens_from_the_whole_sequence():
    """Under context parallelism the shift is taken on whole sequences before they are dealt out: each
    rank's depth-k inputs and targets are the whole sequence's at its positions, those whose token k+1
    ahead another rank holds included (checked for every rank of CP 4, packed documents). The depths'
    attention under CP: docs/objectives.md."""
    from torchtitan.parallelisms.context_parallel import rows_positions, sequence_layouts

    model = build()
    job = parse_args(["--training.batch_size", "2", *FP32])
    inputs, labels = packed_batches()[0].inputs, packed_batches()[0].labels
    ids = find_documents(inputs, EOS, None)
    whole_inputs, whole_targets = mtp_targets(inputs, labels, ids, DEPTHS)
    layouts, crossing = sequence_layouts(SEQ, 4, ids), 0
    for rank in range(4):
        mesh = SimpleNamespace(size=lambda: 4, get_local_rank=lambda rank=rank: rank)
        step = one_process_step(model, job)
        step.cp_mesh = mesh
        _, rank_labels, kwargs = step._on_device(*step._prepare(Batch(inputs, labels)))
        positions = rows_positions(layouts, rank).expand(2, -1)
        held = set(positions[0].tolist())
        for k in range(DEPTHS):
            expected = whole_targets[..., k].gather(1, positions)
            assert torch.equal(rank_labels[..., k + 1], expected)
            assert torch.equal(kwargs["mtp_tokens"][..., k], whole_inputs[..., k].gather(1, positions))
            ahead = [p for p in held if p + k + 2 < SEQ and p + k + 2 not in held]
            crossing += sum(int((whole_targets[:, p, k] != IGNORE_INDEX).sum()) for p in ahead)
    assert crossing > 0  # targets another rank's tokens gave
