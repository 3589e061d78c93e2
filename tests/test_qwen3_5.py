"""Qwen3.5's token mixers (torchtitan/models/qwen3_5/): Gated DeltaNet and the gated attention equal
transformers' layers (`Qwen3_5GatedDeltaNet`, `Qwen3_5Attention`, on its PyTorch path: fla and
causal_conv1d not installed) with the same weights, in float32 within 1e-5; packed documents
(block_causal) equal each document run alone, in transformers within 1e-4 and in our own layer in float64
within 1e-12, gradients too, each document's first tokens checked on their own (a state or conv window
leaking from the previous document shows there and nowhere else)."""

import importlib.util
import inspect
import json

import pytest
import torch

from torchtitan.models.documents import Documents, document_positions
from torchtitan.models.llama.model import precompute_freqs_cis
from torchtitan.models.qwen3_5 import Qwen35ModelArgs
from torchtitan.models.qwen3_5.attention import GatedAttention
from torchtitan.models.qwen3_5.gated_deltanet import GatedDeltaNet, grouped_by_key_head

modeling = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

# Tiny, every path on: GQA (4 query heads, 2 kv), 2 key heads serving 4 value heads, dk != dv, RoPE on 8
# of 32 features.
ARGS = Qwen35ModelArgs(
    dim=64,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    head_dim=32,
    linear_n_key_heads=2,
    linear_n_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    hidden_dim=96,
    vocab_size=128,
    max_seq_len=256,
)
ATTENTION_NAMES = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj"}
# A packed row: a document across the first chunk boundary (64), one shorter than the conv, the rest.
DOCUMENTS = [70, 2, 78]
LENGTH = sum(DOCUMENTS)


def hf_config() -> object:
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        hidden_size=ARGS.dim,
        num_hidden_layers=ARGS.n_layers,
        num_attention_heads=ARGS.n_heads,
        num_key_value_heads=ARGS.n_kv_heads,
        head_dim=ARGS.head_dim,
        linear_num_key_heads=ARGS.linear_n_key_heads,
        linear_num_value_heads=ARGS.linear_n_value_heads,
        linear_key_head_dim=ARGS.linear_key_head_dim,
        linear_value_head_dim=ARGS.linear_value_head_dim,
        linear_conv_kernel_dim=ARGS.linear_conv_kernel,
        intermediate_size=ARGS.hidden_dim,
        vocab_size=ARGS.vocab_size,
        rms_norm_eps=ARGS.norm_eps,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": ARGS.rope_theta,
            "partial_rotary_factor": 0.25,
        },
    )


def randomise_(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter random (norm weights too, so that w and 1 + w differ): matrices of std
    fan_in^-0.5 (outputs of unit scale), the rest 0.5."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            std = param.shape[1] ** -0.5 if param.ndim == 2 else 0.5
            param.copy_(torch.randn(param.shape, generator=generator) * std)
    return module


def hidden(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, length, ARGS.dim, generator=torch.Generator().manual_seed(seed))


def packed_ids(batch: int = 2) -> torch.Tensor:
    """Document ids of `batch` rows packed as DOCUMENTS (the second row in the reverse order)."""
    rows = [DOCUMENTS, DOCUMENTS[::-1]][:batch]
    return torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows])


def spans(row: int) -> list[tuple[int, int]]:
    sizes = [DOCUMENTS, DOCUMENTS[::-1]][row]
    bounds = torch.tensor([0, *sizes]).cumsum(0).tolist()
    return list(zip(bounds[:-1], bounds[1:]))


def test_transformers_runs_its_pytorch_path():
    """The oracle is transformers' own PyTorch code: with fla or causal_conv1d importable it would run
    their kernels instead (and could not run on the CPU)."""
    assert importlib.util.find_spec("fla") is None and importlib.util.find_spec("causal_conv1d") is None
    for function in (modeling.torch_chunk_gated_delta_rule, modeling.causal_conv1d_fn):
        assert inspect.getclosurevars(function).nonlocals["is_new_implementation"] is False


# Gated DeltaNet


def gated_deltanets() -> tuple[GatedDeltaNet, torch.nn.Module]:
    ours = randomise_(GatedDeltaNet(ARGS))
    theirs = modeling.Qwen3_5GatedDeltaNet(hf_config(), layer_idx=0)
    # The same names; in_proj_qkv's rows and the conv's channels in transformers' order.
    state, n_k, dk = ours.state_dict(), ARGS.linear_n_key_heads, ARGS.linear_key_head_dim
    for name in ("in_proj_qkv.weight", "conv1d.weight"):
        state[name] = grouped_by_key_head(state[name], n_k, dk, inverse=True)
    theirs.load_state_dict(state)
    return ours, theirs


