"""Context parallelism (parallelisms/context_parallel.py): how a sequence is split, each chunk's
attention (CPU's and CUDA's forms, causal and within documents), and CP 2 end to end on packed
documents (block_causal): the losses, gradient norms and validation losses of one process over 10 steps
at 256 tokens, a SIGKILL of both ranks relaunched bit for bit, and its checkpoint resumed by one
process within 1e-5. The other layouts (CP 4, CP x FSDP, CP x TP, PP x CP):
test_parity.py; a checkpoint of FSDP resumed by CP 2: test_qwen3_resume.py; every layout:
scripts/parity_matrix.py."""

import shutil
from dataclasses import replace

import pytest
import torch
from launch import TINY_JOB, losses, run_train
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from scripts import chaos
from scripts.parity_layouts import QWEN3_CP_CI_BLOCK, Layout, cp
from scripts.parity_matrix import run_layout
from torchtitan.models.documents import document_positions
from torchtitan.parallelisms.context_parallel import (
    chunked_causal_attention,
    chunked_document_attention,
    load_balanced_positions,
    lower_right_bias,
    rows_positions,
    sequence_layouts,
)


@pytest.mark.parametrize("cp_degree", [1, 2, 4])
def test_ranks_hold_every_position_once_with_equal_attention_work(cp_degree):
    seq_len = 64
    held = [load_balanced_positions(seq_len, cp_degree, rank).tolist() for rank in range(cp_degree)]
    assert sorted(p for positions in held for p in positions) == list(range(seq_len))
    # A causal query at position p attends to p + 1 keys.
    work = {sum(p + 1 for p in positions) for positions in held}
    assert len(work) == 1, work


@pytest.mark.parametrize("chunk, ends", [(8, [8, 32]), (8, [16, 24]), (5, [40]), (4, [4, 8, 12])])
def test_chunks_attend_to_every_earlier_key(chunk, ends):
    """Chunk i holds positions ends[i] - chunk .. ends[i] - 1: on CPU each attends by two fused attentions
    merged by log-sum-exp (no mask kept), equal in value and gradient to SDPA over the keys up to its end
    with the lower-right causal mask, chunk by chunk."""
    generator = torch.Generator().manual_seed(0)
    seq_len = max(ends)
    q = torch.randn(2, 4, chunk * len(ends), 16, generator=generator, requires_grad=True)
    k, v = (torch.randn(2, 4, seq_len, 16, generator=generator, requires_grad=True) for _ in range(2))

    def masked_sdpa(q, k, v, ends):
        outputs = [
            torch.nn.functional.scaled_dot_product_attention(
                q[:, :, i * chunk : (i + 1) * chunk],
                k[:, :, :end],
                v[:, :, :end],
                attn_mask=torch.ones(chunk, end, dtype=torch.bool).tril(end - chunk),
            )
            for i, end in enumerate(ends)
        ]
        return torch.cat(outputs, dim=2).transpose(1, 2)

    results = []
    for attention in (chunked_causal_attention, masked_sdpa):
        out = attention(q, k, v, ends)
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        (out * weights).sum().backward()
        results.append([out.detach(), q.grad, k.grad, v.grad])
        q.grad = k.grad = v.grad = None
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, atol=2e-6, rtol=0)


def _packed_ids(seq_len: int, lengths: list[int]) -> torch.Tensor:
    """Document ids of one row of documents of `lengths` (the last runs to the end of the sequence)."""
    ids = [torch.full((n,), i) for i, n in enumerate(lengths)]
    ids.append(torch.full((seq_len - sum(lengths),), len(lengths)))
    return torch.cat(ids)[None]