def test_gated_deltanet_equals_transformers():
    ours, theirs = gated_deltanets()
    x = hidden(2, LENGTH)
    with torch.no_grad():
        assert (ours(x) - theirs(x)).abs().max() < 1e-5


def test_in_proj_qkv_rows_are_grouped_by_key_head_and_convert_back_bit_exact():
    """What tensor parallelism's plain split of rows relies on: each key head's block of our rows is its
    q, its k and the v of the value heads it serves (transformers': every q, every k, every v); the
    conv's channels (3-d) likewise; back to transformers' order exactly."""
    n_k, dk, value_width = 2, 3, 4  # 2 value heads of 2 per key head
    hf = torch.arange(2 * n_k * dk + n_k * value_width).view(-1, 1, 1).expand(-1, 1, 4)
    q, k, v = hf.split([n_k * dk, n_k * dk, n_k * value_width])
    ours = grouped_by_key_head(hf, n_k, dk)
    for head, rows in enumerate(ours.chunk(n_k)):  # a TP rank's share at TP n_k
        heads = [q[head * dk : (head + 1) * dk], k[head * dk : (head + 1) * dk]]
        assert rows.equal(torch.cat([*heads, v[head * value_width : (head + 1) * value_width]])), head
    assert grouped_by_key_head(ours, n_k, dk, inverse=True).equal(hf)


def test_gated_deltanet_packed_documents_equal_each_alone_in_transformers():
    """Each document of a packed row equals transformers' layer run on it alone within 1e-4, its first
    three tokens (those a leaking conv window or state would change) within it too."""
    ours, theirs = gated_deltanets()
    x = hidden(2, LENGTH)
    with torch.no_grad():
        out = ours(x, documents=Documents(packed_ids()))
        for row in range(2):
            for start, end in spans(row):
                alone = theirs(x[row : row + 1, start:end])[0]
                first = min(3, end - start)
                assert (out[row, start : start + first] - alone[:first]).abs().max() < 1e-4, (row, start)
                assert (out[row, start:end] - alone).abs().max() < 1e-4, (row, start)


@pytest.fixture
def float64():
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(default)


def test_gated_deltanet_packed_documents_are_exact_with_gradients(float64):
    """In float64 (training.float64), packed equals alone within 1e-12, and the packed row's parameter
    gradients equal the sum of each document's alone within 1e-10: no NaN from the resets."""
    layer = randomise_(GatedDeltaNet(ARGS))
    x = hidden(1, LENGTH)
    out = layer(x, documents=Documents(packed_ids(1)))
    out.square().sum().backward()
    packed_grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
    layer.zero_grad()
    for start, end in spans(0):
        alone = layer(x[:, start:end])
        assert (out[:, start:end] - alone).abs().max() < 1e-12, start
        alone.square().sum().backward()
    for name, param in layer.named_parameters():
        assert torch.isfinite(packed_grads[name]).all(), name
        assert (packed_grads[name] - param.grad).abs().max() < 1e-10, name


# Context parallelism, two ranks faked on one process: a thread each, the all-gather a barrier.


class FakeCpGroup:
    """Rank `rank` of `size` ranks run as threads: the cp mesh's size and rank, and the group that
    context_parallel.py's all-gather is given."""

    def __init__(self, rank: int, size: int, exchange: dict, barrier: object) -> None:
        self.rank, self._size, self.exchange, self.barrier = rank, size, exchange, barrier

    def size(self) -> int:
        return self._size

    def get_local_rank(self) -> int:
        return self.rank


def fake_all_gather_single(x: torch.Tensor, gather_dim: int, group: FakeCpGroup) -> torch.Tensor:
    """Every rank's x concatenated in rank order, autograd through the threads' joint graph."""
    group.exchange[group.rank] = x
    group.barrier.wait()
    gathered = torch.cat([group.exchange[r] for r in range(group.size())], dim=gather_dim)
    group.barrier.wait()  # everyone read before the next gather overwrites
    return gathered


# Two rows of 160 tokens: a document starting at a piece's first token (70; pieces of 5 tokens), one
# shorter than the conv (2), documents across pieces and ranks.
CP_DOCUMENTS = [[70, 2, 78, 10], [3, 100, 57]]