# Documents shorter than a chunk, ending on a chunk's edge, spanning chunks and ranks, or the whole row.
DOCUMENT_ROWS = [[3, 5, 1, 7, 20, 2], [8, 8, 30], [], [47, 1]]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("cp_degree", [2, 4])
def test_chunks_attend_within_their_documents(cp_degree):
    """block_causal under context parallelism: each rank's pieces (dealt out by their work), attending
    to the keys of the whole sequence on CPU (per document segment, merged by log-sum-exp), give the rows
    of the one-sequence CPU path (each document's own causal attention), in value and gradient;
    FlexAttention's block mask for the rank's query positions (CUDA's path) gives them too, forward (no
    CPU backward)."""
    from torch.nn.attention.flex_attention import flex_attention

    from torchtitan.models.documents import Documents, _segment_attention, block_causal_mask

    seq_len = 48
    ids = torch.cat([_packed_ids(seq_len, lengths) for lengths in DOCUMENT_ROWS])
    bs, generator = len(DOCUMENT_ROWS), torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(bs, 2, seq_len, 8, generator=generator, requires_grad=True) for _ in range(3))
    weights = torch.randn(bs, seq_len, 2, 8, generator=generator)
    whole = _segment_attention(q, k, v, ids)
    (whole * weights).sum().backward()
    expected_grads = [t.grad for t in (q, k, v)]

    grads = [torch.zeros_like(t) for t in (q, k, v)]
    for rank in range(cp_degree):
        layouts = sequence_layouts(seq_len, cp_degree, ids)
        positions = rows_positions(layouts, rank)  # each row's own
        rows_ends = [[(p + 1) * piece for p in held[rank]] for piece, held in layouts]
        rows = torch.arange(bs)[:, None]
        rank_q = q.detach().transpose(1, 2)[rows, positions].transpose(1, 2).requires_grad_()
        rank_k, rank_v = (t.detach().requires_grad_() for t in (k, v))
        out = chunked_document_attention(rank_q, rank_k, rank_v, rows_ends, Documents(ids))
        torch.testing.assert_close(out, whole.detach()[rows, positions], atol=2e-6, rtol=0)
        (out * weights[rows, positions]).sum().backward()
        grads[0].transpose(1, 2)[rows, positions] += rank_q.grad.transpose(1, 2)
        grads[1] += rank_k.grad
        grads[2] += rank_v.grad

        mask = block_causal_mask(ids, positions)
        flex = flex_attention(rank_q.detach(), k.detach(), v.detach(), block_mask=mask).transpose(1, 2)
        torch.testing.assert_close(flex, out.detach(), atol=1e-5, rtol=0)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, atol=2e-6, rtol=0)


@pytest.mark.parametrize("cp_degree", [2, 4, 8])
def test_documents_are_dealt_out_by_their_attention_work(cp_degree):
    """block_causal: a long document then short ones, where head-tail chunks leave the ranks holding the
    long document's end with most of the work; dealt out in pieces (each row its own), every rank holds
    the same number of tokens, every position once, and the same work within 1.1x."""
    seq_len = 8192  # pieces of FlexAttention's 128-token blocks at least: 4 to 8 of them per chunk
    ids = torch.cat([_packed_ids(seq_len, [5600, *[48] * 50]), _packed_ids(seq_len, [240] * 30)])
    work = document_positions(ids) + 1
    layouts = sequence_layouts(seq_len, cp_degree, ids)
    held = [rows_positions(layouts, rank) for rank in range(cp_degree)]  # (rows, rank's tokens)
    for row in range(len(ids)):
        assert sorted(torch.cat([positions[row] for positions in held]).tolist()) == list(range(seq_len))
    rows = torch.arange(len(ids))[:, None]
    dealt = [int(work[rows, positions].sum()) for positions in held]
    causal = [load_balanced_positions(seq_len, cp_degree, rank) for rank in range(cp_degree)]
    head_tail = [int(work[:, positions].sum()) for positions in causal]
    assert max(head_tail) / min(head_tail) > 2 and max(dealt) / min(dealt) < 1.1, (head_tail, dealt)


def test_chunks_attend_in_autocasts_dtype():
    """Mixed precision: fp32 queries and keys (Qwen3's q/k norms keep fp32) with bf16 values attend in
    bf16, as SDPA does under autocast."""
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, 16, 8, generator=generator) for _ in range(2))
    v = torch.randn(1, 2, 16, 8, generator=generator).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = chunked_causal_attention(q, k, v, [8, 16])
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    assert out.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(out, want, atol=1e-2, rtol=0)