@pytest.mark.parametrize("block_causal", [False, True])
def test_gated_deltanet_under_context_parallelism_equals_one_rank(float64, monkeypatch, block_causal):
    """Context parallelism's Gated DeltaNet (parallelisms/context_parallel_deltanet.py) on 2 faked ranks:
    each rank's pieces from zero states, the states chained and the conv's halo gathered, equal the layer
    on the whole sequence within 1e-12 in float64, and the gradients (input and parameters, summed over
    the ranks) within 1e-10. Causal: head-tail chunks (rank 0 holds chunks 0 and 3); block_causal: 8
    pieces of 5 tokens per chunk (MIN_PIECE lowered) dealt out by work, out of order."""
    import copy
    import threading
    import types
    from concurrent.futures import ThreadPoolExecutor

    from torchtitan.parallelisms import context_parallel
    from torchtitan.parallelisms.context_parallel_deltanet import ContextParallelDeltaNet

    monkeypatch.setattr(
        context_parallel, "funcol", types.SimpleNamespace(all_gather_single=fake_all_gather_single)
    )
    monkeypatch.setattr(context_parallel, "MIN_PIECE", 4)
    cp, length = 2, 160
    ids = torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in CP_DOCUMENTS])
    layer = randomise_(GatedDeltaNet(ARGS))
    x = hidden(2, length).requires_grad_()
    weights = hidden(2, length, seed=2)
    whole = layer(x, documents=Documents(ids) if block_causal else None)
    (whole * weights).sum().backward()
    expected_grads = {"x": x.grad.clone(), **{n: p.grad.clone() for n, p in layer.named_parameters()}}
    x.grad = None
    exchange, barrier = {}, threading.Barrier(cp)
    ranks = [copy.deepcopy(layer) for _ in range(cp)]
    for rank, module in enumerate(ranks):
        module.zero_grad()
        module.sequence = ContextParallelDeltaNet(FakeCpGroup(rank, cp, exchange, barrier))
    layouts = context_parallel.sequence_layouts(length, cp, ids if block_causal else None)
    assert block_causal == (layouts[0][0] == 5)

    def run(rank: int) -> torch.Tensor:
        positions = context_parallel.rows_positions(layouts, rank).expand(2, -1)
        local = x.gather(1, positions[..., None].expand(-1, -1, ARGS.dim))
        return ranks[rank](local, documents=Documents(ids) if block_causal else None)

    with ThreadPoolExecutor(cp) as pool:
        outs = list(pool.map(run, range(cp)))
    out = torch.zeros_like(whole)
    for rank, local in enumerate(outs):
        positions = context_parallel.rows_positions(layouts, rank).expand(2, -1)
        out = out.scatter(1, positions[..., None].expand(-1, -1, ARGS.dim), local)
    assert (out - whole).abs().max() < 1e-12
    (out * weights).sum().backward()
    assert (x.grad - expected_grads.pop("x")).abs().max() < 1e-10
    for name, expected in expected_grads.items():
        got = sum(module.get_parameter(name).grad for module in ranks)
        assert (got - expected).abs().max() < 1e-10, name


# Gated attention


def gated_attentions() -> tuple[GatedAttention, torch.nn.Module]:
    ours = randomise_(GatedAttention(ARGS))
    theirs = modeling.Qwen3_5Attention(hf_config(), layer_idx=3)
    state = {}
    for name, tensor in ours.state_dict().items():
        module, _, rest = name.partition(".")
        state[f"{ATTENTION_NAMES.get(module, module)}.{rest}"] = tensor
    theirs.load_state_dict(state)
    return ours, theirs


def transformers_attention(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """transformers' attention on `x` (batch, length, dim) from position 0 (eager, an explicit causal
    mask), its RoPE Qwen3.5's multimodal one on text positions."""
    length = x.shape[1]
    positions = torch.arange(length).expand(x.shape[0], length)
    cos_sin = modeling.Qwen3_5TextRotaryEmbedding(hf_config())(x, positions)
    mask = torch.full((length, length), float("-inf")).triu(1)[None, None]
    return layer(x, position_embeddings=cos_sin, attention_mask=mask)[0]


def rope_table() -> torch.Tensor:
    return precompute_freqs_cis(ARGS.rotary_dim, ARGS.max_seq_len, ARGS.rope_theta)


def test_gated_attention_equals_transformers():
    ours, theirs = gated_attentions()
    x = hidden(2, LENGTH)
    with torch.no_grad():
        assert (ours(x, rope_table()) - transformers_attention(theirs, x)).abs().max() < 1e-5


def test_gated_attention_packed_documents_equal_each_alone_in_transformers():
    ours, theirs = gated_attentions()
    x = hidden(2, LENGTH)
    ids = packed_ids()
    with torch.no_grad():
        out = ours(x, rope_table()[document_positions(ids)], documents=Documents(ids))
        for row in range(2):
            for start, end in spans(row):
                alone = transformers_attention(theirs, x[row : row + 1, start:end])[0]
                assert (out[row, start:end] - alone).abs().max() < 1e-4, (row, start)


# The model, through the Hugging Face converter


def hf_model(tied: bool) -> torch.nn.Module:
    """A random transformers Qwen3_5ForCausalLM of ARGS' shape (three Gated DeltaNet layers, then one
    attention layer), every parameter drawn (norm weights too), small enough that float32's rounding,
    which grows with the activations through the layers, stays under 1e-5 in logits of std ~0.5."""
    from transformers import Qwen3_5ForCausalLM

    config = hf_config()
    config.tie_word_embeddings = tied
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05 if p.ndim > 1 else 0.5)
    return model


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_from_hf_matches_transformers_and_round_trips_bit_exact(tmp_path, tied):
    """transformers' model -> its folder -> DCP (scripts/convert_hf_to_dcp.py) -> ours: the same logits
    within 1e-5; packed documents (block_causal) each equal transformers' on the document alone within
    1e-4 (checked once, tied); -> HF again (scripts/convert_dcp_to_hf.py): the same files, bit for bit,
    which transformers loads as a Qwen3_5ForCausalLM with the same logits."""
    from dataclasses import replace

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from scripts import convert_dcp_to_hf, convert_hf_to_dcp
    from torchtitan.checkpoint.load import read_model_weights
    from torchtitan.models import MODEL_SPECS

    theirs = hf_model(tied)
    theirs.save_pretrained(tmp_path / "hf")
    convert_hf_to_dcp.convert(str(tmp_path / "hf"), str(tmp_path / "dcp"))
    weights = read_model_weights(str(tmp_path / "dcp"))
    args = replace(ARGS, tie_word_embeddings=tied, attn_mask_type="block_causal", eos_id=0)
    ours = MODEL_SPECS["qwen3_5"].build(replace(args, attn_mask_type="causal")).eval()
    assert weights.keys() == ours.state_dict().keys()
    ours.load_state_dict(weights)
    packed = MODEL_SPECS["qwen3_5"].build(args).eval()
    packed.load_state_dict(weights)

    tokens = torch.randint(1, ARGS.vocab_size, (2, LENGTH), generator=torch.Generator().manual_seed(1))
    for row in range(2):
        for _, end in spans(row):
            tokens[row, end - 1] = args.eos_id  # each document ends with its EOS
    with torch.no_grad():
        assert (ours(tokens) - theirs(tokens).logits).abs().max() < 1e-5
        out = packed(tokens)
        for row in range(2 if tied else 0):  # once is enough
            for start, end in spans(row):
                alone = theirs(tokens[row : row + 1, start:end]).logits[0]
                first = min(3, end - start)
                assert (out[row, start : start + first] - alone[:first]).abs().max() < 1e-4, (row, start)
                assert (out[row, start:end] - alone).abs().max() < 1e-4, (row, start)

    convert_dcp_to_hf.convert(
        str(tmp_path / "dcp"), str(tmp_path / "back"), replace(ARGS, tie_word_embeddings=tied), name="qwen3_5"
    )
    files, back = (
        load_file(tmp_path / "hf" / "model.safetensors"),
        load_file(tmp_path / "back" / "model.safetensors"),
    )
    assert back.keys() == files.keys()
    for name, w in files.items():
        assert torch.equal(back[name], w), name
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (config["architectures"], config["model_type"]) == (["Qwen3_5ForCausalLM"], "qwen3_5_text")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32).eval()
    assert type(exported).__name__ == "Qwen3_5ForCausalLM"
    with torch.no_grad():
        assert (ours(tokens) - exported(tokens).logits).abs().max() < 1e-5