def test_the_cuda_bias_is_that_mask_and_is_made_under_selective_checkpointing():
    """CUDA's lower-right causal bias (fused kernels), made inside selective AC's dispatch mode."""
    with create_selective_checkpoint_contexts(lambda *args, **kwargs: CheckpointPolicy.PREFER_RECOMPUTE)[0]:
        bias = lower_right_bias(4, 12)
    expected = torch.ones(4, 12, dtype=torch.bool).tril(8)
    assert torch.equal(bias._materialize(torch.device("cpu")), expected)


def test_cp_blocks_compile_whole_with_the_flex_attention_path(monkeypatch):
    """The 128K recipe's combination (CP, block_causal, compiled blocks) on its CUDA path: the rank's
    layout and block mask are made before the blocks, which then compile whole (fullgraph) and equal
    the model without CP. One rank (gloo), forward on the CPU, the path forced (no CPU backward),
    dynamo only (aot_eager)."""
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan.models import documents
    from torchtitan.models.llama import ModelArgs
    from torchtitan.models.llama.model import Transformer
    from torchtitan.parallelisms import context_parallel
    from torchtitan.parallelisms.context_parallel import apply_cp

    for module in (documents, context_parallel):
        monkeypatch.setattr(module, "uses_flex_attention", lambda device: True)
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=1024)
    reference = Transformer(replace(args, attn_mask_type="block_causal", eos_id=2))
    reference.init_weights(0)
    tokens = torch.randint(3, 64, (2, 1024), generator=torch.Generator().manual_seed(0))
    tokens[:, [100, 130, 600]], tokens[1, 900] = 2, 2
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = copy.deepcopy(reference)
        apply_cp(model, init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))["cp"])
        made = []
        model.layers["0"].register_forward_pre_hook(
            lambda _, args: made.append(sorted(map(str, args[2].cache)))
        )
        document_ids = documents.find_documents(tokens, 2, None)
        with torch.no_grad():
            eager = model(tokens, document_ids=document_ids)
            assert made == [["('block mask', 'cp')", "('cp layouts', 1)"]]
            for layer_id, block in model.layers.items():
                model.layers.register_module(
                    layer_id, torch.compile(block, fullgraph=True, backend="aot_eager")
                )
            torch.testing.assert_close(model(tokens, document_ids=document_ids), eager, rtol=0, atol=1e-6)
            torch.testing.assert_close(eager, reference(tokens), rtol=0, atol=1e-5)
    finally:
        dist.destroy_process_group()


CHECKPOINTS = ("--checkpoint.enable_checkpoint", "true", "--checkpoint.interval", "2")
# On packed documents attending within themselves (block_causal), as CP 4 and CP 2 x TP 2 in test_parity.py.
CP2 = Layout("Qwen3 untied, 256 tokens, block_causal: CP 2", 2, 4, 4, cp(2) + CHECKPOINTS, QWEN3_CP_CI_BLOCK)


def test_cp2_matches_one_process_and_resumes_exactly(tmp_path, reference_run):
    straight, killed, one = (tmp_path / name for name in ("straight", "killed", "one"))
    result = run_layout(CP2, straight, 10, reference_run(CP2.global_batch, CP2.model))
    assert result.error is None, result.error
    assert result.max_loss_diff <= 1e-5 and result.max_grad_norm_diff <= 1e-5, result
    assert result.max_validation_diff <= 1e-5 and result.step1_loss_diff <= 1e-6, result
    straight_losses = losses(straight)

    # Killed with SIGKILL (both ranks) once step 6 is saved, relaunched: the same losses, bit for bit.
    shutil.copytree(straight / "checkpoint" / "step-4", killed / "checkpoint" / "step-4")
    argv = [*TINY_JOB, *CP2.argv(10)]
    chaos.kill_once_saved(chaos.Job(2, killed, *argv), killed, 6)
    relaunch = chaos.Job(2, killed, *argv)
    assert relaunch.wait(300) == [0, 0], relaunch.output(0)[-3000:]
    assert "Resumed from step 6" in relaunch.output(0)
    logged = chaos.losses(killed)  # both launches'
    assert sorted({step for step, _ in logged}) == list(range(5, 11))
    assert [loss for _, loss in logged] == [straight_losses[step] for step, _ in logged]

    # CP 2's step 6 resumed by one process (the whole sequences, batch 4).
    shutil.copytree(straight / "checkpoint" / "step-6", one / "checkpoint" / "step-6")
    single = Layout("one process", 1, 4, 4, CHECKPOINTS, QWEN3_CP_CI_BLOCK)
    result = run_train(1, one, *single.argv(10))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Resumed from step 6" in result.stdout
    resumed = losses(one)
    assert sorted(resumed) == [7, 8, 9, 10]
    for step, loss in resumed.items():
        assert abs(loss - straight_losses[step]) < 1e-5, (step, loss, straight_losses[step])