def test_debugmodel_builds_on_meta_and_initialises():
    """The debug flavour, built on the meta device and initialised as train.py does: every parameter
    drawn once (seeded_init checks it), the zero-centred norms at 0 (a scale of 1), A = e^A_log in
    [0.01, 16), dt_bias 1; layers 0-2 Gated DeltaNet, layer 3 attention; a first loss near ln(vocab)."""
    from dataclasses import replace

    from torchtitan.models import MODEL_SPECS
    from torchtitan.models.qwen3_5 import qwen3_5_configs

    args = replace(qwen3_5_configs["debugmodel"], vocab_size=512, max_seq_len=96)
    with torch.device("meta"):
        model = MODEL_SPECS["qwen3_5"].build(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    kinds = [type(block.attention).__name__ for block in model.layers.values()]
    assert kinds == ["GatedDeltaNet"] * 3 + ["GatedAttention"]
    assert (model.norm.weight == 0).all() and (model.layers["3"].attention.q_norm.weight == 0).all()
    deltanet = model.layers["0"].attention
    assert ((deltanet.A_log.exp() >= 0.01) & (deltanet.A_log.exp() < 16)).all()
    assert (deltanet.dt_bias == 1).all() and (deltanet.norm.weight == 1).all()
    tokens = torch.randint(0, 512, (2, 96), generator=torch.Generator().manual_seed(0))
    loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    assert abs(loss.item() - torch.log(torch.tensor(512.0)).item()) < 0.5


def test_flops_count_the_delta_rule_and_only_the_attention_layers_scores():
    """MFU's FLOPs: the dense formula's scores for the one attention layer of the debug model, and for
    its three Gated DeltaNet layers the chunked rule's products (4 value heads of 32, chunk 64), counted
    by hand; with every layer attention, the dense formula exactly."""
    from dataclasses import replace

    from torchtitan.models.qwen3_5 import qwen3_5_configs, qwen3_5_flops_per_token
    from torchtitan.models.spec import flops_per_token

    args = qwen3_5_configs["debugmodel"]
    per_head = 4 * 64 * 32 + 64 * 64 + 2 * 64 * 32 + 6 * 32 * 32  # k k^T, q k^T; solves; in-chunk; state
    expected = 6 * 1000 + 12 * 1 * 4 * 64 * 2048 + 3 * 3 * 4 * per_head
    assert qwen3_5_flops_per_token(args, 1000, 2048) == expected
    every_layer_attention = replace(args, layer_types=("full_attention",) * 4)
    assert qwen3_5_flops_per_token(every_layer_attention, 1000, 2048) == flops_per_token(1000, 4, 4, 64, 2048)


def test_context_parallel_runs_or_refuses_chunks_shorter_than_the_conv_halo():
    """Context parallelism chains Gated DeltaNet's pieces (the preflight lets it through), but a chunk of
    seq_len / (2 x CP) tokens shorter than the conv's 3-token halo cannot be split: one line, before
    any worker."""
    from torchtitan.config.options import ConfigError
    from torchtitan.config.parser import parse_args
    from torchtitan.config_rules import check_layout

    cp_2 = ["--model.name", "qwen3_5", "--parallelism.context_parallel_degree", "2"]
    check_layout(parse_args(cp_2), world_size=2)
    check_layout(parse_args([*cp_2, "--training.seq_len", "12"]), world_size=2)
    with pytest.raises(
        ConfigError, match="parallelism.context_parallel_degree: 2 cuts training.seq_len 8 into"
    ):
        check_layout(parse_args([*cp_2, "--training.seq_len", "8"]), world_size=2)


def test_tensor_parallel_splits_whole_key_heads_or_is_refused():
    """TP gives each rank whole key heads (and the value heads they serve): a degree that divides the
    attention's heads but not Gated DeltaNet's key heads is refused, naming every count; the debug
    flavour splits over 2 (its TP runs: tests/test_parity.py)."""
    from dataclasses import replace

    from torchtitan.config.options import ConfigError
    from torchtitan.config.parser import parse_args
    from torchtitan.config_rules import check_parallelism, parallel_dims_of
    from torchtitan.models.qwen3_5 import qwen3_5_configs

    job = parse_args(["--model.name", "qwen3_5", "--parallelism.tensor_parallel_degree", "2"])
    dims, debug = parallel_dims_of(job, world_size=2), qwen3_5_configs["debugmodel"]
    check_parallelism(job, dims, debug)
    one_key_head = replace(debug, linear_n_key_heads=1, linear_n_value_heads=2)
    message = (
        "parallelism.tensor_parallel_degree: 2 does not divide the model's 4 attention heads, 2 kv heads, "
        "1 linear-attention key heads and 2 value heads; choose a common divisor"
    )
    with pytest.raises(ConfigError, match=f"^{message}$"):
        check_parallelism(job, dims, one_key_head)


def test_layer_types_of_another_depth_are_refused_in_one_line(monkeypatch, tmp_path, capsys):
    """A flavour listing its layer_types, run on another depth (model.n_layers: the tests' tiny job has 2
    blocks), would build blocks with no kind: refused before any work, exit 2, one line; an unknown
    kind too."""
    from dataclasses import replace

    from launch import TINY_JOB, run_train_in_process

    from torchtitan.config.options import ConfigError
    from torchtitan.models.qwen3_5 import qwen3_5_configs

    listed = replace(
        qwen3_5_configs["debugmodel"], layer_types=("linear_attention",) * 3 + ("full_attention",)
    )
    monkeypatch.setitem(qwen3_5_configs, "listed", listed)
    job = [
        "--model.name",
        "qwen3_5",
        "--model.flavor",
        "listed",
        "--model.tokenizer_path",
        "assets/tokenizer/kjv_bpe_hf",
    ]
    code = run_train_in_process(*TINY_JOB, *job, "--job.dump_folder", str(tmp_path / "dump"))
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(
        "error: model.n_layers: 2 blocks, but the flavour lists 4 layer_types; set model.n_layers to 4 "
        "(or 0, the flavour's depth)"
    ), err
    assert not (tmp_path / "dump").exists()
    with pytest.raises(ConfigError, match="^model.flavor: its layer_types holds 'mamba'; each is"):
        replace(listed, layer_types=("linear_attention", "mamba") * 2)


# Qwen3.5-MoE (model.name qwen3_5_moe): ARGS' token mixers, a mixture of experts in every layer.

MOE_SIZES = dict(num_experts=8, top_k=2, moe_hidden_dim=24, shared_hidden_dim=40)


def moe_args(**changes: object) -> object:
    from dataclasses import asdict

    from torchtitan.models.qwen3_5_moe import Qwen35MoeModelArgs

    return Qwen35MoeModelArgs(**{**asdict(ARGS), **MOE_SIZES, **changes})


def hf_moe_model() -> torch.nn.Module:
    """A random transformers Qwen3_5MoeForCausalLM of ARGS' shape with 8 experts of which each token
    takes 2 and the gated shared expert, every parameter drawn (the router's too, so that the choices
    are clear-cut, and the shared expert's gate, so that it scales)."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    dense = hf_config().to_dict()
    for key in ("intermediate_size", "model_type", "architectures", "transformers_version"):
        dense.pop(key, None)
    config = Qwen3_5MoeTextConfig(
        **{**dense, "tie_word_embeddings": False},
        num_experts=MOE_SIZES["num_experts"],
        num_experts_per_tok=MOE_SIZES["top_k"],
        moe_intermediate_size=MOE_SIZES["moe_hidden_dim"],
        shared_expert_intermediate_size=MOE_SIZES["shared_hidden_dim"],
    )
    torch.manual_seed(0)
    model = Qwen3_5MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            std = 1.0 if name.endswith("mlp.gate.weight") else 0.05 if p.ndim > 1 else 0.5
            p.normal_(0.0, std)
    return model


def test_moe_from_hf_matches_transformers_and_round_trips_bit_exact(tmp_path):
    """transformers' Qwen3_5MoeForCausalLM -> its folder (one Linear per expert) -> DCP -> ours: the same
    logits within 1e-5; packed documents each equal transformers' on the document alone within 1e-4 (the
    first three tokens too); -> HF again after 0 steps: the same files bit for bit, which transformers
    loads as a Qwen3_5MoeForCausalLM with the same logits."""

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from scripts import convert_dcp_to_hf, convert_hf_to_dcp
    from torchtitan.checkpoint.load import read_model_weights
    from torchtitan.models import MODEL_SPECS

    theirs = hf_moe_model()
    theirs.save_pretrained(tmp_path / "hf")
    files = load_file(tmp_path / "hf" / "model.safetensors")
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in files  # per expert on disk
    convert_hf_to_dcp.convert(str(tmp_path / "hf"), str(tmp_path / "dcp"))
    weights = read_model_weights(str(tmp_path / "dcp"))
    spec = MODEL_SPECS["qwen3_5_moe"]
    ours = spec.build(moe_args()).eval()
    assert weights.keys() == ours.state_dict().keys()
    ours.load_state_dict(weights)
    packed = spec.build(moe_args(attn_mask_type="block_causal", eos_id=0)).eval()
    packed.load_state_dict(weights)

    tokens = torch.randint(1, ARGS.vocab_size, (2, LENGTH), generator=torch.Generator().manual_seed(1))
    for row in range(2):
        for _, end in spans(row):
            tokens[row, end - 1] = 0  # each document ends with its EOS
    with torch.no_grad():
        assert (ours(tokens) - theirs(tokens).logits).abs().max() < 1e-5
        out = packed(tokens)
        for row in range(2):
            for start, end in spans(row):
                alone = theirs(tokens[row : row + 1, start:end]).logits[0]
                first = min(3, end - start)
                assert (out[row, start : start + first] - alone[:first]).abs().max() < 1e-4, (row, start)
                assert (out[row, start:end] - alone).abs().max() < 1e-4, (row, start)

    convert_dcp_to_hf.convert(str(tmp_path / "dcp"), str(tmp_path / "back"), moe_args(), name="qwen3_5_moe")
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert back.keys() == files.keys()
    for name, w in files.items():
        assert torch.equal(back[name], w), name
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (config["architectures"], config["model_type"]) == (["Qwen3_5MoeForCausalLM"], "qwen3_5_moe_text")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32).eval()
    assert type(exported).__name__ == "Qwen3_5MoeForCausalLM"
    with torch.no_grad():
        assert (ours(tokens) - exported(tokens).logits).abs().max() < 1e-5


@pytest.mark.parametrize("flavor", ["35B-A3B", "122B-A10B", "397B-A17B", "Next-80B-A3B"])
def test_moe_flavours_have_the_published_sizes(flavor):
    """Built on the meta device with the released vocabulary (Qwen3.5's 248,320, Qwen3-Next's 151,936),
    each flavour's text model has its name's parameters within 2% (the released folders add the vision
    encoder and the MTP head) and its active parameters (top_k of the experts, as MFU counts them)
    within 0.5B of the name's (Qwen3-Next's, 3.9B, within 1B)."""
    from dataclasses import replace

    from torchtitan.models import MODEL_SPECS
    from torchtitan.models.qwen3_5 import qwen3_5_flops_per_token
    from torchtitan.models.qwen3_5_moe import qwen3_5_moe_flops_per_token

    spec = MODEL_SPECS["qwen3_5_moe"]
    args = replace(spec.flavors[flavor], vocab_size=151936 if flavor.startswith("Next") else 248320)
    with torch.device("meta"):
        model = spec.build(args)
    total = model.num_params()
    active = (qwen3_5_moe_flops_per_token(args, total, 4096) - qwen3_5_flops_per_token(args, 0, 4096)) / 6
    named_total, named_active = (float(x) * 1e9 for x in flavor.removeprefix("Next-")[:-1].split("B-A"))
    assert abs(total - named_total) < 0.02 * named_total, total
    assert abs(active - named_active) < (1e9 if flavor.startswith("Next") else 0.5e9), active


# Hugging Face folders as the released checkpoints come: vision-language (Qwen3.5, Qwen3.5-MoE) and
# Qwen3-Next's fused layout.


def vision_language_folder(text_folder, folder, model_type: str):
    """The released layout, written by hand from a text-only folder: config.json's settings under
    `text_config`, the text model under model.language_model.*, beside a vision encoder
    (model.visual.*) and a multi-token prediction head (mtp.*), which no model here has a place for."""
    from safetensors.torch import load_file, save_file

    text = json.loads((text_folder / "config.json").read_text())
    tensors = {
        name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name: w
        for name, w in load_file(text_folder / "model.safetensors").items()
    }
    tensors["model.visual.patch_embed.proj.weight"] = torch.ones(8, 3, 2, 2)
    tensors["model.visual.blocks.0.attn.qkv.weight"] = torch.ones(24, 8)
    tensors["mtp.fc.weight"] = torch.ones(ARGS.dim, 2 * ARGS.dim)
    folder.mkdir()
    save_file(tensors, folder / "model.safetensors")
    config = {
        "model_type": model_type,
        "architectures": [f"{type_name(model_type)}ForConditionalGeneration"],
        "text_config": text,
        "vision_config": {"depth": 1, "hidden_size": 8},
        "tie_word_embeddings": text.get("tie_word_embeddings", False),
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def type_name(model_type: str) -> str:
    return {"qwen3_5": "Qwen3_5", "qwen3_5_moe": "Qwen3_5Moe"}[model_type]


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5_moe"])
def test_a_vision_language_folder_loads_its_text_model(tmp_path, name):
    """The released checkpoints' layout: checkpoint.initial_load_path reads the text model (the same
    weights, bit for bit, as from the text-only folder), naming what it leaves out in one line; so does
    scripts/convert_hf_to_dcp.py. A job of the other Qwen3.5 family refuses it in one line."""
    from dataclasses import replace

    from scripts import convert_hf_to_dcp
    from torchtitan.checkpoint.hf_reader import HFReader, load_hf_weights
    from torchtitan.config.options import ConfigError
    from torchtitan.config.parser import parse_args
    from torchtitan.models import MODEL_SPECS, hf_vocab_size

    theirs = hf_moe_model() if name == "qwen3_5_moe" else hf_model(tied=True)
    theirs.save_pretrained(tmp_path / "text")
    folder = vision_language_folder(tmp_path / "text", tmp_path / "vlm", name)
    args = moe_args() if name == "qwen3_5_moe" else replace(ARGS, tie_word_embeddings=True)
    model = MODEL_SPECS[name].build(args)
    job = parse_args(["--model.name", name])
    reader = load_hf_weights(model, str(folder), job.model, args)
    expected = HFReader(str(tmp_path / "text"), "hf_folder").read_all()
    assert model.state_dict().keys() == expected.keys()
    for key, w in model.state_dict().items():
        assert torch.equal(w, expected[key]), key
    assert reader.skipped_summary() == (
        "vision encoder: 2 tensors (model.visual.blocks.0.attn.qkv.weight, ...); "
        "multi-token prediction: 1 tensors (mtp.fc.weight)"
    )
    assert convert_hf_to_dcp.convert(str(folder), str(tmp_path / "dcp")).skipped == reader.skipped
    assert hf_vocab_size(str(folder)) == ARGS.vocab_size  # model.vocab_size -1 takes text_config's

    other = "qwen3_5" if name == "qwen3_5_moe" else "qwen3_5_moe"
    with pytest.raises(ConfigError, match=f"^model.name: .* holds a {name} model .* not this job's {other}"):
        HFReader(str(folder), "checkpoint.initial_load_path", other)


def test_a_qwen3_next_folder_loads_with_its_fused_projections(tmp_path):
    """A Qwen3NextForCausalLM folder (Gated DeltaNet's q, k, v, z and b, a fused per key head) read as
    qwen3_5_moe: the same logits as transformers' Qwen3-Next within 1e-5."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    from scripts import convert_hf_to_dcp
    from torchtitan.checkpoint.load import read_model_weights
    from torchtitan.models import MODEL_SPECS

    moe = hf_moe_model().config.to_dict()
    keys = [k for k in moe if k.startswith(("linear_", "num_", "moe_", "shared_", "head_dim", "hidden_size"))]
    config = Qwen3NextConfig(
        **{k: moe[k] for k in keys},
        vocab_size=ARGS.vocab_size,
        rms_norm_eps=ARGS.norm_eps,
        rope_parameters=hf_config().rope_parameters,
        norm_topk_prob=True,
    )
    torch.manual_seed(0)
    theirs = Qwen3NextForCausalLM(config).eval()
    with torch.no_grad():
        for param_name, p in theirs.named_parameters():
            p.normal_(0.0, 1.0 if param_name.endswith("mlp.gate.weight") else 0.05 if p.ndim > 1 else 0.5)
    theirs.save_pretrained(tmp_path / "next")
    assert json.loads((tmp_path / "next" / "config.json").read_text())["model_type"] == "qwen3_next"
    convert_hf_to_dcp.convert(str(tmp_path / "next"), str(tmp_path / "dcp"))
    ours = MODEL_SPECS["qwen3_5_moe"].build(moe_args()).eval()
    ours.load_state_dict(read_model_weights(str(tmp_path / "dcp")))
    tokens = torch.randint(0, ARGS.vocab_size, (2, LENGTH), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ours(tokens) - theirs(tokens).logits).abs().max() < 1e-5


def test_a_run_starts_from_a_vision_language_folder(tmp_path, capsys):
    """train.py with checkpoint.initial_load_path a released-layout Qwen3.5-MoE folder (the debug model's
    4 layers, the tests' tiny job): its first loss is transformers' on the same batch within 1e-5, and
    what it left out is named in one log line. A job of the dense family refuses it: one line, exit 2."""
    import torch.distributed.checkpoint as dcp
    import torch.nn.functional as F
    from launch import ROOT, TINY_JOB, losses, run_train_in_process
    from test_convert import random_model
    from transformers import AutoModelForCausalLM

    from torchtitan.checkpoint.hf_export import export_hf
    from torchtitan.config.parser import parse_args
    from torchtitan.datasets.build import build_training_data_loader
    from torchtitan.datasets.layout import BatchLayout
    from torchtitan.datasets.tokenizer import Tokenizer
    from torchtitan.models import build_model_args

    argv = [*TINY_JOB, "--training.steps", "1", "--model.name", "qwen3_5_moe", "--model.n_layers", "4"]
    job = parse_args(argv)
    tokenizer = Tokenizer(ROOT / "assets" / "tokenizer" / "kjv_bpe.tiktoken")
    args = build_model_args(job, tokenizer.n_words)
    dcp.save({"model": random_model(args, "qwen3_5_moe").state_dict()}, checkpoint_id=str(tmp_path / "dcp"))
    export_hf(str(tmp_path / "dcp"), str(tmp_path / "ours"), args, name="qwen3_5_moe")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    theirs.save_pretrained(tmp_path / "text")
    folder = vision_language_folder(tmp_path / "text", tmp_path / "vlm", "qwen3_5_moe")

    layout = BatchLayout(job.training.batch_size)
    batch = next(iter(build_training_data_loader(job.training, tokenizer, layout, args.vocab_size, False)))
    with torch.no_grad():
        logits = theirs(batch.inputs, use_cache=False).logits
    expected = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten()).item()
    capsys.readouterr()
    run = ["--checkpoint.initial_load_path", str(folder), "--job.dump_folder", str(tmp_path / "run")]
    code = run_train_in_process(*argv, *run)
    assert code == 0
    assert abs(losses(tmp_path / "run")[1] - expected) <= 1e-5, (losses(tmp_path / "run"), expected)
    skipped = [line for line in capsys.readouterr().out.splitlines() if "Not loading tensors" in line]
    assert len(skipped) == 1 and "vision encoder: 2 tensors" in skipped[0], skipped

    # The dense family's job refuses the folder in one line, exit 2, before a step.
    dense = [*TINY_JOB, "--model.n_layers", "4", "--model.name", "qwen3_5", *run[:2]]
    assert run_train_in_process(*dense, "--job.dump_folder", str(tmp_path / "dense")) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "holds a qwen3_5_moe model" in errors[0], errors
    assert "not this job's qwen3_5 " in errors[0] and not (tmp_path / "dense" / "metrics.jsonl").exists()