def _mla_worker(rank: int, world_size: int, tmp_dir: str) -> None:
    """DeepSeek-V3's debug model (MLA, block_causal) on CP 2 against one process, one forward and
    backward of each rank's tokens: with its latents gathered (the default) and with every head's keys
    and values gathered; the gradients averaged over the cp ranks, as FSDP averages them."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from scripts.benchmarks.context_parallel import GatheredBytes
    from torchtitan.models.deepseek_v3 import deepseek_v3_configs
    from torchtitan.models.deepseek_v3.model import Transformer
    from torchtitan.models.documents import find_documents
    from torchtitan.parallelisms.context_parallel import apply_cp, shard_sequence

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp_dir}/store", rank=rank, world_size=world_size)
    try:
        seq_len, eos = 64, 2
        args = replace(
            deepseek_v3_configs["debugmodel"],
            n_layers=2,
            vocab_size=64,
            max_seq_len=seq_len,
            attn_mask_type="block_causal",
            eos_id=eos,
        )
        tokens = torch.randint(3, 64, (2, seq_len + 1), generator=torch.Generator().manual_seed(0))
        tokens[0, [5, 9, 40]], tokens[1, 30] = eos, eos  # documents across chunks, different per row
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        document_ids = find_documents(inputs, eos, None)

        def run(model, inputs, labels):
            loss = F.cross_entropy(model(inputs, document_ids=document_ids).flatten(0, 1), labels.flatten())
            loss.backward()
            return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

        reference = Transformer(args)
        reference.init_weights(0)
        results = {"one process": run(reference, inputs, labels)}
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))["cp"]
        layouts = sequence_layouts(seq_len, 2, document_ids)
        for kind in ("latent", "per_head"):
            model = Transformer(args)
            model.init_weights(0)
            apply_cp(model, mesh, gather_latents=kind == "latent")
            with GatheredBytes() as counted:
                loss, grads = run(model, *(shard_sequence(t, mesh, layouts) for t in (inputs, labels)))
            for t in (loss, *grads.values()):
                dist.all_reduce(t)
                t.div_(2)
            results[kind] = (loss, grads, counted.bytes)
        if rank == 0:
            torch.save(results, f"{tmp_dir}/results.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def mla_results(tmp_path_factory):
    from launch import spawn_forked

    tmp_dir = tmp_path_factory.mktemp("mla_cp2")
    spawn_forked(_mla_worker, 2, 2, str(tmp_dir))
    return torch.load(tmp_dir / "results.pt", weights_only=False)


@pytest.mark.parametrize("kind", ["latent", "per_head"])
def test_mla_under_cp_gathers_its_latents_and_matches_one_process(mla_results, kind):
    """Multi-head latent attention on CP 2 (packed documents across the ranks' pieces): the loss and
    every gradient of one process, the RoPE key rotated by its true positions; the latents' path
    all-gathers kv_lora_rank + qk_rope_head_dim features per token and layer (48 in fp32 on the debug
    model), the per-head path every head's key and value (4 x (48 + 32)), counted on the collectives."""
    want_loss, want_grads = mla_results["one process"]
    loss, grads, gathered = mla_results[kind]
    torch.testing.assert_close(loss, want_loss, rtol=0, atol=1e-6)
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=0, atol=2e-6, msg=name)
    features = 32 + 16 if kind == "latent" else 4 * ((32 + 16) + 32)
    assert gathered == 2 * 2 * 64 * features * 4  # layers x rows x tokens x features x fp32 bytes
